"""The rank stage's vectorized calibration pass gives the scores of the direct computation.

``ReferenceAccumulator`` is the scorer as it was before (every hooked activation copied to float64,
each head's ``W_i o_ti`` formed and its norm taken, the whole forward including the LM head). The
current ``Accumulator`` takes head norms through each head's Gram matrix, computes each weight-derived constant
once per pass, and stops the forward before the LM head. On a heterogeneous tiny Llama and
a tiny MoE the two agree to float64 rounding (rtol 1e-9), the permutations are the same, and the
LM head is never run. The speed is measured by ``bench/bench_rank.py``, not here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybrid_utils import conf_spec, ids

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.rank.hooks import Accumulator, Reduce, _in_features
from autocompress_nemo.rank.importance import collect_importance
from autocompress_nemo.rank.reorder import permutations_from_scores


class ReferenceAccumulator(Accumulator):
    """The direct formulas (the scorer before the vectorized one)."""

    def head_norms(self, proj: torch.nn.Module, key: Any, head_dim: int) -> None:
        n = _in_features(proj) // head_dim
        self.zeros(key, (n,), proj, Reduce.UNITS)

        def hook(mod: Any, args: tuple) -> None:
            o, w = args[0].double(), mod.weight.double()
            c = torch.einsum("...nd,hnd->...nh", o.view(*o.shape[:-1], n, head_dim), w.view(-1, n, head_dim))
            self.add(key, c.norm(dim=-1).reshape(-1, n).sum(dim=0))

        self.pre_hook(proj, hook)

    def neurons(self, down: torch.nn.Module, key: Any, row: int | None = None, rows: int = 1) -> None:
        f = _in_features(down)
        self.zeros(key, (f,) if row is None else (rows, f), down, Reduce.UNITS if row is None else Reduce.EXPERT_UNITS)

        def hook(mod: Any, args: tuple) -> None:
            a = args[0].double().reshape(-1, f)
            self.add(key, a.abs().sum(dim=0) * mod.weight.double().norm(dim=0), row)

        self.pre_hook(down, hook)

    def channels(self, reader: torch.nn.Module, key: Any = "hidden") -> None:
        h = _in_features(reader)
        self.zeros(key, (h,), reader, Reduce.STREAM)

        def hook(mod: Any, args: tuple) -> None:
            self.add(key, args[0].double().reshape(-1, h).abs().sum(dim=0))

        self.pre_hook(reader, hook)


def _hetero_llama() -> ArchSpec:
    """3 layers, hidden 64, head_dim 16: per-layer query heads / KV groups and ffn widths."""
    blocks = (
        AttentionBlock(4, 2, 16),
        MlpBlock(96),
        AttentionBlock(2, 1, 16),
        MlpBlock(48),
        AttentionBlock(4, 4, 16),
        MlpBlock(128),
    )
    return ArchSpec(hidden=64, vocab=128, blocks=blocks, family="llama", name="hetero_llama")


def _model(spec: ArchSpec, seed: int) -> torch.nn.Module:
    model = build_model(spec)
    hf_to_megatron(spec, random_hf_state_dict(spec, seed=seed), model)
    return model.eval()


@pytest.mark.parametrize("name", ["hetero_llama", "tiny_moe"])
def test_vectorized_scores_equal_the_direct_computation(megatron_tp1, name):
    spec = _hetero_llama() if name == "hetero_llama" else conf_spec("tiny_moe")
    model = _model(spec, seed=5)
    batches = [ids(spec, T=24, B=2, seed=s) for s in (1, 2, 3)]
    head_calls = [0]
    handle = model.output_layer.register_forward_hook(lambda *_: head_calls.__setitem__(0, head_calls[0] + 1))
    try:
        old = collect_importance(
            model, spec, batches, forward_logits, accumulator=ReferenceAccumulator, skip_head=False
        )
        assert head_calls[0] == len(batches)  # the direct pass runs the LM head on every batch
        head_calls[0] = 0
        lines: list[str] = []
        new = collect_importance(model, spec, batches, forward_logits, log=lines.append)
        assert head_calls[0] == 0, "the calibration pass must stop before the LM head"
    finally:
        handle.remove()
    assert lines and lines[-1].startswith(f"[rank {len(batches)}/{len(batches)}]"), lines
    assert old.tokens == new.tokens == sum(b.numel() for b in batches)
    torch.testing.assert_close(new.hidden, old.hidden, rtol=1e-9, atol=0)
    names = set()
    for bo, bn in zip(old.blocks, new.blocks, strict=True):
        assert bo.keys() == bn.keys()
        for k in bo:
            names.add(k)
            assert bo[k].abs().max() > 0, k
            torch.testing.assert_close(bn[k], bo[k], rtol=1e-9, atol=1e-300)
    assert {"heads", "ffn"} <= names or {"experts", "expert_ffn"} <= names, names
    po, pn = (
        permutations_from_scores(spec, old, sort_hidden=True),
        permutations_from_scores(spec, new, sort_hidden=True),
    )
    assert torch.equal(po.hidden, pn.hidden)
    for bo, bn in zip(po.blocks, pn.blocks, strict=True):
        assert bo.keys() == bn.keys()
        for k in bo:
            assert torch.equal(bo[k], bn[k]), k

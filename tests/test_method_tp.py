"""Determinism across tensor parallelism: rank scores, the sorted parent and the router's
choices are the same at TP=1 and TP=2 (2 gloo processes)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed


def _search_on_rank(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from autocompress_nemo.arch.counts import param_count
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import forward_logits
    from autocompress_nemo.rank.importance import collect_importance
    from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores
    from autocompress_nemo.search.autocompress import run_router_search
    from autocompress_nemo.search.space import build_space
    from tests.cfg_utils import ROUTER, search_cfg
    from tests.method_utils import CAPS, ParamCost, megatron_from_hf, tiny_parent

    init_distributed(tp=world)
    spec, sd = tiny_parent()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab, (2, 16), generator=g) for _ in range(6)]
    model = megatron_from_hf(spec, sd)
    imp = collect_importance(model, spec, batches[:2], forward_logits)
    perms = permutations_from_scores(spec, imp)
    sorted_sd = apply_permutations(spec, sd, perms)
    decisions = build_space(spec, CAPS, ffn_options=4)
    smodel = megatron_from_hf(spec, sorted_sd)

    out = run_router_search(
        smodel,
        spec,
        decisions,
        ParamCost(),
        {"params": 0.75 * param_count(spec)},
        lambda s: batches[s % 6],
        forward_logits,
        search_cfg(**ROUTER, steps=25, checkpoint_every=0),
        seed=3,
        log=lambda s: None,
        router_init="parent",
    )
    return {
        "ffn": [b["ffn"] for b in imp.blocks[1::2]],
        "heads": [b["heads"] for b in imp.blocks[0::2]],
        "perm_ffn": [b["ffn"] for b in perms.blocks[1::2]],
        "perm_heads": [b["heads"] for b in perms.blocks[0::2]],
        "choices": out.choices,
        "probs": out.probs,
        "kd": [r["kd"] for r in out.trajectory],
    }


def test_tp2_rank_and_search_equal_tp1() -> None:
    from autocompress_nemo.distributed.spawn import spawn

    one = spawn(_search_on_rank, 1)[0]
    two = spawn(_search_on_rank, 2)
    for r in two:
        for a, b in zip(one["ffn"] + one["heads"], r["ffn"] + r["heads"], strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
        assert all(
            torch.equal(a, b)
            for a, b in zip(one["perm_ffn"] + one["perm_heads"], r["perm_ffn"] + r["perm_heads"], strict=True)
        )
        assert r["choices"] == one["choices"]
        for pa, pb in zip(one["probs"], r["probs"], strict=True):
            assert max(abs(x - y) for x, y in zip(pa, pb, strict=True)) < 1e-4
        assert max(abs(x - y) for x, y in zip(one["kd"], r["kd"], strict=True)) < 1e-4

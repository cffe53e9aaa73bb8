"""Parallel parity: the same model at TP=2 (2 gloo processes) and TP=1 gives the same logits and
gradients, for a uniform tiny model and a heterogeneous one (per-layer query heads, KV groups and
ffn widths, one removed attention block, one removed mlp), with and without sequence parallelism.

Tolerance 1e-5: float32 sums over at most a few hundred terms, reduced in a different order across
ranks; differences measured here are ~1e-7.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distributed.spawn import spawn
from autocompress_nemo.models.llama.reference import random_hf_state_dict

pytestmark = pytest.mark.distributed
TOL = 1e-5


def run_model(rank: int, world: int, spec_json: str, hf_sd: dict, ids: torch.Tensor, sps: list[bool]) -> list:
    """On each rank, for each sequence-parallel setting: build at TP=world, load ``hf_sd``,
    forward + backward; returns [(full logits, HF-named full gradients)] per setting."""
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.llama import hf_to_megatron, megatron_to_hf

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=world, seed=0)
    out = []
    for sp in sps:
        model = build_model(spec, sequence_parallel=sp).train()
        assert model.config.sequence_parallel == (sp and world > 1)
        hf_to_megatron(spec, hf_sd, model)
        logits = forward_logits(model, ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        out.append((logits.detach(), megatron_to_hf(spec, model, grads=True)))
    return out


def _check(spec: ArchSpec, megatron_tp1: None) -> None:
    hf_sd = random_hf_state_dict(spec, seed=5)
    ids = torch.randint(0, spec.vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    ((ref_logits, ref_grads),) = run_model(0, 1, spec.to_json(), hf_sd, ids, [False])  # TP=1, this process
    per_rank = spawn(run_model, 2, spec.to_json(), hf_sd, ids, [False, True])
    for j, sp in enumerate([False, True]):
        worst_logit, worst_grad = 0.0, 0.0
        for rank_results in per_rank:
            logits, grads = rank_results[j]
            worst_logit = max(worst_logit, (logits - ref_logits).abs().max().item())
            assert set(grads) == set(ref_grads)
            for k in ref_grads:
                assert ref_grads[k].abs().max() > 0, f"{k}: zero reference gradient (the check would be vacuous)"
                worst_grad = max(worst_grad, (grads[k] - ref_grads[k]).abs().max().item())
        print(
            f"{spec.name} sequence_parallel={sp}: TP=2 vs TP=1 max |dlogits| = {worst_logit:.2e}, "
            f"max |dgrad| = {worst_grad:.2e}"
        )
        assert worst_logit < TOL and worst_grad < TOL


def test_tp2_matches_tp1_uniform(megatron_tp1):
    _check(tiny_uniform_spec(tied=True), megatron_tp1)


def test_tp2_matches_tp1_heterogeneous(megatron_tp1):
    _check(tiny_hetero_spec(), megatron_tp1)

"""Expert parallelism: EP=2 on 2 gloo processes gives the same logits and gradients as EP=1.

Each EP rank holds half of every MoE block's routed experts; the allgather token dispatcher
(the one that runs on CPU) sends every token to the rank owning its experts. Rank r runs sequence
r of a 2-sequence batch; the reference runs both in one process (loss = mean over all tokens).
Gradients are combined the way Megatron's DDP does for world 2 = DP 2 x EP 2: replicated
parameters averaged over the two ranks, routed-expert parameters (which already received the
tokens of both ranks) divided by the DP size. Models: tiny Qwen3-MoE (4 x attention + MoE) and
tiny Nemotron-H (Mamba, attention, MoE with shared expert, relu² MLP).

Also: TP=2 forward of the tiny hybrid equals TP=1 (Mamba heads and groups, experts split over TP).

Tolerance 1e-5: float32 sums in another order across ranks; measured ~1e-8 (EP), ~7e-7 (TP).
"""

from __future__ import annotations

import re

import pytest
import torch
from hybrid_utils import conf_spec, ids, requires_mamba

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distributed.spawn import spawn
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict

pytestmark = pytest.mark.distributed
TOL = 1e-5
EXPERT = re.compile(r"\.experts\.\d+\.")


def run_ep(rank: int, world: int, spec_json: str, hf_sd: dict, ids_BT: torch.Tensor) -> tuple:
    """Build at EP=world, load ``hf_sd``, forward + backward on this rank's share of the batch."""
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron, megatron_to_hf

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=1, ep=world, seed=0)
    model = build_model(spec).train()
    n_local = {
        len(layer.mlp.experts.local_experts)
        for layer in model.decoder.layers
        if hasattr(getattr(layer, "mlp", None), "experts")
    }
    x = ids_BT[rank : rank + 1] if world > 1 else ids_BT
    hf_to_megatron(spec, hf_sd, model)
    logits = forward_logits(model, x)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab), x[:, 1:].reshape(-1))
    loss.backward()
    grads = megatron_to_hf(spec, model, grads=True)
    if world > 1:
        for k, g in grads.items():
            if EXPERT.search(k):
                g.div_(world)
            else:
                torch.distributed.all_reduce(g)
                g.div_(world)
    return logits.detach(), grads, n_local


def _check(spec: ArchSpec) -> None:
    hf_sd = random_hf_state_dict(spec, seed=5)
    x = ids(spec, T=12, B=2, seed=3)
    ref_logits, ref_grads, ref_local = run_ep(0, 1, spec.to_json(), hf_sd, x)  # EP=1, this process
    per_rank = spawn(run_ep, 2, spec.to_json(), hf_sd, x)
    worst_logit = worst_grad = 0.0
    for r, (logits, grads, n_local) in enumerate(per_rank):
        assert n_local == {n // 2 for n in ref_local}, "each EP rank must hold half of the experts"
        worst_logit = max(worst_logit, (logits - ref_logits[r : r + 1]).abs().max().item())
        assert set(grads) == set(ref_grads)
        for k in ref_grads:
            assert ref_grads[k].abs().max() > 0, f"{k}: zero reference gradient (the check would be vacuous)"
            worst_grad = max(worst_grad, (grads[k] - ref_grads[k]).abs().max().item())
    print(f"{spec.name}: EP=2 vs EP=1 max |dlogits| = {worst_logit:.2e}, max |dgrad| = {worst_grad:.2e}")
    assert worst_logit < TOL and worst_grad < TOL


def test_ep2_matches_ep1_qwen3_moe(megatron_tp1):
    _check(conf_spec("tiny_moe"))


@requires_mamba
def test_ep2_matches_ep1_nemotron_h(megatron_tp1):
    _check(conf_spec("tiny_hybrid"))


def run_tp(rank: int, world: int, spec_json: str, hf_sd: dict, ids_BT: torch.Tensor) -> tuple:
    """Build at TP=world (no sequence parallelism), load, read back, eval-mode logits."""
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron, megatron_to_hf

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=world, seed=0)
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    back = megatron_to_hf(spec, model)
    with torch.no_grad():
        return forward_logits(model, ids_BT), all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


@requires_mamba
def test_tp2_forward_matches_tp1_hybrid(megatron_tp1):
    """Also tensor parallelism for the hybrid blocks (Mamba heads / groups, shared expert, experts
    split over TP=2): the same logits and an exact state-dict round trip (forward only: Megatron
    refuses MoE training at TP>1 without sequence parallelism)."""
    spec = conf_spec("tiny_hybrid")
    hf_sd = random_hf_state_dict(spec, seed=1)
    x = ids(spec)
    ref, _ = run_tp(0, 1, spec.to_json(), hf_sd, x)
    for logits, exact in spawn(run_tp, 2, spec.to_json(), hf_sd, x):
        assert exact and (logits - ref).abs().max().item() < TOL


def run_kd_train(
    rank: int, world: int, spec_json: str, student_sd: dict, teacher_sd: dict, batches: list[torch.Tensor]
) -> dict:
    """``kd_train`` (Minitron++ retraining, search warm-up) at EP=``world``: every rank passes the
    same global batches. Returns the gradients Adam received at its first step (full set, experts
    gathered from the EP ranks) and the loss history."""
    from autocompress_nemo.distill import kd
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron, megatron_to_hf

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=1, ep=world, seed=0)
    student, teacher = build_model(spec).train(), build_model(spec).eval()
    hf_to_megatron(spec, student_sd, student)
    hf_to_megatron(spec, teacher_sd, teacher)
    seen: dict = {}

    class Recording(torch.optim.SGD):  # stands in for Adam: records the reduced gradients, then steps
        def __init__(self, params, lr):  # noqa: ANN001
            super().__init__(params, lr=lr)

        def step(self, closure=None):  # noqa: ANN001, ANN202
            if not seen:
                seen.update(megatron_to_hf(spec, student, grads=True))
            return super().step(closure)

    adam = torch.optim.Adam
    torch.optim.Adam = Recording  # kd_train builds torch.optim.Adam; put it back afterwards (EP=1 runs in-process)
    try:
        losses = kd.kd_train(
            student, lambda x: forward_logits(teacher, x), lambda x: forward_logits(student, x), batches, lr=1e-2
        )
    finally:
        torch.optim.Adam = adam
    return {"grads": seen, "losses": losses}


def test_kd_train_ep2_matches_ep1(megatron_tp1):
    """Every rank runs the same batches, so each routed expert sees each token twice under EP=2;
    ``kd_train`` must divide those gradients by the data-parallel size (as Megatron's DDP does) —
    without that the expert gradients come out 2x (Adam would hide most of it, the gradients
    do not)."""
    spec = conf_spec("tiny_moe")
    s_sd, t_sd = random_hf_state_dict(spec, seed=5), random_hf_state_dict(spec, seed=6)
    batches = [ids(spec, T=12, B=2, seed=s) for s in (3, 4)]
    ref = run_kd_train(0, 1, spec.to_json(), s_sd, t_sd, batches)
    worst = 0.0
    for out in spawn(run_kd_train, 2, spec.to_json(), s_sd, t_sd, batches):
        assert set(out["grads"]) == set(ref["grads"])
        for k, g in ref["grads"].items():
            assert g.abs().max() > 0, f"{k}: zero reference gradient"
            worst = max(worst, ((out["grads"][k] - g).abs().max() / g.abs().max()).item())
        assert max(abs(a - b) for a, b in zip(out["losses"], ref["losses"], strict=True)) < TOL
    print(f"kd_train EP=2 vs EP=1: max relative gradient difference {worst:.2e}")
    assert worst < TOL

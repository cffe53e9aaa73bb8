"""The method on a tiny hybrid (``tiny_hybrid``: ``M*EME-``, 4 routed experts top-2, a shared
expert): the hybrid search space, masked supernet == extracted child (routed experts masked in
the router before top-k, expert / shared neurons, whole Mamba groups, top-k on a softmax MoE),
and importance reordering then a router search at EP=1 toward a parameter budget whose
extracted architecture meets it.

Tolerance 2e-5 on logits: the child's matmuls have other shapes (float32 sums in another order).
"""

from __future__ import annotations

import torch
from hybrid_utils import ALL_CAPS, conf_spec, ids, requires_mamba

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.search.space import apply_choices, build_space
from autocompress_nemo.search.supernet import Supernet
from tests.cfg_utils import search_cfg
from tests.method_utils import ParamCost

TOL = 2e-5
ALL = ALL_CAPS


def _model(spec, sd):
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model


def _masked_vs_child(spec, sd, decisions, choices, x):
    model = _model(spec, sd)
    net = Supernet(model, spec, decisions)
    net.set_choices(choices)
    with torch.no_grad():
        masked = forward_logits(model, x)
        net.enabled = False
        full = forward_logits(model, x)
    net.remove()
    assert (masked - full).abs().max().item() > 1e-3, "the masks changed nothing: the comparison would be vacuous"
    child = apply_choices(spec, decisions, choices)
    with torch.no_grad():
        ref = forward_logits(_model(child, slice_state_dict(spec, sd, child)), x)
    return child, (masked - ref).abs().max().item()


@requires_mamba
def test_hybrid_space_kinds_and_exact_masks(megatron_tp1):
    spec = conf_spec("tiny_hybrid")
    decisions = build_space(spec, ALL)
    kinds = {d.kind for d in decisions}
    assert kinds == {"mamba", "attention", "moe_routed", "moe_shared", "mlp"}
    mamba = next(d for d in decisions if d.kind == "mamba")
    assert [o.num_heads for o in mamba.options] == [0, 2, 4]  # whole groups of 2 heads
    sd = random_hf_state_dict(spec, seed=1)
    x = ids(spec, T=10, B=2)
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        choices = [int(torch.randint(0, len(d.options), (1,), generator=gen)) for d in decisions]
        if trial == 0:  # a routed part with fewer experts and a smaller shared expert, Mamba to one group
            choices = [1 if d.kind in ("moe_routed", "moe_shared", "mamba") else len(d.options) - 1 for d in decisions]
        if trial == 1:  # routed experts of the first MoE block removed (its shared expert stays), a Mamba block removed
            choices = [
                0 if d.kind == "mamba" or (d.kind == "moe_routed" and d.block_index == 2) else k
                for d, k in zip(decisions, choices, strict=True)
            ]
        child, err = _masked_vs_child(spec, sd, decisions, choices, x)
        print(f"trial {trial}: {child.pattern} {[b for b in child.blocks if b.kind == 'moe']} err={err:.2e}")
        assert err < TOL, (child, err)
        assert param_count(child) < param_count(spec)


def test_topk_and_expert_masks_softmax_moe(megatron_tp1):
    """Qwen3-MoE (softmax router): fewer experts and a smaller top-k, masked == extracted."""
    import dataclasses

    base = conf_spec("tiny_moe")  # top-2 of 4; top-3 here so that a smaller top-k (2) is an option
    spec = base.replace(blocks=tuple(dataclasses.replace(b, top_k=3) if b.kind == "moe" else b for b in base.blocks))
    decisions = [d for d in build_space(spec, ALL) if d.kind == "moe_routed"]
    sd = random_hf_state_dict(spec, seed=2)
    x = ids(spec, T=10, B=2)
    d0 = decisions[0]
    pb = spec.blocks[d0.block_index]
    smaller_k = next(
        i for i, o in enumerate(d0.options) if o.num_experts and o.top_k < pb.top_k and o.num_experts < pb.num_experts
    )
    choices = [smaller_k] + [len(d.options) - 2 for d in decisions[1:]]
    child, err = _masked_vs_child(spec, sd, decisions, choices, x)
    print(child.blocks, err)
    assert err < TOL


@requires_mamba
def test_reorder_then_router_search_meets_params_budget(megatron_tp1):
    from autocompress_nemo.extract.repair import repair
    from autocompress_nemo.rank.importance import collect_importance
    from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores
    from autocompress_nemo.search.autocompress import run_router_search
    from autocompress_nemo.search.judge import ProxyJudge

    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=3)
    model = _model(spec, sd)
    batches = [ids(spec, T=16, B=2, seed=s) for s in (20, 21)]
    imp = collect_importance(model, spec, batches, forward_logits)
    sorted_sd = apply_permutations(spec, sd, permutations_from_scores(spec, imp))
    model = _model(spec, sorted_sd)
    caps = {**ALL, "remove_attention": False, "remove_mlp": False}
    decisions = build_space(spec, caps)
    costs = ParamCost()
    budget = {"params": 0.8 * param_count(spec)}
    cfg = search_cfg(
        steps=40,
        router_lr=0.2,
        train_weights=False,
        weight_lr=0.0,
        tau_start=1.0,
        tau_end=0.2,
        kd_temperature=1.0,
        penalty_over=20.0,
        penalty_under=1.0,
        slack=0.05,
        checkpoint_every=0,
    )
    out = run_router_search(
        model,
        spec,
        decisions,
        costs,
        budget,
        lambda s: batches[s % 2],
        forward_logits,
        cfg,
        seed=0,
        log=lambda s: None,
        router_init="parent",
    )
    first, last = out.trajectory[0]["expected_params"], out.trajectory[-1]["expected_params"]
    print(f"expected params {first:.0f} -> {last:.0f}, budget {budget['params']:.0f}")
    assert first > budget["params"] * 1.05  # started well above the budget
    assert abs(last / budget["params"] - 1) < 0.1  # moved to it
    imp_rows = [
        [float(costs.predict(apply_choices(spec, [d], [k]))["params"]) for k in range(len(d.options))]
        for d in decisions
    ]  # parameter-proportional importance
    choices, _ = repair(spec, decisions, out.choices, costs.predict, budget, ProxyJudge(imp_rows))
    child = apply_choices(spec, decisions, choices)
    assert costs.predict(child)["params"] <= budget["params"]
    x = ids(spec, T=10, B=2, seed=9)
    _, err = _masked_vs_child(spec, sorted_sd, decisions, choices, x)
    assert err < TOL

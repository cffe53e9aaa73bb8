"""Minitron++ on MoE / Mamba hybrids (issue 6): uniform widths per decision kind, the depth axis
(remove the least important removable blocks, importance = KD loss with the block alone removed),
and a feasible Minitron++ student on ``tiny_hybrid`` (``M*EME-``) where no width-only candidate
meets the budget. Dense parents keep their width-only candidates (no removable layer under
llama.cpp-like capabilities)."""

from __future__ import annotations

import pytest
import torch
from hybrid_utils import ALL_CAPS, conf_spec, ids, requires_mamba

from autocompress_nemo.arch.counts import block_params, param_count
from autocompress_nemo.arch.spec import ArchSpec, MambaBlock, MlpBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.search.minitron import (
    feasible_uniform,
    removable_units,
    run_minitron_pp,
    unit_importance,
)
from autocompress_nemo.search.space import apply_choices, build_space, uniform_candidates
from tests.cfg_utils import search_cfg
from tests.method_utils import CAPS, TINY, ParamCost

# the torch_eager CPU engine's capabilities (conf/engine/torch_eager_cpu.yaml) but with attention
# removal allowed, so that every block of tiny_hybrid is a removable unit
ALL = ALL_CAPS
ZEROED = 3  # the Mamba block made an identity by zeroing its output projection


class BlockOverheadCost:
    """A decode-time-like cost with a fixed overhead per kept block (as eager CPU decoding has):
    ``sum over kept blocks (1 + params(b) / 100000)``. Shrinking widths only removes the second
    term, so tight budgets need blocks removed."""

    def predict(self, spec: ArchSpec) -> dict[str, float]:
        return {"decode_ms": sum(1.0 + block_params(b, spec.hidden) / 100_000 for b in spec.blocks if not b.removed)}


def _uniform_per_kind(spec: ArchSpec) -> bool:
    kept = {}
    for b in spec.blocks:
        if not b.removed and kept.setdefault(b.kind, b) != b:
            return False
    return True


def test_uniform_candidates_are_uniform_per_kind() -> None:
    spec = conf_spec("tiny_hybrid")
    decisions = build_space(spec, ALL, ffn_options=4)
    cands = uniform_candidates(spec, decisions)
    shapes = {}
    for d in decisions:
        shapes.setdefault(d.kind, {o for o in d.options if not o.removed})
    expected = 1
    for s in shapes.values():
        expected *= len(s)
    assert len(cands) == expected == len({tuple(c) for c in cands})  # the full product, no duplicates
    assert [d.parent_option for d in decisions] in cands
    for ch in cands:
        child = apply_choices(spec, decisions, ch)
        assert not any(b.removed for b in child.blocks)
        assert _uniform_per_kind(child), child.blocks


def test_uniform_fraction_when_blocks_of_a_kind_differ() -> None:
    """Blocks of one kind with different parent widths: a common fraction, snapped down per block."""
    M, F = MambaBlock, MlpBlock
    spec = ArchSpec(
        hidden=64,
        vocab=128,
        family="nemotron_h",
        blocks=(M(4, 16, 16, 2), F(128, "relu2"), M(8, 16, 16, 4), F(64, "relu2")),
    )
    decisions = build_space(spec, {"vary_ffn": True, "vary_mamba_heads": True, "ffn_align": 16}, ffn_options=4)
    pairs = set()
    for ch in uniform_candidates(spec, decisions):
        b = apply_choices(spec, decisions, ch).blocks
        pairs.add(((b[0].num_heads, b[2].num_heads), (b[1].ffn, b[3].ffn)))
    mamba = sorted({p[0] for p in pairs})
    mlp = sorted({p[1] for p in pairs})
    assert mlp == [(32, 16), (64, 32), (96, 48), (128, 64)]  # the same fraction of 128 and of 64
    # fractions 1/4 .. 1 of 8 heads; 4 heads in 2 groups offer 1/2 and 1 (1/4 snaps up to its smallest, 2)
    assert mamba == [(2, 2), (2, 4), (2, 6), (4, 8)]
    assert len(pairs) == 16


def _hybrid_model(spec: ArchSpec, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model


def _zeroed_parent() -> tuple[ArchSpec, dict[str, torch.Tensor]]:
    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=1)
    sd[f"backbone.layers.{ZEROED}.mixer.out_proj.weight"] = torch.zeros_like(
        sd[f"backbone.layers.{ZEROED}.mixer.out_proj.weight"]
    )
    return spec, sd


@requires_mamba
def test_depth_axis_removes_the_least_important_blocks(megatron_tp1) -> None:
    spec, sd = _zeroed_parent()
    decisions = build_space(spec, ALL, ffn_options=4)
    units = removable_units(spec, decisions)
    assert [u.blocks for u in units] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    model = _hybrid_model(spec, sd)
    batches = [ids(spec, T=16, B=2, seed=s) for s in range(2)]
    scores, tokens = unit_importance(model, spec, decisions, units, batches, forward_logits)
    print("KD when removed:", {u.blocks[0]: f"{s:.2e}" for u, s in zip(units, scores, strict=True)})
    assert tokens == len(units) * sum(x.numel() for x in batches)
    by_block = {u.blocks[0]: s for u, s in zip(units, scores, strict=True)}
    assert by_block[ZEROED] < 1e-6  # its removal leaves the logits unchanged
    assert min(s for b, s in by_block.items() if b != ZEROED) > 1e-4
    # the masks are gone afterwards: the model is the parent again
    x = batches[0]
    with torch.no_grad():
        ref = forward_logits(_hybrid_model(spec, sd), x)
        assert (forward_logits(model, x) - ref).abs().max().item() < 1e-5
    # the depth axis removes units in that order: with a budget only one removal meets, block 3 goes
    order = [u for _, u in sorted(zip(scores, units, strict=True), key=lambda t: t[0])]
    cost = BlockOverheadCost()
    widest = cost.predict(spec)["decode_ms"]
    feas = feasible_uniform(spec, decisions, cost, {"decode_ms": widest - 1.0}, order)
    assert feas and {c.removed for c in feas} <= {(ZEROED,), ()}
    assert any(c.removed == (ZEROED,) for c in feas)


@requires_mamba
def test_minitron_pp_on_hybrid_removes_blocks_when_widths_cannot_meet_the_budget(megatron_tp1) -> None:
    spec, sd = _zeroed_parent()
    decisions = build_space(spec, ALL, ffn_options=4)
    cost = BlockOverheadCost()
    width_only = min(
        cost.predict(apply_choices(spec, decisions, ch))["decode_ms"] for ch in uniform_candidates(spec, decisions)
    )
    budget = {"decode_ms": 0.75 * cost.predict(spec)["decode_ms"]}
    assert width_only > budget["decode_ms"], "the test needs a budget no width-only candidate meets"
    cfg = search_cfg(
        minitron_candidates=2,
        minitron_score_batches=1,
        minitron_retrain_steps=1,
        weight_lr=1e-5,
        kd_temperature=1.0,
        minitron_depth=False,
    )
    model = _hybrid_model(spec, sd)
    with pytest.raises(ValueError, match="every block kept, as the paper's baseline"):  # the paper's Minitron++
        run_minitron_pp(
            model,
            spec,
            decisions,
            cost,
            budget,
            lambda step: ids(spec, T=16, B=2, seed=step),
            forward_logits,
            cfg,
            log=lambda s: None,
            fresh_model=lambda: _hybrid_model(spec, sd),
        )
    cfg.minitron_depth = True  # the extension: Minitron's depth pruning
    logs: list[str] = []
    out = run_minitron_pp(
        _hybrid_model(spec, sd),
        spec,
        decisions,
        cost,
        budget,
        lambda step: ids(spec, T=16, B=2, seed=step),
        forward_logits,
        cfg,
        log=logs.append,
        fresh_model=lambda: _hybrid_model(spec, sd),
    )
    print("\n".join(logs))
    child = apply_choices(spec, decisions, out.choices)
    assert cost.predict(child)["decode_ms"] <= budget["decode_ms"]
    removed = [i for i, b in enumerate(child.blocks) if b.removed]
    assert removed and ZEROED in removed
    least = [e["blocks"][0] for e in out.block_importance][: len(removed)]
    assert sorted(least) == removed  # exactly the least important blocks
    assert _uniform_per_kind(child)
    assert out.importance_tokens == 6 * 32 and out.tokens > out.importance_tokens  # 6 units x 1 batch of 2x16
    assert len(out.trajectory) == 2 and all(t["removed_blocks"] for t in out.trajectory)
    assert param_count(child) < param_count(spec)


def test_dense_parent_keeps_width_only_candidates() -> None:
    """llama.cpp-like capabilities (ffn never removed): no removable layer, so the candidates and
    their order are the width-only ones; with ffn removal allowed, whole layers become the units."""
    decisions = build_space(TINY, CAPS)
    assert removable_units(TINY, decisions) == []
    cost = ParamCost()
    budget = {"params": 0.7 * param_count(TINY)}
    feas = feasible_uniform(TINY, decisions, cost, budget)
    reference = []
    for ch in uniform_candidates(TINY, decisions):
        c = cost.predict(apply_choices(TINY, decisions, ch))["params"]
        if c <= budget["params"]:
            reference.append((-c / budget["params"], ch))
    assert [c.choices for c in feas] == [ch for _, ch in sorted(reference)]
    assert all(c.removed == () and _uniform_per_kind(apply_choices(TINY, decisions, c.choices)) for c in feas)
    layer_caps = {**CAPS, "attention_needs_ffn": False, "first_block_full": False, "last_block_full": False}
    units = removable_units(TINY, build_space(TINY, layer_caps))
    assert [u.blocks for u in units] == [(0, 1), (2, 3), (4, 5)]


if __name__ == "__main__":
    pytest.main([__file__, "-x", "-q", "-s"])

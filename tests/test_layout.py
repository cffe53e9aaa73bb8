"""Parallel layout validation (megatron-core 0.19 rules) and the cost-based pipeline split."""

from __future__ import annotations

import pytest

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.plan.layout import (
    LayoutError,
    ParallelLayout,
    layout_for_stage,
    layout_problems,
    pipeline_stages,
    split_pipeline,
    validate_layout,
)


def hybrid() -> ArchSpec:
    """A small Nemotron-H-like model: 32 heads / 2 KV groups, 8 experts, Mamba 8 heads / 2 groups."""
    return ArchSpec.from_pattern(
        "M*EM-EM*E",
        hidden=256,
        vocab=1024,
        attention=AttentionBlock(32, 2, 8),
        mlp=MlpBlock(512, "relu2"),
        moe=MoeBlock(8, 128, 2, 256, 64, "relu2"),
        mamba=MambaBlock(8, 32, 16, 2),
    )


def check(layout: ParallelLayout, seq_len: int = 1024, batch: int = 16) -> list[str]:
    return layout_problems(layout, hybrid(), seq_len=seq_len, global_batch=batch)


def test_valid_layout_has_no_problems():
    L = ParallelLayout("search", nodes=2, procs_per_node=8, tp=2, pp=2, ep=4, etp=1)
    assert check(L) == []
    assert (L.world, L.dp, L.expert_dp) == (16, 4, 2)
    validate_layout(L, hybrid(), seq_len=1024, global_batch=16)


@pytest.mark.parametrize(
    "layout, expected",
    [
        # 1. tp=3 divides neither 32 heads nor 2 KV groups (nor the world of 16)
        (ParallelLayout("search", 2, 8, tp=3), ["tp=3 does not divide attention num_heads=32", "tp x pp x cp"]),
        # 2. ep=3: 8 routed experts do not split three ways
        (ParallelLayout("distill", 1, 6, ep=3), ["ep=3 does not divide moe num_experts=8"]),
        # 3. tp=4 divides the heads but not the 2 KV groups, nor the 2 Mamba groups
        (
            ParallelLayout("search", 1, 8, tp=4),
            ["tp=4 does not divide attention num_kv_groups=2", "tp=4 does not divide mamba num_groups=2"],
        ),
        # 4. cp=3 does not split the sequence into 2*cp load-balanced chunks
        (ParallelLayout("search", 1, 3, cp=3), ["cp=3: seq_len=1024 is not divisible by 2 x cp = 6"]),
        # 5. pp=16 stages for 9 blocks
        (ParallelLayout("rank", 2, 8, pp=16), ["pp=16 is larger than the 9 kept blocks"]),
        # 6. expert grid: etp x ep x pp = 16 does not divide 8 ranks
        (ParallelLayout("search", 1, 8, ep=8, etp=2), ["etp x ep x pp = 2 x 8 x 1 = 16"]),
        # 7. dp=16 does not divide a global batch of 8
        (ParallelLayout("search", 2, 8), ["dp=16 x micro_batch_size=1 does not divide the global batch 8"]),
    ],
)
def test_wrong_layout_names_the_dimension(layout, expected):
    batch = 8 if layout.world == 16 and layout.tp == layout.pp == 1 else 16
    problems = check(layout, batch=batch)
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    with pytest.raises(LayoutError) as e:
        validate_layout(layout, hybrid(), seq_len=1024, global_batch=batch)
    assert expected[0] in str(e.value)


def test_sequence_parallel_needs_tp():
    problems = check(ParallelLayout("search", 1, 8, sp=True))
    assert any("sequence_parallel needs tp > 1" in p for p in problems)


def test_problems_are_grouped_per_rule():
    """An 88-block model gives one line per rule, not one per block."""
    spec = ArchSpec.llama(hidden=64, vocab=128, layers=40, heads=6, kv_groups=2, ffn=96)
    problems = layout_problems(ParallelLayout("search", 1, 4, tp=4), spec, seq_len=64, global_batch=4)
    assert len([p for p in problems if "num_heads=6" in p]) == 1
    assert "(40 blocks)" in next(p for p in problems if "num_heads=6" in p)


def test_layout_for_stage_applies_overrides():
    cluster = {
        "nodes": 1,
        "gpus_per_node": 8,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 8,
        "etp": 0,
        "sequence_parallel": False,
        "processes_per_node": 1,
        "stage_layouts": {"distill": {"nodes": 2, "tp": 2, "sequence_parallel": True}},
    }
    d = layout_for_stage(cluster, "distill")
    assert (d.nodes, d.world, d.tp, d.etp, d.sp, d.ep) == (2, 16, 2, 2, True, 8)
    s = layout_for_stage(cluster, "search")
    assert (s.nodes, s.world, s.tp, s.etp) == (1, 8, 1, 1)
    assert layout_for_stage(cluster, "extract").world == 1
    with pytest.raises(ValueError, match="unknown key"):
        layout_for_stage({**cluster, "stage_layouts": {"search": {"tpp": 2}}}, "search")


def test_split_pipeline_minimizes_the_largest_stage():
    costs = [1, 1, 1, 1, 8, 1, 1, 1, 1]
    parts = split_pipeline(costs, 3)
    assert [list(r) for r in parts] == [[0, 1, 2, 3], [4], [5, 6, 7, 8]]
    assert max(sum(costs[i] for i in r) for r in parts) == 8
    # contiguous, covering, non-empty
    flat = [i for r in parts for i in r]
    assert flat == list(range(len(costs)))
    # a split by count (3 + 3 + 3) would put 10 on the middle stage
    assert sum(costs[3:6]) == 10


def test_split_pipeline_exhaustive_small():
    import itertools

    costs = [5, 2, 7, 1, 1, 9, 3, 4]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True))
        for cuts in itertools.combinations(range(1, len(costs)), 3)
    )
    parts = split_pipeline(costs, 4)
    assert max(sum(costs[i] for i in r) for r in parts) == best


def test_split_pipeline_errors():
    with pytest.raises(ValueError, match="pp=4 is larger than the 3 blocks"):
        split_pipeline([1, 2, 3], 4)


def test_heterogeneous_model_split_by_cost_not_count():
    """MoE blocks cost far more than Mamba ones: stages get different block counts."""
    spec = hybrid()
    parts = pipeline_stages(spec, 3, 1024)
    counts = [len(r) for r in parts]
    assert sum(counts) == len(spec.blocks)
    assert counts != [3, 3, 3]

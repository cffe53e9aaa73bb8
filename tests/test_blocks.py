"""The block-kind registry (``blocks/``): it covers every block kind ``ArchSpec`` knows, a kind
missing part of the interface cannot be built, and an unknown kind is named with the known ones."""

from __future__ import annotations

import pytest

from autocompress_nemo.arch.spec import _BLOCK_TYPES
from autocompress_nemo.blocks import BY_DECISION, KINDS, kind_of
from autocompress_nemo.blocks.base import Kind


def test_every_block_kind_of_the_spec_is_registered() -> None:
    assert set(KINDS) == set(_BLOCK_TYPES)
    for name, k in KINDS.items():
        assert k.block_type is _BLOCK_TYPES[name]
        assert all(BY_DECISION[dk] is k for dk in k.decision_kinds)


def test_a_kind_missing_a_method_cannot_be_built() -> None:
    class Half(Kind):
        name = "half"

        def decisions(self, spec, i, block, caps, grid):  # noqa: ANN001, ANN201
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown block kind 'conv'.*attention"):
        kind_of("conv")


def test_each_kind_words_its_shape_for_the_report_the_log_and_the_plots() -> None:
    """The report's width column, Minitron++'s candidate line and the width plot ask the kind (the
    texts are the ones the per-kind switches in report/ and search/minitron.py wrote)."""
    from autocompress_nemo.arch.spec import AttentionBlock, MambaBlock, MlpBlock, MoeBlock
    from autocompress_nemo.report.tables import block_width
    from autocompress_nemo.search.minitron import uniform_shape
    from tests.hybrid_utils import hetero_hybrid_spec

    cases = [
        (AttentionBlock(8, 4, 64), "8h/4kv", "heads=8 kv=4", 8),
        (MlpBlock(1536), "1536", "ffn=1536", 1536),
        (MoeBlock(32, 512, 2, shared_ffn=1024), "32 experts x 512 (top-2), shared 1024", "experts=32x512 top2 shared=1024", 32 * 512 + 1024),
        (MoeBlock(0, 0, 2, shared_ffn=64), "no routed experts, shared 64", "experts=0x0 top2 shared=64", 64),
        (MambaBlock(8, 16, 32, 2), "8 heads/2 groups", "heads=8", 8),
    ]  # fmt: skip
    for block, words, fields, width in cases:
        k = kind_of(block)
        assert (block_width(block), k.fields(block), k.plot_width(block)) == (words, fields, width)
    assert block_width(AttentionBlock(0, 0, 64)) == "removed"
    assert {n: k.plot_unit for n, k in KINDS.items()} == {
        "attention": "query heads",
        "mlp": "ffn width",
        "moe": "experts x ffn",
        "mamba": "heads",
    }
    spec = hetero_hybrid_spec()
    line = uniform_shape(spec)
    assert all(f"{b.kind}: " in line for b in spec.blocks), line


def test_the_width_plot_draws_every_kind_of_every_model(tmp_path) -> None:
    """``report.plots.plot_widths`` groups each model's blocks by kind and labels the axis with the kind's unit."""
    from autocompress_nemo.report.plots import plot_widths
    from tests.hybrid_utils import hetero_hybrid_spec

    spec = hetero_hybrid_spec()
    child = spec.replace(blocks=(spec.blocks[0], *spec.blocks[1:]))
    res = {"models": {"parent": {"arch": spec, "label": "parent"}, "autocompress": {"arch": child, "label": "AC"}}}
    out = plot_widths(res, tmp_path / "widths.png")
    assert out == tmp_path / "widths.png" and out.stat().st_size > 1000


def test_forward_flops_count_a_mamba_scan_not_attention_scores() -> None:
    """``forward_flops_per_token`` asks each kind for its mixing FLOPs: attention grows with the
    sequence (the full square on CPU), a Mamba block's scan does not (it was charged attention
    scores, ``2 * seq * heads * head_dim``, for having ``num_heads``)."""
    from autocompress_nemo.arch.counts import block_params, forward_flops_per_token
    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.arch.spec import AttentionBlock, MambaBlock
    from autocompress_nemo.config.entry import compose

    hybrid = spec_from_model_config(compose(["model=tiny_hybrid"]).model)
    mamba = [b for b in hybrid.blocks if isinstance(b, MambaBlock)]
    attn = [b for b in hybrid.blocks if isinstance(b, AttentionBlock) and not b.removed]
    assert mamba and attn
    grow = forward_flops_per_token(hybrid, 1024, head=False) - forward_flops_per_token(hybrid, 128, head=False)
    assert grow == pytest.approx(4.0 * (1024 - 128) * sum(b.num_heads * b.head_dim for b in attn))
    weights = 2.0 * sum(block_params(b, hybrid.hidden, active=True) for b in hybrid.blocks)
    scans = sum(6.0 * b.d_inner * b.state_size for b in mamba)
    scores = sum(4.0 * 128 * b.num_heads * b.head_dim for b in attn)
    assert forward_flops_per_token(hybrid, 128, head=False) == pytest.approx(weights + scans + scores)


def test_only_routed_experts_are_split_by_expert_tensor_parallelism() -> None:
    """The rank stage refuses ``etp != tp`` for a parent with routed experts; the kind says which
    blocks those are (a shared-expert-only MoE part and the other kinds are not split by it)."""
    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.arch.spec import MoeBlock
    from autocompress_nemo.blocks import kind_of
    from autocompress_nemo.config.entry import compose

    hybrid = spec_from_model_config(compose(["model=tiny_hybrid"]).model)
    split = {b.kind for b in hybrid.blocks if kind_of(b).expert_tensor_parallel(b)}
    assert split == {"moe"}
    assert {b.kind for b in hybrid.blocks} >= {"attention", "mlp", "mamba", "moe"}
    shared_only = MoeBlock(0, 0, 0, 64, 0, "relu2")
    assert not kind_of(shared_only).expert_tensor_parallel(shared_only)

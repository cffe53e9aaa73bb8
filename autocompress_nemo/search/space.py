"""The search space: one decision per prunable block, its options cut to what the engine serves.

A decision holds the options a block may take, ordered from smallest to largest; a
width of zero (a removed block) is one more option where the engine can serve it. Every
option keeps a *prefix* of the importance-sorted parent dimension, so one set of weights
serves all of them (the supernet).

Attention options are (KV groups kept, query heads per group kept): the kept heads are
the first ``heads_per_group`` of each of the first ``kv_groups`` groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MlpBlock


@dataclass(frozen=True)
class Decision:
    block_index: int
    kind: str
    options: tuple[Block, ...]
    """Smallest first; the last option is the parent's own block."""

    @property
    def parent_option(self) -> int:
        return len(self.options) - 1


def _cap(caps: Any, name: str, default: Any = False) -> Any:
    if caps is None:
        return default
    return caps.get(name, default) if isinstance(caps, dict) else getattr(caps, name, default)


def ffn_widths(parent_ffn: int, n_options: int, align: int, allow_zero: bool) -> list[int]:
    """The profiler's ffn grid (the widths the cost table was measured at), plus 0 when the
    block may be removed."""
    from autocompress_nemo.costs.profiler import ffn_grid

    return ([0] if allow_zero else []) + ffn_grid(parent_ffn, n_options, align, True)


def attention_options(parent: AttentionBlock, caps: Any, allow_remove: bool) -> list[AttentionBlock]:
    """(groups, heads per group) prefixes the engine can serve, ordered by kept query heads."""
    hpg = parent.heads_per_group
    vary_q = _cap(caps, "vary_query_heads")
    # Dropping KV groups by prefix drops their query heads too, so it needs per-layer query
    # heads. Engines that keep query heads global (TensorRT-LLM / vLLM DeciLM) would need KV
    # heads merged instead of sliced, which this build does not do: there attention is kept
    # whole or removed.
    vary_groups = _cap(caps, "vary_kv_groups") and vary_q
    groups = range(1, parent.num_kv_groups + 1) if vary_groups else [parent.num_kv_groups]
    per_group = range(1, hpg + 1) if vary_q else [hpg]
    opts = {
        AttentionBlock(g * q, g, parent.head_dim)
        for g, q in itertools.product(groups, per_group)
    }
    ordered = sorted(opts, key=lambda b: (b.num_heads, b.num_kv_groups))
    # the parent last: among equal head counts prefer more KV groups (it is the parent's shape)
    ordered.remove(parent)
    ordered.append(parent)
    if allow_remove:
        ordered.insert(0, AttentionBlock(0, 0, parent.head_dim))
    return ordered


def build_space(parent: ArchSpec, caps: Any, ffn_options: int = 8) -> list[Decision]:
    """Decisions for every attention and mlp block of a Llama-style parent.

    Engine rules honoured (DESIGN.md, engine capabilities):
    - ``remove_attention`` / ``remove_mlp``: a zero-width option is offered;
    - ``first_block_full``: the first layer keeps its attention;
    - ``last_block_full``: the last layer keeps its ffn;
    - ``attention_needs_ffn``: no ffn is removed (a kept attention needs its ffn, and the
      removal of the whole layer is reached by removing its attention, then its ffn would
      be left alone), so ffn removal is not offered;
    - ``ffn_align``: ffn widths are multiples of it.
    """
    if not parent.is_dense_layered() and parent.kinds() & {"moe", "mamba"}:
        # MoE / Mamba hybrids: search/space_hybrid.py (H7)
        from autocompress_nemo.search.space_hybrid import build_hybrid_space

        return build_hybrid_space(parent, caps, ffn_options)
    if not parent.is_dense_layered():
        raise ValueError(
            f"the search space for {parent.name or 'this model'} ({parent.pattern}) needs MoE/Mamba decisions, "
            "which this build does not offer yet (dense Llama-style parents only)"
        )
    layers = parent.layers()
    n = len(layers)
    decisions: list[Decision] = []
    for li, (attn, mlp) in enumerate(layers):
        allow_rm_attn = bool(_cap(caps, "remove_attention")) and not (li == 0 and _cap(caps, "first_block_full"))
        a_opts = attention_options(attn, caps, allow_rm_attn)
        if len(a_opts) > 1:
            decisions.append(Decision(2 * li, "attention", tuple(a_opts)))
        allow_rm_mlp = (
            bool(_cap(caps, "remove_mlp"))
            and not (li == n - 1 and _cap(caps, "last_block_full"))
            and not _cap(caps, "attention_needs_ffn")
        )
        if _cap(caps, "vary_ffn"):
            widths = ffn_widths(mlp.ffn, ffn_options, int(_cap(caps, "ffn_align", 1)), allow_rm_mlp)
        else:
            widths = ([0] if allow_rm_mlp else []) + [mlp.ffn]
        if len(widths) > 1:
            decisions.append(Decision(2 * li + 1, "mlp", tuple(MlpBlock(w, mlp.activation) for w in widths)))
    return decisions


def apply_choices(parent: ArchSpec, decisions: list[Decision], choices: list[int]) -> ArchSpec:
    """The child ArchSpec for one option index per decision."""
    spec = parent
    for d, k in zip(decisions, choices, strict=True):
        merge = getattr(d, "merge", None)  # hybrid part decisions (space_hybrid.PartDecision) merge into the block
        new = merge(spec.blocks[d.block_index], d.options[k]) if merge else d.options[k]
        spec = spec.replace_block(d.block_index, new)
    return spec


def uniform_candidates(parent: ArchSpec, decisions: list[Decision]) -> list[list[int]]:
    """Minitron++ candidates: one option for every attention block and one for every mlp
    block (the same shape in all layers), no block removed."""
    by_kind: dict[str, list[tuple[int, Decision]]] = {}
    for i, d in enumerate(decisions):
        by_kind.setdefault(d.kind, []).append((i, d))
    # shapes common to all decisions of a kind, excluding removal
    shape_sets = []
    for kind, items in by_kind.items():
        common = set(items[0][1].options)
        for _, d in items[1:]:
            common &= set(d.options)
        shapes = sorted((b for b in common if not b.removed), key=lambda b: decisions[items[0][0]].options.index(b))
        shape_sets.append((kind, items, shapes))
    out = []
    for combo in itertools.product(*[s for _, _, s in shape_sets]):
        choices = [0] * len(decisions)
        for (_, items, _), shape in zip(shape_sets, combo, strict=True):
            for i, d in items:
                choices[i] = d.options.index(shape)
        out.append(choices)
    return out

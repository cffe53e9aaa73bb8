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

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.config.engine import capabilities_of


@dataclass(frozen=True)
class Decision:
    block_index: int
    kind: str
    options: tuple[Block, ...]
    """Smallest first; the last option is the parent's own block."""

    @property
    def parent_option(self) -> int:
        return len(self.options) - 1


def levels(parent: int, n: int, align: int = 1, minimum: int = 1) -> list[int]:
    """``{parent} U {floor(parent*i/n / align)*align, i=1..n-1}`` that are ``>= minimum``, ascending."""
    align = max(1, int(align))
    out = {parent}
    for i in range(1, max(1, n)):
        w = (parent * i // n) // align * align
        if w >= max(1, minimum):
            out.add(w)
    return sorted(out)


def ffn_widths(parent_ffn: int, n_options: int, align: int, allow_zero: bool) -> list[int]:
    """The ffn grid: ``levels(parent_ffn, n_options, align)`` (the widths the cost table is profiled
    at, ``costs/profile/grid.py``), plus 0 when the block may be removed."""
    return ([0] if allow_zero else []) + levels(parent_ffn, n_options, align)


def attention_options(parent: AttentionBlock, caps: Any, allow_remove: bool) -> list[AttentionBlock]:
    """(groups, heads per group) prefixes the engine can serve, ordered by kept query heads."""
    caps = capabilities_of(caps)
    hpg = parent.heads_per_group
    vary_q = caps.vary_query_heads
    # Dropping KV groups by prefix drops their query heads too, so it needs per-layer query
    # heads. Engines that keep query heads global (TensorRT-LLM / vLLM DeciLM) would need KV
    # heads merged instead of sliced, which this build does not do: there attention is kept
    # whole or removed.
    vary_groups = caps.vary_kv_groups and vary_q
    groups = range(1, parent.num_kv_groups + 1) if vary_groups else [parent.num_kv_groups]
    per_group = range(1, hpg + 1) if vary_q else [hpg]
    opts = {AttentionBlock(g * q, g, parent.head_dim) for g, q in itertools.product(groups, per_group)}
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
    caps = capabilities_of(caps)
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
        allow_rm_attn = caps.remove_attention and not (li == 0 and caps.first_block_full)
        a_opts = attention_options(attn, caps, allow_rm_attn)
        if len(a_opts) > 1:
            decisions.append(Decision(2 * li, "attention", tuple(a_opts)))
        allow_rm_mlp = caps.remove_mlp and not (li == n - 1 and caps.last_block_full) and not caps.attention_needs_ffn
        if caps.vary_ffn:
            widths = ffn_widths(mlp.ffn, ffn_options, caps.ffn_align, allow_rm_mlp)
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


def option_widths(o: Block) -> tuple[int, ...]:
    """The widths a decision option keeps, per dimension of its kind (the dimensions a uniform
    Minitron++ shape is uniform in): attention (query heads, KV groups), mlp (ffn), moe routed part
    (experts, expert ffn, top-k), moe shared part (shared ffn), mamba (heads)."""
    if isinstance(o, AttentionBlock):
        return (o.num_heads, o.num_kv_groups)
    if isinstance(o, MlpBlock):
        return (o.ffn,)
    if isinstance(o, MambaBlock):
        return (o.num_heads,)
    if isinstance(o, MoeBlock):
        return (o.num_experts, o.expert_ffn, o.top_k) if o.num_experts else (o.shared_ffn,)
    raise TypeError(f"no widths for option {o!r}")


def _kind_shapes(items: list[tuple[int, Decision]]) -> list[dict[int, int]]:
    """Uniform assignments ``{decision index: option index}`` for the decisions of one kind (see
    ``uniform_candidates``), never a removed option."""
    kept = [[k for k, o in enumerate(d.options) if not o.removed] for _, d in items]
    first = [items[0][1].options[k] for k in kept[0]]
    if all([d.options[k] for k in ks] == first for (_, d), ks in zip(items, kept, strict=True)):
        # every block of the kind offers the same shapes: the same shape everywhere
        return [{i: d.options.index(shape) for i, d in items} for shape in first]

    def frac(d: Decision, k: int) -> tuple[float, ...]:
        full = option_widths(d.options[d.parent_option])
        return tuple(w / max(1, p) for w, p in zip(option_widths(d.options[k]), full, strict=True))

    targets = sorted(
        {frac(d, k) for (_, d), ks in zip(items, kept, strict=True) for k in ks}, key=lambda f: (sum(f), f)
    )
    out: list[dict[int, int]] = []
    for t in targets:
        assign = {}
        for (i, d), ks in zip(items, kept, strict=True):
            fits = [k for k in ks if all(a <= b + 1e-9 for a, b in zip(frac(d, k), t, strict=True))]
            # the widest option within the fraction in every dimension, else the block's smallest kept option
            widest = max(((sum(frac(d, k)), k) for k in fits), default=None)
            assign[i] = widest[1] if widest is not None else ks[0]
        if assign not in out:
            out.append(assign)
    return out


def uniform_candidates(parent: ArchSpec, decisions: list[Decision]) -> list[list[int]]:
    """Minitron++ width candidates: one shape per decision kind (``attention``, ``mlp``,
    ``moe_routed``, ``moe_shared``, ``mamba``) for all blocks of that kind, no block or part removed
    (the depth axis, block removal, is ``search/minitron.py``'s).

    Per kind:

    - the blocks of the kind all offer the same options (every Llama parent, every Nemotron-H /
      Qwen3-MoE parent, whose blocks of a kind are alike): the candidates are those shapes, the
      same block everywhere;
    - their options differ (a parent whose blocks of one kind differ): a common *fraction* of each
      block's parent width, ``f = kept / parent`` per dimension (``option_widths``). The fractions
      are those any block's options offer; for each, every block takes its widest option whose
      fraction is ``<= f`` in every dimension (its smallest kept option if none is), i.e. uniform
      relative to the parent, snapped down to what each block can serve.

    Candidates are the product over kinds, as option indices per decision."""
    by_kind: dict[str, list[tuple[int, Decision]]] = {}
    for i, d in enumerate(decisions):
        by_kind.setdefault(d.kind, []).append((i, d))
    per_kind = [_kind_shapes(items) for items in by_kind.values()]
    out = []
    for combo in itertools.product(*per_kind):
        choices = [0] * len(decisions)
        for assign in combo:
            for i, k in assign.items():
                choices[i] = k
        out.append(choices)
    return out

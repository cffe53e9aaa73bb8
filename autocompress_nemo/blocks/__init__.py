"""The block-kind registry: one module per kind of block (``attention``, ``mlp``, ``moe``,
``mamba``), each owning its search options, its supernet masks, the importance an option keeps, its
prefix rule and its slicing (``blocks/base.Kind``). Every stage loops over a model's blocks and asks
``kind_of(block)`` (or ``kind_of(decision)``) — no per-kind switch elsewhere for these concerns.

Adding a block kind: a module here with a ``Kind`` subclass, registered in ``KINDS`` below, and its
block dataclass in ``arch/spec.py`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks.attention import Attention, kept_heads
from autocompress_nemo.blocks.base import Decision, Grid, Kind, levels
from autocompress_nemo.blocks.mamba import Mamba
from autocompress_nemo.blocks.mlp import Mlp
from autocompress_nemo.blocks.moe import Moe

KINDS: dict[str, Kind] = {k.name: k for k in (Attention(), Mlp(), Moe(), Mamba())}
"""Block kind name -> its kind object."""
BY_DECISION: dict[str, Kind] = {dk: k for k in KINDS.values() for dk in k.decision_kinds}
"""Decision kind (``attention``, ``mlp``, ``moe_routed``, ``moe_shared``, ``mamba``) -> its block's kind."""


def kind_of(x: Any) -> Kind:
    """The kind of a block, of a decision, or of a kind / decision-kind name."""
    name = x if isinstance(x, str) else x.kind
    k = BY_DECISION.get(name) if isinstance(x, Decision) else KINDS.get(name) or BY_DECISION.get(name)
    if k is None:
        raise ValueError(f"unknown block kind {name!r}; known: {sorted(KINDS)} (decisions: {sorted(BY_DECISION)})")
    return k


def decisions(spec: ArchSpec, caps: Any, grid: Grid) -> list[Decision]:
    """Every block's decisions, in block order (a block whose only option is the parent's has none;
    a removed block has none)."""
    if hasattr(caps, "for_parent"):  # EngineCapabilities: a hybrid parent takes the engine's hybrid set
        caps = caps.for_parent(spec)
    out: list[Decision] = []
    for i, b in enumerate(spec.blocks):
        if not b.removed:
            out += kind_of(b).decisions(spec, i, b, caps, grid)
    return out


def apply(spec: ArchSpec, decisions_: list[Decision], choices: list[int]) -> ArchSpec:
    """The child: every decision's chosen option merged into its block (parts of one MoE block
    combine; an MoE block left with neither routed experts nor a shared expert is removed)."""
    for d, k in zip(decisions_, choices, strict=True):
        cur = spec.blocks[d.block_index]
        spec = spec.replace_block(d.block_index, kind_of(d).merge(d, cur, d.options[k]))
    return spec


def describe(spec: ArchSpec) -> str:
    """Per-block shapes in one line (``A9h3kv F1536 E8x64k2+s32 M8h2g``; removed blocks named), a run of
    repeated blocks or layers written once with its count (a 30-layer Llama: ``30 x [A9h3kv F1536]``)."""
    return compact_runs([f"{b.kind}:removed" if b.removed else kind_of(b).describe(b) for b in spec.blocks])


def compact_runs(words: list[str], max_period: int = 4) -> str:
    """``words`` joined by spaces, each run of a repeated group of up to ``max_period`` words written as
    ``n x [group]`` (the group covering the most words wins; ties: the shorter group)."""
    out: list[str] = []
    i = 0
    while i < len(words):
        best_p, best_n = 1, 1
        for p in range(1, max_period + 1):
            n = 1
            while words[i + n * p : i + (n + 1) * p] == words[i : i + p] and i + (n + 1) * p <= len(words):
                n += 1
            if n > 1 and n * p > best_n * best_p:
                best_p, best_n = p, n
        if best_n > 1:
            out.append(f"{best_n} x [{' '.join(words[i : i + best_p])}]")
        else:
            out.append(words[i])
        i += best_n * best_p
    return " ".join(out)


__all__ = [
    "BY_DECISION",
    "KINDS",
    "Decision",
    "Grid",
    "Kind",
    "apply",
    "compact_runs",
    "decisions",
    "describe",
    "kept_heads",
    "kind_of",
    "levels",
]

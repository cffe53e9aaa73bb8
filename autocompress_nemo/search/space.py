"""The search space: the decisions of every block, their options cut to what the engine serves.

A decision holds the options a block (or a part of an MoE block) may take, ordered from smallest
to largest; a width of zero (a removed block) is one more option where the engine can serve it.
Every option keeps a *prefix* of the importance-sorted parent dimension, so one set of weights
serves all of them (the supernet). Which options a block offers is its kind's rule
(``blocks/``: attention, mlp, moe, mamba); this module assembles them and builds the uniform
(Minitron++) candidates.

Engine rules honoured (the capabilities, ``config/engine.EngineCapabilities``):
``remove_attention`` / ``remove_mlp`` / ``remove_moe`` / ``remove_mamba`` offer a zero-width
option; ``first_block_full`` keeps the first block's attention, ``last_block_full`` the last
block's ffn; ``attention_needs_ffn`` (llama.cpp ``deci``) offers no ffn removal; ``ffn_align`` /
``expert_align`` (times ``cluster.ep`` under expert parallelism) align widths / expert counts.
"""

from __future__ import annotations

import itertools
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import Decision, Grid, apply, decisions, kind_of
from autocompress_nemo.config.engine import capabilities_of

__all__ = ["Decision", "apply_choices", "build_space", "option_widths", "uniform_candidates"]


def build_space(parent: ArchSpec, caps: Any, ffn_options: int = 8, moe_levels: int = 4) -> list[Decision]:
    """Decisions for every block of ``parent`` (in block order; a block whose only option is the
    parent's own gets none)."""
    return decisions(parent, capabilities_of(caps), Grid(ffn_options, moe_levels))


apply_choices = apply
"""The child ArchSpec for one option index per decision (MoE parts merge into their block)."""


def option_widths(o: Any) -> tuple[int, ...]:
    """The widths a decision option keeps (its kind's ``widths``): the dimensions a uniform Minitron++
    shape is uniform in."""
    return kind_of(o).widths(o)


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

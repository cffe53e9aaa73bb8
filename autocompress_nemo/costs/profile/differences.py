"""The differences design for hybrid parents: one difference of two models per block option.

Profiling model of option ``X``: the parent's blocks with ``k`` copies of ``X`` spread among
them (``spread_copies``; ``k = engine.settings.profile_copies``, default 3); base = the parent
(``k = 0``). The cost of one ``X`` is the slope ``(T(parent + k X) - T(parent)) / k`` per phase.
Spread, not appended: a block run back to back with copies of itself is measurably cheaper on
a CPU (hot code paths and caches) than the same block between blocks of other kinds, as it
runs in the models being predicted.

MoE blocks are two additive parts (``blocks/moe.moe_parts``). The routed part ``R`` is profiled as a
MoE block without shared expert; a shared width ``S`` as the parent's routed part with shared
width ``S``, its cost being ``c(R_p + S) - c(R_p)`` — so a block's norm / residual overhead is
counted once, in the routed part. (A block with no routed experts left is then priced without
that overhead: a small underestimate.) Intercept = ``T(parent) - sum of the parent's block
costs`` (embedding, final norm, LM head, framework overhead); no per-layer overhead term.
Exact for an additive (estimated) engine, hence its default there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, MoeBlock
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.blocks.moe import moe_parts
from autocompress_nemo.costs.engines.base import Engine, Workload
from autocompress_nemo.costs.profile.provenance import planned_runs, progress, run_row
from autocompress_nemo.costs.table import PHASES, spec_hash


def spread_copies(blocks: tuple[Any, ...], x: Any, k: int) -> tuple[Any, ...]:
    """``blocks`` with ``k`` copies of ``x`` inserted at evenly spaced positions: copy ``j``
    (``j = 0..k-1``) goes before parent block ``round((j + 1) * L / (k + 1))`` (``L`` = parent
    blocks), so each copy sits between the parent's blocks; a parent of ``L = 0`` gets ``k`` copies."""
    at = [round((j + 1) * len(blocks) / (k + 1)) for j in range(k)]
    out: list[Any] = []
    for i, b in enumerate(blocks):
        out += [x] * at.count(i)
        out.append(b)
    out += [x] * at.count(len(blocks))
    return tuple(out)


def hybrid_differences(
    engine: Engine, parent: ArchSpec, workload: Workload, options: list[Any], log: Callable[[str], None]
) -> tuple[list[ArchSpec], list[Any], list[dict[str, Any]], dict[str, float], list[dict[str, Any]], dict[str, Any]]:
    """(specs, measurements, block entries, intercept, runs, extra provenance) of the design above;
    ``specs[0]`` is the parent."""
    k = engine.settings.profile_copies
    if k < 1:
        raise ValueError(f"engine.settings.profile_copies={k}: needs at least 1 copy")
    routed_p = next((moe_parts(b)[0] for b in parent.blocks if isinstance(b, MoeBlock) and not b.removed), None)
    jobs: list[tuple[str, Any]] = []
    for o in options:
        if isinstance(o, MoeBlock) and not o.num_experts:  # shared part: measured on top of the parent's routed part
            if routed_p is None or routed_p.removed:
                raise ValueError("profiling a shared expert needs a parent MoE block with routed experts")
            jobs.append((f"{o.kind}{len(jobs)}", dataclasses.replace(routed_p, shared_ffn=o.shared_ffn)))
        else:
            jobs.append((f"{o.kind}{len(jobs)}", o))
    specs = [parent.replace(name="base")] + [
        parent.replace(blocks=spread_copies(parent.blocks, x, k), name=n) for n, x in jobs
    ]
    log(
        f"[profile] hybrid: {len(specs)} profiling models (parent + {k} copies of each of {len(jobs)} block options); "
        f"engine {engine.name} ({engine.version()}), workload {workload}"
    )
    results = engine.measure_many(
        specs,
        workload,
        log=progress(log, planned_runs(engine, specs, parent.replace(name="parent")), time.time()),
        reference=parent.replace(name="parent"),
    )
    base = results[0]
    slope = {
        n: {p: (getattr(m, p) - getattr(base, p)) / k for p in PHASES}
        for (n, _), m in zip(jobs, results[1:], strict=True)
    }
    costs: dict[Any, dict[str, float]] = {}
    for (n, _x), o in zip(jobs, options, strict=True):
        costs[o] = slope[n]
    for (n, _x), o in zip(jobs, options, strict=True):
        if isinstance(o, MoeBlock) and not o.num_experts:
            costs[o] = {p: slope[n][p] - costs[routed_p][p] for p in PHASES}
    clamped: dict[Any, list[str]] = {}
    for o, c in costs.items():  # a block cannot save time: a negative difference is timing noise
        for p in PHASES:
            if c[p] < 0:
                clamped.setdefault(o, []).append(f"{p} {c[p]:.4f}")
                c[p] = 0.0
    if clamped:
        log(
            f"[profile] {len(clamped)} block options measured below 0 (noise: the block costs less than the "
            "timing spread) were set to 0: " + "; ".join(f"{o}: {', '.join(v)}" for o, v in clamped.items())
        )
    blocks = [
        {"block": o.__dict__, **costs[o], "source": n, **({"clamped_from": clamped[o]} if o in clamped else {})}
        for (n, _), o in zip(jobs, options, strict=True)
    ]

    def parent_block_cost(b: Any, p: str) -> float:
        if b.removed:
            return 0.0
        return sum(costs[q][p] for q in kind_of(b).parts(b) if not q.removed)

    intercept = {p: getattr(base, p) - sum(parent_block_cost(b, p) for b in parent.blocks) for p in PHASES}
    runs = [
        run_row(s, m, k=0 if i == 0 else k, block=None if i == 0 else jobs[i - 1][1].__dict__, spec_hash=spec_hash(s))
        for i, (s, m) in enumerate(zip(specs, results, strict=True))
    ]
    return specs, results, blocks, intercept, runs, {"settings": {"copies": k}}

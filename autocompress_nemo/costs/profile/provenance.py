"""What a cost table records about how it was made, and what must match when it is loaded.

``expected_settings`` (defined beside ``make_provenance`` in ``costs/table.py``, which the roofline
engine's analytic table uses too): the engine settings that change what is measured (compared at
load time, ``CostTable.check``). ``table_provenance``: the engine's fields, the workload, the decode context,
those settings, the parent, and what the profiling run spent. ``run_row`` / ``progress``: the
per-run record and the progress log every design shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import Measurement
from autocompress_nemo.costs.table import MEASURED_SETTINGS, expected_settings, make_provenance

__all__ = ["MEASURED_SETTINGS", "expected_settings", "progress", "reference_record", "run_row", "table_provenance"]


def table_provenance(
    engine: Any, workload: Any, parent: ArchSpec, n_models: int, t_start: float, settings: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """A cost table's provenance: the engine's fields, the workload, the decode context, the
    settings that must match at load time, the parent, and what this profiling run spent."""
    prov = make_provenance(
        engine.provenance(),
        workload.__dict__,
        engine.decode_context(workload),
        expected_settings(engine.cfg),
        parent,
    )
    prov.update(
        {
            "profile_models": n_models,
            "engine_runs": int(getattr(engine, "runs", n_models)),
            "profile_wall_s": round(time.time() - t_start, 2),
            "profile": settings,
            **extra,
        }
    )
    return prov


def progress(log: Callable[[str], None], total: int, t_start: float) -> Callable[[str], None]:
    """A ``measure_many`` progress callback logging every tenth run and the last, with time left."""
    done = [0]

    def report(msg: str) -> None:
        done[0] += 1
        if done[0] % 10 == 0 or done[0] == total:
            log(f"[profile {done[0]}/{total}] ~{(time.time() - t_start) / done[0] * (total - done[0]):.0f} s left")

    return report


def run_row(s: ArchSpec, m: Measurement, **extra: Any) -> dict[str, Any]:
    """One profiling run as the table's ``runs`` keep it (with its ratio to the reference when one was timed)."""
    row = {
        "name": s.name,
        **extra,
        "prefill_ms": m.prefill_ms,
        "decode_ms": m.decode_ms,
        "memory": m.memory,
        "raw": m.raw,
        "spread": m.spread,
        "wall_s": round(m.wall_s, 3),
    }
    if m.ratio:
        row.update(ratio=m.ratio, ratio_spread=m.ratio_spread, absolute=m.absolute, flags=m.flags)
    return row


def reference_record(results: list[Measurement], log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """What the table keeps about the reference its times are ratios to: its absolute times and their
    variation between rounds, the load average, and every flagged measurement (empty: no reference)."""
    ref = next((m.reference for m in results if m.reference), None)
    if not ref:
        return {}
    from autocompress_nemo.costs.engines.paired import all_flags

    flags = all_flags(results)
    if log is not None:
        for f in flags:
            log(f"[profile] flagged: {f}")
    return {
        "reference": {**ref, "flags": flags},
        "timing": f"ratio to the {ref['name']} timed in the same rounds x the {ref['name']}'s time in this profile",
    }

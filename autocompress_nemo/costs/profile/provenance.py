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

__all__ = [
    "MEASURED_SETTINGS",
    "Progress",
    "expected_settings",
    "planned_runs",
    "progress",
    "reference_record",
    "run_row",
    "table_provenance",
]


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


class Progress:
    """A ``measure_many`` progress callback: one call per engine run, ``[label done/total]`` with the
    time left, where ``done`` never passes ``total``.

    ``total`` is the plan (``planned_runs``); a run the plan did not foresee — a paired engine's "one
    more round" for a model whose ratios spread, or any run past the plan — raises the total before
    it is counted, so the line never reads ``10/7`` or a negative number of runs left. ``every``:
    log every ``every``-th run (and the last planned one); ``detail``: append the engine's own message."""

    def __init__(
        self,
        log: Callable[[str], None],
        total: int,
        t_start: float,
        *,
        label: str = "profile",
        every: int = 1,
        detail: bool = False,
    ) -> None:
        self.log, self.total, self.t_start = log, max(0, int(total)), t_start
        self.label, self.every, self.detail = label, max(1, int(every)), detail
        self.done = 0

    def __call__(self, msg: str) -> None:
        if msg.lstrip().startswith("one more round"):
            self.total += 1  # announced by the engine as the extra run starts
        self.done += 1
        self.total = max(self.total, self.done)
        left = self.total - self.done
        if self.done % self.every and left:
            return
        eta = (time.time() - self.t_start) / self.done * left
        what = f" {msg.strip()}" if self.detail else ""
        self.log(f"[{self.label} {self.done}/{self.total}]{what} ({left} runs remain, ~{eta:.0f} s left)")


def planned_runs(engine: Any, specs: list[ArchSpec], reference: ArchSpec | None, rounds: int | None = None) -> int:
    """How many progress calls ``engine.measure_many(specs, ..., reference=reference)`` makes: one per
    model and round for the engines timed in interleaved rounds (their log names each turn), and for
    the engines timed in their own process per model (vLLM, TensorRT-LLM: ``hf_llm.py``) one per model
    plus one per measurement of the reference (first, after every ``REFERENCE_EVERY`` models, last;
    a model that is the reference is not measured again)."""
    from autocompress_nemo.costs.engines.hf_llm import REFERENCE_EVERY, HfLlmEngine

    if isinstance(engine, HfLlmEngine):
        if reference is None or str(engine.settings.reference) != "parent":
            return len(specs)
        from autocompress_nemo.costs.table import spec_hash

        ref = spec_hash(reference)
        runs, done = 1, 0
        for i, s in enumerate(specs):
            if spec_hash(s) == ref:
                continue
            runs, done = runs + 1, done + 1
            if done % REFERENCE_EVERY == 0 and i < len(specs) - 1:
                runs += 1
        return runs + (1 if done % REFERENCE_EVERY else 0)
    rounds = int(rounds or engine.settings.rounds)
    return len(specs) * rounds if rounds > 1 else 0  # one round: the turns are not logged (paired.py)


def progress(
    log: Callable[[str], None],
    total: int,
    t_start: float,
    *,
    label: str = "profile",
    every: int = 10,
    detail: bool = False,
) -> Progress:
    """``Progress`` logging every ``every``-th run and the last (see ``Progress``)."""
    return Progress(log, total, t_start, label=label, every=every, detail=detail)


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

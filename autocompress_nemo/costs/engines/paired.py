"""Timing relative to a reference model measured in the same rounds (one scheduler for every CPU-timed engine).

A shared machine is never quiet: a busy sibling core slows the compute thread's own instructions
(shared caches, memory bandwidth, frequency), so absolute times — even per-thread CPU times —
move with the load of the minute. A *ratio* to a reference model timed right next to the model
does not: the load of that moment slows both alike.

The reference is the parent (``engine.settings.reference: parent``). Why the parent and not a
probe model: relative budgets (``0.6x``) are ratios to the parent, so a measured ratio to the
parent *is* the budget check, with no conversion; the dense profiling models have the parent's
depth, so they are alike in size and in how the load slows them; and every stage that times
models already has the parent at hand.

Schedule (``measure_interleaved``): the reference stays loaded for the whole call. Each model's
turn of a round alternates with the reference sample by sample for prefills
(``R M R M ... M R``) and chunk by chunk for decode steps (``settings.reference_chunk`` steps,
``R_k M_k R_k ... M_k R_k``); every model sample (chunk) is divided by the mean of the reference
samples (chunks) on either side of it. The model's ratio is the median of these per-pair ratios,
its spread their relative IQR. A model whose ratios spread more than
``settings.reference_tolerance`` gets one more turn; still spread, it is *flagged*
(``Measurement.flags``: kept in the result, named in the log and the report by the caller, never
silently used). The reference's own variation between rounds (flagged above the same tolerance, in
``Measurement.reference['flags']``, once per call) and the load average (``os.getloadavg``) before
and after are recorded.

A result's ``prefill_ms`` / ``decode_ms`` are ``ratio x scale``: ``scale`` given by the caller (the
cost table's reference times, so validation compares like with like) or the reference's own time
in this call. The model's own statistic (the old method) stays in ``Measurement.absolute``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from autocompress_nemo.costs.engines.base import Measurement, robust, spread

TIMED = ("prefill_ms", "decode_ms")


class Live(Protocol):
    """One model loaded in the engine, ready to be timed."""

    memory: dict[str, float]

    def prefill(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed prefills of the workload: (clock ms, wall ms) each."""

    def decode(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed decode steps at the decode context (any setup untimed)."""

    def close(self) -> None: ...


def loadavg() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return 0.0


def rel_iqr(a: Iterable[float]) -> float:
    x = np.asarray(list(a), dtype=np.float64)
    if x.size < 2:
        return 0.0
    return float((np.percentile(x, 75) - np.percentile(x, 25)) / max(abs(float(np.median(x))), 1e-12))


@dataclass
class _Series:
    """Samples of one model: raw clock / wall ms per phase, per-pair ratios per phase, per round."""

    raw: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(self, phase: str, samples: list[tuple[float, float]]) -> None:
        self.raw.setdefault(phase, []).extend(s[0] for s in samples)
        self.raw.setdefault(phase.replace("_ms", "_wall_ms"), []).extend(s[1] for s in samples)


def _med(samples: list[tuple[float, float]]) -> float:
    return float(np.median([s[0] for s in samples]))


def paired_turn(ref: Live, model: Live, prefills: int, steps: int, chunk: int, rs: _Series, ms: _Series) -> None:
    """One model's turn, interleaved with the reference (module docstring); adds to both series."""
    if prefills:
        r = [ref.prefill(1)]
        for _ in range(prefills):
            m = model.prefill(1)
            r.append(ref.prefill(1))
            ms.ratios.setdefault("prefill_ms", []).append(_med(m) / (0.5 * (_med(r[-2]) + _med(r[-1]))))
            ms.add("prefill_ms", m)
        for x in r:
            rs.add("prefill_ms", x)
    if steps:
        k = max(1, chunk)
        r = [ref.decode(k)]
        for _ in range(max(1, -(-steps // k))):
            m = model.decode(k)
            r.append(ref.decode(k))
            ms.ratios.setdefault("decode_ms", []).append(_med(m) / (0.5 * (_med(r[-2]) + _med(r[-1]))))
            ms.add("decode_ms", m)
        for x in r:
            rs.add("decode_ms", x)


def plain_turn(model: Live, prefills: int, steps: int, ms: _Series) -> None:
    """One model's turn without a reference."""
    if prefills:
        ms.add("prefill_ms", model.prefill(prefills))
    if steps:
        ms.add("decode_ms", model.decode(steps))


@dataclass
class Schedule:
    rounds: int
    prefills: int
    """Timed prefills per model per round."""
    steps: int
    """Timed decode steps per model per round."""
    chunk: int = 8
    tolerance: float = 0.1
    percentile: float = 10.0


def measure_interleaved(
    n: int,
    open_model: Callable[[int], Live],
    sched: Schedule,
    *,
    open_reference: Callable[[], Live] | None = None,
    reference_name: str = "parent",
    scale: dict[str, float] | None = None,
    keep: bool = False,
    groups: list[list[int]] | None = None,
    timing: bool = True,
    names: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Measure ``n`` models (``open_model(i)`` loads model ``i``) in interleaved rounds, each turn paired
    with the reference (``open_reference``; None: absolute timing, the old method).

    ``keep``: models stay loaded across rounds within their ``groups`` (default: one group of all);
    otherwise each turn loads the model and frees it after. ``scale``: the reference times the ratios
    are expressed in (default: the reference's own time in this call)."""
    groups = groups or [list(range(n))]
    names = names or [f"model{i}" for i in range(n)]
    series = [_Series() for _ in range(n)]
    rseries = _Series()
    mems: list[dict[str, float]] = [{} for _ in range(n)]
    walls = [0.0] * n
    load = [loadavg()]
    t_all = time.time()
    ref = open_reference() if (open_reference is not None and timing) else None
    ref_memory = dict(ref.memory) if ref is not None else {}
    try:
        for group in groups:
            live: dict[int, Live] = {}
            try:
                if not timing:
                    for i in group:
                        m = open_model(i)
                        mems[i] = dict(m.memory)
                        m.close()
                    continue
                for r in range(sched.rounds):
                    before = {k: len(v) for k, v in rseries.raw.items()}
                    for i in group[:: -1 if r % 2 else 1]:
                        if log and sched.rounds > 1:
                            log(f"    round {r + 1}/{sched.rounds}: {names[i]}")
                        _turn(i, live, open_model, ref, sched, series, rseries, mems, walls, keep)
                    if ref is not None:
                        rseries.rounds.append(
                            {
                                p: float(np.median(rseries.raw[p][before.get(p, 0) :]))
                                for p in TIMED
                                if len(rseries.raw.get(p, [])) > before.get(p, 0)
                            }
                        )
                if ref is not None:  # one more turn for a model whose ratios spread too much
                    for i in group:
                        if _unstable(series[i], sched.tolerance):
                            if log:  # a run like the others for progress callbacks
                                log(f"    one more round: {names[i]} (its ratios to the {reference_name} spread)")
                            _turn(i, live, open_model, ref, sched, series, rseries, mems, walls, keep)
            finally:
                for m in live.values():
                    m.close()
    finally:
        if ref is not None:
            ref.close()
    load.append(loadavg())
    wall_all = time.time() - t_all
    ref_info = _reference_info(rseries, reference_name, sched, load) if ref is not None else None
    if ref_info is not None:
        ref_info["memory"] = ref_memory
    info = ref_info if timing else None
    out = [_measurement(series[i], mems[i], walls[i], sched, info, scale, names[i], timing) for i in range(n)]
    if out and not timing:
        for meas in out:
            meas.wall_s = wall_all / n
    return out


def _measurement(
    s: _Series,
    mem: dict[str, float],
    wall: float,
    sched: Schedule,
    ref_info: dict[str, Any] | None,
    scale: dict[str, float] | None,
    name: str,
    timing: bool,
) -> Measurement:
    """One model's :class:`Measurement` from its samples: timed figures at the schedule's percentile,
    the other series' spread and, with a reference, its ratios to it."""
    raw = s.raw if timing else {}
    meas = Measurement.from_samples({k: v for k, v in raw.items() if k in TIMED}, sched.percentile, mem, {}, wall)
    meas.raw.update({k: v for k, v in raw.items() if k not in TIMED})
    meas.spread.update({k: spread(v) for k, v in raw.items() if k.endswith("_ms") and k not in TIMED and v})
    if ref_info is not None:
        _apply_ratios(meas, s, ref_info, scale, sched.tolerance, name)
    return meas


def all_flags(measurements: Iterable[Measurement]) -> list[str]:
    """Every flag of these measurements (a model's spread ratios) and of their reference (its variation
    between rounds), each once."""
    out: dict[str, None] = {}
    for m in measurements:
        for f in [*m.flags, *(m.reference or {}).get("flags", [])]:
            out.setdefault(f, None)
    return list(out)


def _turn(
    i: int,
    live: dict[int, Live],
    open_model: Callable[[int], Live],
    ref: Live | None,
    sched: Schedule,
    series: list[_Series],
    rseries: _Series,
    mems: list[dict[str, float]],
    walls: list[float],
    keep: bool,
) -> None:
    t = time.time()
    m = live.get(i) or open_model(i)
    mems[i] = mems[i] or dict(m.memory)
    try:
        if ref is None:
            plain_turn(m, sched.prefills, sched.steps, series[i])
        else:
            paired_turn(ref, m, sched.prefills, sched.steps, sched.chunk, rseries, series[i])
    finally:
        if keep:
            live[i] = m
        else:
            m.close()
    walls[i] += time.time() - t


def _unstable(s: _Series, tol: float) -> bool:
    return any(len(v) >= 2 and rel_iqr(v) > tol for v in s.ratios.values())


def _reference_info(rs: _Series, name: str, sched: Schedule, load: list[float]) -> dict[str, Any]:
    """The reference's absolute times in this call, their variation between rounds, the load."""
    info: dict[str, Any] = {"name": name, "load_avg": load, "tolerance": sched.tolerance}
    for p in TIMED:
        if rs.raw.get(p):
            info[p] = robust(rs.raw[p], sched.percentile)
            per = [r[p] for r in rs.rounds if p in r]
            info[f"{p}_rounds"] = per
            info[f"{p}_variation"] = (max(per) / min(per) - 1.0) if len(per) > 1 and min(per) > 0 else 0.0
            info[f"{p}_spread"] = spread(rs.raw[p])
    flags = [
        f"the {name}'s {p[:-3]} time varied {100 * info[f'{p}_variation']:.1f}% between rounds "
        f"(tolerance {100 * sched.tolerance:.0f}%)"
        for p in TIMED
        if info.get(f"{p}_variation", 0.0) > sched.tolerance
    ]
    info["flags"] = flags
    return info


def _apply_ratios(
    meas: Measurement,
    s: _Series,
    ref: dict[str, Any],
    scale: dict[str, float] | None,
    tol: float,
    name: str,
) -> None:
    """``prefill_ms`` / ``decode_ms`` := median ratio x scale; the model's own statistic kept as ``absolute``."""
    meas.absolute = {p: getattr(meas, p) for p in TIMED}
    meas.reference = ref
    for p in TIMED:
        q = s.ratios.get(p)
        if not q:
            continue
        ratio = float(np.median(q))
        meas.ratio[p] = ratio
        meas.ratio_spread[p] = {"n": len(q), "rel_iqr": rel_iqr(q), "min": min(q), "max": max(q)}
        base = (scale or {}).get(p) or ref.get(p)
        assert base is not None  # a ratio of p exists only where the reference timed p
        setattr(meas, p, ratio * float(base))
        if rel_iqr(q) > tol:
            meas.flags.append(
                f"{name}: its {p[:-3]} ratios to the {ref['name']} spread {100 * rel_iqr(q):.1f}% "
                f"(relative IQR over {len(q)} pairs; tolerance {100 * tol:.0f}%)"
            )
    meas.scale = {p: float((scale or {}).get(p) or ref.get(p, 0.0)) for p in TIMED}


def schedule_of(engine: Any, rounds: int | None, min_steps: int) -> Schedule:
    """Rounds, per-round prefills and decode steps, and the reference settings of one ``measure_many``
    of a CPU-timed ``engine`` (``engine.cfg``: repeats, percentile, settings)."""
    rounds = int(rounds or engine.settings.rounds)
    return Schedule(
        rounds=rounds,
        prefills=max(1, -(-int(engine.cfg.repeats) // rounds)),
        steps=max(min_steps, -(-engine.timed_decode_steps() // rounds)),
        chunk=int(engine.settings.reference_chunk),
        tolerance=float(engine.settings.reference_tolerance),
        percentile=float(engine.cfg.percentile),
    )


def interleave(
    engine: Any,
    specs: list[Any],
    open_model: Callable[[int], Live],
    open_reference: Callable[[], Live] | None,
    parts: tuple[str, ...],
    *,
    rounds: int | None,
    min_steps: int,
    **kw: Any,
) -> list[Measurement]:
    """``measure_interleaved`` over ``specs`` with ``engine``'s schedule; each result's memory cut to the
    engine's ``parts`` (any other part the engine reported kept as ``raw['memory_<part>']``)."""
    out = measure_interleaved(
        len(specs),
        open_model,
        schedule_of(engine, rounds, min_steps),
        open_reference=open_reference,
        names=[s.name or f"model{i}" for i, s in enumerate(specs)],
        **kw,
    )
    for m in out:
        reported = m.memory
        m.memory = {k: reported.get(k, 0.0) for k in parts}
        m.raw.update({f"memory_{k}": [v] for k, v in reported.items() if k not in m.memory})
    return out

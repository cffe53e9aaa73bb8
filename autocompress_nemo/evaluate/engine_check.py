"""The student measured in the target's engine, against each budget, next to the prediction.

Measured figures (``B`` batch, ``O`` output tokens, from one engine ``Measurement``):

- ``prefill_ms`` = ``ttft_ms``: one prefill of the workload's input x ``B``;
- ``decode_ms`` = ``tpot_ms``: one decode step of ``B`` sequences;
- ``response_latency_ms = prefill_ms + O * decode_ms``;
- ``throughput_tps = 1000 * B / decode_ms``;
- ``memory_bytes = sum(memory parts)`` (weights, kv, compute, output, state as the engine reports them).

Each budget constraint is resolved to an absolute value with the cost model's own
``resolve_budget`` (a relative budget ``"0.6x"`` uses the parent's figures *measured the same
way*, ``parent_measured``; a throughput budget becomes a per-step decode time). A check passes
when the measured value is at most the budget. Every figure carries its source: ``"measured
in <engine version> on <device>"``, or ``"estimated, not measured"`` when the engine is the
analytic roofline.
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines import Measurement, Workload, get_engine
from autocompress_nemo.costs.predictor import resolve_budget

ESTIMATED = "estimated, not measured"
_ALIASES = {"ttft_ms": "prefill_ms", "tpot_ms": "decode_ms"}


def measured_figures(m: Measurement, workload: Workload) -> dict[str, Any]:
    """Latency per phase, response latency, throughput and memory by part from one measurement."""
    decode = float(m.decode_ms)
    return {
        "prefill_ms": float(m.prefill_ms),
        "ttft_ms": float(m.prefill_ms),
        "decode_ms": decode,
        "tpot_ms": decode,
        "response_latency_ms": float(m.prefill_ms) + workload.output_len * decode,
        "throughput_tps": 1000.0 * workload.batch / decode if decode > 0 else float("inf"),
        "memory_bytes": float(m.memory_bytes),
        "memory": {k: float(v) for k, v in m.memory.items()},
        "batch": workload.batch,
    }


def source_label(engine: Any, m: Measurement | None = None) -> str:
    """``measured in <engine version> on <device>`` or ``estimated, not measured``."""
    if getattr(engine, "estimated", False) or (m is not None and m.estimated):
        return f"{ESTIMATED} ({engine.name} model)"
    version = engine.version() or engine.name
    return f"measured in {version} on {engine.device()}"


def prediction_source(predictor: Any) -> str:
    """Where a prediction comes from: the cost table's engine and device, or the roofline estimate."""
    table = getattr(predictor, "table", None)
    prov = dict(getattr(table, "provenance", {}) or {})
    if getattr(predictor, "estimated", False) or prov.get("estimated"):
        return f"{ESTIMATED} (analytic cost model)"
    where = " on ".join(str(prov[k]) for k in ("engine_version", "device") if prov.get(k))
    return f"predicted from the cost table measured in {where}" if where else "predicted from a measured cost table"


def _constraints(target: Any) -> list[Any]:
    budget = getattr(target, "budget", None)
    return list(getattr(budget, "constraints", None) or [])


def budget_checks(
    measured: dict[str, Any],
    predicted: dict[str, Any] | None,
    target: Any,
    parent_measured: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per budget constraint: metric, as given, absolute budget, measured, predicted, pass."""
    rows: list[dict[str, Any]] = []
    batch = int(measured.get("batch", 1) or 1)
    for c in _constraints(target):
        metric, value = str(c.metric), c.value
        try:
            resolved = resolve_budget([c], parent_measured or {}, batch=batch)
        except ValueError as e:
            rows.append(
                {
                    "metric": metric,
                    "value": str(value),
                    "budget": None,
                    "measured": None,
                    "predicted": None,
                    "pass": None,
                    "note": f"cannot resolve: {e}",
                }
            )
            continue
        ((m_abs, b_abs),) = resolved.items()
        m_abs = _ALIASES.get(m_abs, m_abs)
        meas = measured.get(m_abs)
        pred = predicted.get(m_abs) if predicted else None
        row = {
            "metric": metric,
            "value": str(value),
            "checked_as": m_abs,
            "budget": b_abs,
            "measured": meas,
            "predicted": pred,
            "pass": bool(meas is not None and meas <= b_abs),
            "margin_pct": (100.0 * (b_abs - meas) / b_abs) if meas is not None and b_abs else None,
        }
        if metric == "throughput_tps":  # also in the unit the user wrote
            row["measured_throughput_tps"] = measured.get("throughput_tps")
        rows.append(row)
    return rows


def prediction_error(measured: dict[str, Any], predicted: dict[str, Any] | None) -> dict[str, float]:
    """``100 * (predicted - measured) / measured`` per shared scalar metric."""
    if not predicted:
        return {}
    out = {}
    for k in ("prefill_ms", "decode_ms", "response_latency_ms", "throughput_tps", "memory_bytes"):
        m, p = measured.get(k), predicted.get(k)
        if isinstance(m, int | float) and isinstance(p, int | float) and m:
            out[k] = 100.0 * (float(p) - float(m)) / float(m)
    return out


def engine_check(
    spec: ArchSpec,
    target: Any,
    *,
    weights: Any = None,
    predictor: Any = None,
    parent_measured: dict[str, Any] | None = None,
    engine: Any = None,
    workdir: Any = None,
    measurement: Measurement | None = None,
    **measure_kw: Any,
) -> dict[str, Any]:
    """Measure ``spec`` (with ``weights``) in ``target``'s engine and check every budget.

    ``predictor``: a ``costs.Predictor`` for the prediction next to each figure (optional).
    ``parent_measured``: the parent's ``measured`` figures from this same function, needed by
    relative budgets. ``measurement``: reuse one already taken instead of measuring again.
    ``measure_kw`` go to the engine's ``measure`` (llama.cpp: ``gguf_path=``).
    Returns: source, engine (provenance), measured, predicted (+ its source), checks,
    pass (every check passed), prediction_error_pct.
    """
    engine = engine or get_engine(target, workdir)
    wl = Workload.from_config(target.workload)
    problems = engine.check_servable(spec)
    if problems:
        raise ValueError(f"{engine.name} cannot serve {spec.name or 'the student'}: " + "; ".join(problems))
    m = measurement if measurement is not None else engine.measure(spec, wl, weights, **measure_kw)
    measured = measured_figures(m, wl)
    measured["params"] = float(param_count(spec))  # counted from the shapes, for a params budget
    predicted = None
    if predictor is not None:
        predicted = dict(predictor.predict(spec))
        predicted["source"] = prediction_source(predictor)
    checks = budget_checks(measured, predicted, target, parent_measured)
    return {
        "source": source_label(engine, m),
        "engine": engine.provenance(),
        "workload": {
            "batch": wl.batch,
            "input_len": wl.input_len,
            "output_len": wl.output_len,
            "context_len": wl.context_len,
        },
        "measured": measured,
        "predicted": predicted,
        "checks": checks,
        "pass": all(r["pass"] for r in checks) if checks else None,
        "prediction_error_pct": prediction_error(measured, predicted),
        "spread": m.spread,
    }

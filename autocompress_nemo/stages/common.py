"""What several stages share: budgets against the parent, engine measurements in budget units,
the KD judge's calibration batches, the search capabilities under the run's layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.config.resolve import search_capabilities  # noqa: F401  (the stages' name for it)
from autocompress_nemo.context import Context, read_json
from autocompress_nemo.stages.layout import ValidateDir


@dataclass(frozen=True)
class Method:
    """A compression method, registered once (:data:`REGISTRY`); everything that depends on the
    method is one of its fields, so no stage asks "which method is this?".

    ``router``: the search trains the differentiable router on the supernet (else it enumerates
    uniform candidates, Minitron++); ``shares_supernet``: a further budget of a family trains its
    router on the first budget's supernet (``runner.py``); ``settle_grows``: repair / grow may grow
    the settled child toward the budget; ``guard_uniform_alternative``: the quality guard replaces a
    child worse than the best uniform one (Minitron++'s child already is a uniform child: it only
    records); ``baseline``: what ``baseline=true`` adds next to the main method."""

    name: str
    label: str
    router: bool = False
    shares_supernet: bool = False
    settle_grows: bool = False
    guard_uniform_alternative: bool = False
    baseline: bool = False


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "autocompress",
            "AutoCompress",
            router=True,
            shares_supernet=True,
            settle_grows=True,
            guard_uniform_alternative=True,
        ),
        Method("minitron_pp", "Minitron++", baseline=True),
    )
}
METHODS = {name: m.label for name, m in REGISTRY.items()}


def method_object(name: str) -> Method:
    if name not in REGISTRY:
        raise ValueError(f"search.method={name!r}: known methods are {', '.join(REGISTRY)}")
    return REGISTRY[name]


BUDGET_READS: tuple[str, ...] = ("target.budget", "target.workload.batch")
"""What ``budgets`` reads (besides the parent's measured row in the validate artifact)."""
JUDGE_READS: tuple[str, ...] = (
    "search.batch_size",
    "search.judge_seq_len",
    "search.judge_batches",
    "search.kd_temperature",
    "data",
)
"""What ``judge_batches`` and a KD judgement read."""


def parent_reference(validation: ValidateDir | None, predicted: dict[str, Any]) -> tuple[dict[str, float], str]:
    """The parent's costs that relative budgets refer to: measured in the engine when the
    validate stage measured it, else predicted (and said so)."""
    if validation is not None and validation.validation.is_file():
        for row in read_json(validation.validation).get("rows", []):
            if row.get("name") == "parent":
                ref = {
                    k[5:]: float(x) for k, x in row.items() if k.startswith("meas_") and not k.startswith("meas_mem_")
                }
                ref["params"] = float(predicted["params"])
                return ref, "measured"
    return {k: float(v) for k, v in predicted.items() if isinstance(v, (int, float))}, "predicted"


def budgets(
    ctx: Context, predictor: Any, parent: ArchSpec, validation: ValidateDir | None
) -> tuple[dict[str, float], str]:
    """The budgets in absolute units (``BUDGET_READS``) and whether the parent reference was measured."""
    from autocompress_nemo.costs.predictor import resolve_budget

    ref, how = parent_reference(validation, predictor.predict(parent))
    return resolve_budget(ctx.cfg.target.budget, ref, int(ctx.cfg.target.workload.batch)), how


def measured_metrics(m: Any, wl: Any, spec: ArchSpec) -> dict[str, float]:
    """One engine ``Measurement`` in the budget metrics' names and units: response latency
    ``prefill + output_len * decode``, throughput ``1000 * batch / decode`` tok/s."""
    return {
        "prefill_ms": m.prefill_ms,
        "ttft_ms": m.prefill_ms,
        "decode_ms": m.decode_ms,
        "tpot_ms": m.decode_ms,
        "response_latency_ms": m.prefill_ms + wl.output_len * m.decode_ms,
        "throughput_tps": 1000.0 * wl.batch / m.decode_ms if m.decode_ms else float("inf"),
        "memory_bytes": m.memory_bytes,
        "params": float(param_count(spec)),
    }


def reference_metrics(m: Any, wl: Any, parent: ArchSpec) -> dict[str, float] | None:
    """The parent's metrics measured as the reference of ``m`` (in the same rounds), in the budget
    metrics' names and units (memory summed over the parts ``m`` reports); ``None`` when ``m`` was
    not timed against a reference."""
    ref = getattr(m, "reference", None) or {}
    if "decode_ms" not in ref or "prefill_ms" not in ref:
        return None
    from types import SimpleNamespace

    mem, memory_parts = ref.get("memory") or {}, tuple(m.memory)
    as_meas = SimpleNamespace(
        prefill_ms=float(ref["prefill_ms"]),
        decode_ms=float(ref["decode_ms"]),
        memory_bytes=float(sum(mem.get(k, 0.0) for k in memory_parts)) if mem else float("nan"),
    )
    return measured_metrics(as_meas, wl, parent)


def budgets_measured(
    ctx: Context, m: Any, wl: Any, parent: ArchSpec, budget: dict[str, float]
) -> tuple[dict[str, float], dict[str, float] | None]:
    """The budgets in the units of measurement ``m``: relative ones against the parent timed in the same
    rounds (so ``0.6x`` decode passes exactly when the measured ratio is at most 0.6), absolute ones as
    given (they then compare with ``ratio x`` the parent's time now: converted through the reference
    measured at check time). Without a reference: ``budget`` unchanged (absolute timing).
    Returns (budgets, the parent's measured metrics or None)."""
    from autocompress_nemo.costs.predictor import resolve_budget

    ref = reference_metrics(m, wl, parent)
    if ref is None:
        return dict(budget), None
    out = resolve_budget(ctx.cfg.target.budget, ref, int(ctx.cfg.target.workload.batch))
    return {k: (v if v == v else budget[k]) for k, v in out.items()}, ref  # NaN: no memory read for the reference


def numbers(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def judge_batches(ctx: Context) -> list[torch.Tensor]:
    """The fixed calibration batches the KD judge scores children on (``search.judge_batches`` of
    ``search.batch_size x search.judge_seq_len`` tokens), shared by the search and the extract check."""
    s = ctx.cfg.search
    bs, seq = int(s.batch_size), int(s.judge_seq_len)
    return [ctx.batch_at("calib", i, bs, seq, seed_offset=41) for i in range(int(s.judge_batches))]


def refit_batches(ctx: Context) -> list[torch.Tensor]:
    """The calibration batches of extract's least-squares re-fit (``extract.refit_batches`` of 2 x
    ``extract.refit_seq_len`` tokens from the train split, a stream of their own), shared with the
    search's re-fit judge (``search.judge_refit``) so that both re-fit the same way."""
    e = ctx.cfg.extract
    return [ctx.batch_at("train", i, 2, int(e.refit_seq_len), seed_offset=71) for i in range(int(e.refit_batches))]


def load_table(ctx: Context, table: Path) -> Any:
    """The cost table of the profile stage, checked against this run's target."""
    from autocompress_nemo.profile.stage import load_table as load

    return load(ctx.cfg, table)

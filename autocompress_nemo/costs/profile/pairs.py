"""The pair design for uniform Llama-style parents: one slope of two ``[full, X * k, full]`` models per option.

Profiling models
----------------
Every profiling model is ``[full, X * k, full]``: the parent's full layer first and last
(which keeps llama.cpp ``deci`` away from its broken layouts: a first layer without
attention, a last layer without ffn) and ``k`` copies of one layer configuration ``X``.
With ``k1`` and ``k2`` copies the slope ``(T(k2) - T(k1)) / (k2 - k1)`` is the cost of one
``X`` layer in each phase. By default ``k1 = 0`` — the base model ``[full, full]``, shared
by all options — and ``k2 = L - 2`` (``L`` = parent layers): profiling models then have the
parent's depth, so cache and scheduling conditions match the models being predicted and the
error of the base measurement cancels in predictions of parent-depth models.

Independent options, profiled once
----------------------------------
A layer is (attention option A, ffn option F); its cost is modelled as
``c_empty + c_attn(A) + c_ffn(F)`` (``c_empty``: an empty layer, both blocks removed).
The table grows with the number of options, not their product:

- ``c_empty``  = slope of ``(removed, removed)`` layers (when the engine can remove both);
- ``c_ffn(F)`` = slope of ``(A_f, F)`` - ``c_empty`` - ``c_attn(A_f)``, where ``A_f`` is a
  removed attention when the engine allows it (ffn-only layers, ``c_attn = 0``), else the
  parent's attention, whose cost is then defined as 0 (an arbitrary split: every layer has
  one attention, so sums are unaffected);
- ``c_attn(A)`` = slope of ``(A, F_r)`` - ``c_empty`` - ``c_ffn(F_r)`` with a reference ffn
  ``F_r`` (the smallest ffn option, so that its measured cost, subtracted, is small).

The intercept is the overhead outside the blocks (embedding, LM head, sampling, scheduling):
``T(base) - 2 * (c_empty + c_attn(A_p) + c_ffn(F_p))``; the table's constant per model is
``intercept + L * c_empty``.

Options: the search's own (``grid.dense_options``: ``search.space.attention_options`` and
``ffn_widths`` at ``search.ffn_options`` points); other widths interpolate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.config.engine import capabilities_of
from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload
from autocompress_nemo.costs.memory import kv_cache_bytes, weight_bytes
from autocompress_nemo.costs.profile.grid import dense_options
from autocompress_nemo.costs.profile.provenance import (
    Progress,
    planned_runs,
    reference_record,
    run_row,
    table_provenance,
)
from autocompress_nemo.costs.table import PHASES, CostTable

Layer = tuple[AttentionBlock, MlpBlock]


@dataclass
class Plan:
    """The profiling models to run: name -> (layer configuration X, k)."""

    full: Layer
    empty: Layer | None
    ffn_ref_attention: AttentionBlock
    ffn_ref: MlpBlock
    ffn_options: list[MlpBlock]
    attention_options: list[AttentionBlock]
    k1: int
    k2: int

    def layers(self) -> dict[str, Layer]:
        """Distinct layer configurations to profile, by name."""
        out: dict[str, Layer] = {}
        if self.empty is not None:
            out["empty"] = self.empty
        for m in self.ffn_options:
            out[f"ffn{m.ffn}"] = (self.ffn_ref_attention, m)
        for a in self.attention_options:
            key = (a, self.ffn_ref)
            if key not in out.values():
                out[f"attn{a.num_heads}h{a.num_kv_groups}g"] = key
        return out


def frame_layer(parent: ArchSpec) -> Layer:
    """The full layer that frames every profiling model: the parent's layer when its layers are
    alike; for a heterogeneous parent (per-layer widths, removed blocks) its widest attention and
    widest mlp (the options of every layer are profiled between them, ``dense_options``)."""
    layers = parent.layers()
    attns = [a for a, _ in layers if not a.removed] or [layers[0][0]]
    mlps = [m for _, m in layers if not m.removed] or [layers[0][1]]
    return (
        max(attns, key=lambda a: (a.num_heads, a.num_kv_groups)),
        max(mlps, key=lambda m: m.ffn),
    )


def make_plan(parent: ArchSpec, caps: Any, ffn_points: int, k1: int = 0, k2: int | None = None) -> Plan:
    """The pair design's models for a Llama-style ``parent`` over the search's options (``caps``: the
    capabilities the search runs under; ``ffn_points``: ``search.ffn_options``): every block's
    options, each profiled between two copies of :func:`frame_layer`."""
    caps = capabilities_of(caps)
    layers = parent.layers()
    a_p, m_p = frame_layer(parent)
    attns, ffns = dense_options(parent, caps, ffn_points)
    removed_attn = AttentionBlock(0, 0, a_p.head_dim)
    empty = (removed_attn, MlpBlock(0, m_p.activation)) if caps.remove_attention and caps.remove_mlp else None
    k2 = k2 if k2 is not None else max(1, len(layers) - 2)
    if not 0 <= k1 < k2:
        raise ValueError(f"profiling needs 0 <= k1 < k2, got k1={k1}, k2={k2}")
    return Plan(
        full=(a_p, m_p),
        empty=empty,
        ffn_ref_attention=removed_attn if caps.remove_attention else a_p,
        ffn_ref=ffns[0],
        ffn_options=ffns,
        attention_options=attns,
        k1=k1,
        k2=k2,
    )


def profile_spec(parent: ArchSpec, full: Layer, x: Layer, k: int, name: str) -> ArchSpec:
    """``[full, X * k, full]``."""
    blocks = [*full] + [*x] * k + [*full]
    return parent.replace(blocks=tuple(blocks), name=name)


def build_pairs_table(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    *,
    caps: Any,
    ffn_points: int,
    log: Callable[[str], None],
) -> CostTable:
    """Profile every option of a uniform ``parent`` in ``engine`` under ``workload`` (module docstring)."""
    s = engine.settings
    plan = make_plan(parent, caps, ffn_points, s.profile_k1, s.profile_k2 or None)
    jobs: list[tuple[str, Layer, int]] = [("base", plan.full, 0)]
    for name, x in plan.layers().items():
        if plan.k1:
            jobs.append((f"{name}_k{plan.k1}", x, plan.k1))
        jobs.append((f"{name}_k{plan.k2}", x, plan.k2))
    t_start = time.time()
    specs = [profile_spec(parent, plan.full, x, k, name) for name, x, k in jobs]
    log(
        f"[profile] {len(jobs)} profiling models ({len(plan.ffn_options)} ffn, {len(plan.attention_options)} "
        f"attention options, k1={plan.k1}, k2={plan.k2}); engine {engine.name}, workload {workload}"
    )
    for i, (name, x, k) in enumerate(jobs):
        log(
            f"  model {i + 1}/{len(jobs)} {name}: {x[0].num_heads}h/{x[0].num_kv_groups}g ffn {x[1].ffn} x{k} "
            "between full layers"
        )
    reference = parent.replace(name="parent")
    progress = Progress(log, planned_runs(engine, specs, reference), t_start, detail=True)

    results = engine.measure_many(specs, workload, log=progress, reference=reference)
    meas: dict[str, Measurement] = {}
    runs: list[dict[str, Any]] = []
    for (name, x, k), m, sp in zip(jobs, results, specs, strict=True):
        meas[name] = m
        runs.append(run_row(sp, m, layer=[x[0].__dict__, x[1].__dict__], k=k))
        log(
            f"    {name}: prefill {m.prefill_ms:.3f} ms, decode {m.decode_ms:.4f} ms/step, "
            f"memory {m.memory_bytes / 2**20:.2f} MiB"
        )

    intercept, c_empty, blocks = _coefficients(plan, meas)
    base = meas["base"]
    dtype = str(engine.cfg.dtype)
    base_spec = profile_spec(parent, plan.full, plan.full, 0, "base")
    memory = {
        **_runtime_fit(engine, results, base),
        **_compute_probes(engine, parent, plan, workload, log),
        "weights_overhead_bytes": base.memory.get("weights", 0.0) - weight_bytes(base_spec, dtype),
        # KV cells the engine allocates for B x C tokens (llama.cpp pads to a multiple of 256)
        # (read from the run with the largest KV buffer: the log's 0.01 MiB resolution matters least there)
        "kv_tokens": kv_tokens(
            *max(zip(results, specs, strict=True), key=lambda ms: ms[0].memory.get("kv", 0.0)),
            workload,
            str(engine.cfg.kv_dtype),
        ),
        "norm_dtype": engine.norm_dtype(dtype),
    }
    settings = dataclasses.asdict(s)
    settings.update({"percentile": float(engine.cfg.percentile), "k1": plan.k1, "k2": plan.k2})
    seen = [m.memory.get("compute", 0.0) for m in results] + list(memory["compute_range"])
    memory["compute_range"] = [min(seen), max(seen)]  # over profiling models and probes
    return CostTable(
        provenance=table_provenance(
            engine, workload, parent, len(jobs), t_start, settings, **reference_record(results, log)
        ),
        parent=parent,
        intercept=intercept,
        layer_overhead=c_empty,
        blocks=blocks,
        memory=memory,
        runs=runs,
    )


def _coefficients(plan: Any, meas: dict[str, Measurement]) -> tuple[dict, dict, list[dict[str, Any]]]:
    """Each option's cost per phase from the profiling models' slopes in ``k``: (the intercept, an
    empty layer's overhead, one row per ffn and attention option)."""

    def slope(name: str, phase: str) -> float:
        lo = getattr(meas[f"{name}_k{plan.k1}"] if plan.k1 else meas["base"], phase)
        return (getattr(meas[f"{name}_k{plan.k2}"], phase) - lo) / (plan.k2 - plan.k1)

    names = {v: k for k, v in plan.layers().items()}
    c_empty = {p: slope("empty", p) if plan.empty else 0.0 for p in PHASES}
    c_ffn = {
        m: {p: slope(names[(plan.ffn_ref_attention, m)], p) - c_empty[p] for p in PHASES} for m in plan.ffn_options
    }
    c_attn = {
        a: {p: slope(names[(a, plan.ffn_ref)], p) - c_empty[p] - c_ffn[plan.ffn_ref][p] for p in PHASES}
        for a in plan.attention_options
    }
    a_p, m_p = plan.full
    intercept = {p: meas["base"].__dict__[p] - 2 * (c_empty[p] + c_attn[a_p][p] + c_ffn[m_p][p]) for p in PHASES}
    blocks = [{"block": m.__dict__, **c_ffn[m], "source": names[(plan.ffn_ref_attention, m)]} for m in plan.ffn_options]
    blocks += [{"block": a.__dict__, **c_attn[a], "source": names[(a, plan.ffn_ref)]} for a in plan.attention_options]

    return intercept, c_empty, blocks


def _runtime_fit(engine: Engine, results: list[Measurement], base: Measurement) -> dict[str, Any]:
    """The runtime buffers (``output``): llama.cpp's output buffer is a constant (the base model's).
    An engine whose runtime is read from its process's resident set (vLLM on CPU:
    ``workers/vllm_worker.py``) holds more of it for more weights (its CPU linear layers keep
    repacked copies), so there it is fitted over the profiling models as ``output = a + b x weights``
    (least squares) when the weights explain it (R^2 >= 0.8, ``b >= 0``), else as the median over the
    profiling models: ``output_bytes = a``, ``runtime_per_weight_byte = b``."""
    out: dict[str, Any] = {"output_bytes": base.memory.get("output", 0.0)}
    pts = [(m.memory.get("weights", 0.0), m.memory.get("output", 0.0)) for m in results]
    if engine.name not in ("vllm", "trtllm") or len(pts) < 3 or not any(o for _, o in pts):
        return out
    import numpy as np

    w, o = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if float(w.max() - w.min()) <= 0.0:
        return out
    b, a = np.polyfit(w, o, 1)
    resid = o - (a + b * w)
    spread = float(((o - o.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / spread if spread > 0 else 0.0
    if b < 0 or r2 < 0.8:  # the weights do not explain it (SmolLM2 in vLLM: 878-1019 MiB, not by size)
        b, a = 0.0, float(np.median(o))
        resid = o - a
    out.update(
        output_bytes=float(a),
        runtime_per_weight_byte=float(b),
        runtime_fit={"models": len(pts), "r2": r2, "max_abs_residual_bytes": float(np.abs(resid).max())},
    )
    return out


def _compute_probes(
    engine: Engine, parent: ArchSpec, plan: Plan, wl: Workload, log: Callable[[str], None]
) -> dict[str, Any]:
    """Workspace (compute buffer) per option, from memory-only probe models (no timing).

    The engine's workspace is a peak over the graph, set by the widest layer, so it is not
    additive. Probes are 2-layer uniform models ``[X, X]``: ``(A_min, F)`` for every ffn
    option and ``(A, F_min)`` for every attention option; ``(A_min, F_min)`` is the floor.
    A model's workspace is predicted as the largest probe among the options it uses.
    """
    a_min, f_min = plan.attention_options[0], plan.ffn_options[0]
    probes = [(a_min, f_min)] + [(a_min, m) for m in plan.ffn_options] + [(a, f_min) for a in plan.attention_options]
    specs = [profile_spec(parent, x, x, 0, f"probe{i}") for i, x in enumerate(probes)]
    log(f"[profile] {len(specs)} memory probes (workspace per option, no timing)")
    if "timing" in engine.measure_many.__code__.co_varnames:
        res = engine.measure_many(specs, wl, rounds=1, timing=False)  # type: ignore[call-arg]
    else:
        res = engine.measure_many(specs, wl, rounds=1)
    per = [
        {"block": (m if i <= len(plan.ffn_options) else a).__dict__, "bytes": r.memory.get("compute", 0.0)}
        for i, ((a, m), r) in enumerate(zip(probes, res, strict=True))
        if i > 0
    ]
    seen = [r.memory.get("compute", 0.0) for r in res]
    return {
        "compute_base_bytes": res[0].memory.get("compute", 0.0),
        "compute_bytes": per,
        "compute_range": [min(seen), max(seen)],
    }


def kv_tokens(m: Measurement, spec: ArchSpec, wl: Workload, kv_dtype: str, pad: int = 1) -> int:
    """Token cells behind the reported KV buffer: ``kv_bytes / kv_bytes_per_token`` (falls back to ``B * C``),
    snapped to a multiple of ``pad`` (llama.cpp allocates cells in multiples of 256 and logs the buffer
    in MiB to two decimals, which is coarse for a tiny model)."""
    per_token = kv_cache_bytes(spec, 1, 1, kv_dtype)
    kv = m.memory.get("kv", 0.0)
    if m.estimated or not kv or not per_token:
        return wl.context_len * wl.batch
    return max(pad, int(round(kv / per_token / pad)) * pad)

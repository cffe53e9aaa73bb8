"""Build a cost table by profiling short models inside the real engine (DESIGN.md section 3).

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

Option grid: ffn widths ``F_p * i / n`` snapped down to ``ffn_align`` (``n`` =
``engine.settings.ffn_grid`` or ``search.ffn_options``), other widths interpolate;
attention (KV groups, heads per group) as the capabilities allow; removed blocks where allowed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload, _cap
from autocompress_nemo.costs.memory import conv_extra_columns, kv_cache_bytes, weight_bytes
from autocompress_nemo.costs.table import PHASES, CostTable, make_provenance, spec_hash

Layer = tuple[AttentionBlock, MlpBlock]


def ffn_grid(parent_ffn: int, n: int, align: int, vary: bool) -> list[int]:
    """``{F_p} U {floor(F_p*i/n / align)*align : i=1..n-1}`` (nonzero), ascending; ``[F_p]`` when ffn cannot vary."""
    if not vary:
        return [parent_ffn]
    align = max(1, int(align))
    out = {parent_ffn}
    for i in range(1, max(1, n)):
        w = (parent_ffn * i // n) // align * align
        if w > 0:
            out.add(w)
    return sorted(out)


def attention_grid(parent: AttentionBlock, caps: Any) -> list[AttentionBlock]:
    """Attention options: ``(g * q heads, g groups)`` for ``g <= G``, ``q <= H/G`` when both vary;
    only ``g`` (query heads fixed, ``g`` dividing ``H``) when query heads cannot vary."""
    g_max, hpg, h = parent.num_kv_groups, parent.heads_per_group, parent.num_heads
    vary_g, vary_q = _cap(caps, "vary_kv_groups"), _cap(caps, "vary_query_heads")
    opts = set()
    for g in range(1, g_max + 1) if vary_g else [g_max]:
        if vary_q:
            opts.update(AttentionBlock(g * q, g, parent.head_dim) for q in range(1, hpg + 1))
        elif h % g == 0:
            opts.add(AttentionBlock(h, g, parent.head_dim))
    opts.add(parent)
    return sorted(opts, key=lambda b: (b.num_heads, b.num_kv_groups))


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


def make_plan(parent: ArchSpec, caps: Any, ffn_points: int, k1: int = 0, k2: int | None = None) -> Plan:
    layers = parent.layers()
    a_p, m_p = layers[0]
    if any(layer != (a_p, m_p) for layer in layers):
        raise ValueError(
            "profiling needs a uniform parent (every layer the same shape); "
            f"got {parent.name or 'a heterogeneous parent'}"
        )
    ffns = [
        MlpBlock(f, m_p.activation)
        for f in ffn_grid(m_p.ffn, ffn_points, _cap(caps, "ffn_align", 1), _cap(caps, "vary_ffn"))
    ]
    can_rm_attn = bool(_cap(caps, "remove_attention"))
    removed_attn = AttentionBlock(0, 0, a_p.head_dim)
    empty = (removed_attn, MlpBlock(0, m_p.activation)) if can_rm_attn and _cap(caps, "remove_mlp") else None
    k2 = k2 if k2 is not None else max(1, len(layers) - 2)
    if not 0 <= k1 < k2:
        raise ValueError(f"profiling needs 0 <= k1 < k2, got k1={k1}, k2={k2}")
    return Plan(
        full=(a_p, m_p),
        empty=empty,
        ffn_ref_attention=removed_attn if can_rm_attn else a_p,
        ffn_ref=ffns[0],
        ffn_options=ffns,
        attention_options=attention_grid(a_p, caps),
        k1=k1,
        k2=k2,
    )


def profile_spec(parent: ArchSpec, full: Layer, x: Layer, k: int, name: str) -> ArchSpec:
    blocks = [*full] + [*x] * k + [*full]
    return parent.replace(blocks=tuple(blocks), name=name)


def build_table(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    *,
    ffn_points: int = 8,
    k1: int | None = None,
    k2: int | None = None,
    log: Callable[[str], None] | None = None,
) -> CostTable:
    """Profile every option of ``parent`` in ``engine`` under ``workload`` and return the table."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if not parent.is_dense_layered():  # MoE / Mamba hybrids: per-block-option profiling below
        return build_hybrid_table(engine, parent, workload, ffn_points=ffn_points, log=log)
    k1 = int(engine.setting("profile_k1", 0)) if k1 is None else k1
    k2_set = engine.setting("profile_k2", "auto") if k2 is None else k2
    plan = make_plan(
        parent,
        engine.capabilities,
        int(engine.setting("ffn_grid", ffn_points)),
        k1,
        None if k2_set in (None, "auto") else int(k2_set),
    )
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
    done = [0]
    total = len(jobs) * int(engine.setting("rounds", 2))

    def progress(msg: str) -> None:
        done[0] += 1
        el = time.time() - t_start
        log(
            f"[profile {done[0]}/{total}] timing{msg[msg.index(':') :]} "
            f"({total - done[0]} runs remain, ~{el / done[0] * (total - done[0]):.0f} s left)"
        )

    results = engine.measure_many(specs, workload, log=progress)
    meas: dict[str, Measurement] = {}
    runs: list[dict[str, Any]] = []
    for (name, x, k), m, s in zip(jobs, results, specs, strict=True):
        meas[name] = m
        runs.append(_run_row(s, m, layer=[x[0].__dict__, x[1].__dict__], k=k))
        log(
            f"    {name}: prefill {m.prefill_ms:.3f} ms, decode {m.decode_ms:.4f} ms/step, "
            f"memory {m.memory_bytes / 2**20:.2f} MiB"
        )

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

    base = meas["base"]
    dtype = str(engine.cfg.dtype)
    base_spec = profile_spec(parent, plan.full, plan.full, 0, "base")
    memory = {
        "output_bytes": base.memory.get("output", 0.0),
        **_compute_probes(engine, parent, plan, workload, log),
        "weights_overhead_bytes": base.memory.get("weights", 0.0) - weight_bytes(base_spec, dtype),
        # KV cells the engine allocates for B x C tokens (llama.cpp pads to a multiple of 256)
        # (read from the run with the largest KV buffer: the log's 0.01 MiB resolution matters least there)
        "kv_tokens": _kv_tokens(
            *max(zip(results, specs, strict=True), key=lambda ms: ms[0].memory.get("kv", 0.0)),
            workload,
            str(getattr(engine.cfg, "kv_dtype", "f16")),
        ),
        "norm_dtype": "f32" if engine.name == "llama_cpp" else dtype,
    }
    settings = {k: v for k, v in dict(engine.cfg.settings or {}).items()}
    settings.update({"percentile": float(engine.cfg.percentile), "k1": plan.k1, "k2": plan.k2})
    seen = [m.memory.get("compute", 0.0) for m in results] + list(memory["compute_range"])
    memory["compute_range"] = [min(seen), max(seen)]  # over profiling models and probes
    prov = _table_provenance(engine, workload, parent, len(jobs), t_start, settings)
    return CostTable(
        provenance=prov,
        parent=parent,
        intercept=intercept,
        layer_overhead=c_empty,
        blocks=blocks,
        memory=memory,
        runs=runs,
    )


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
    if hasattr(engine, "measure_many") and "timing" in engine.measure_many.__code__.co_varnames:
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


def _kv_tokens(m: Measurement, spec: ArchSpec, wl: Workload, kv_dtype: str) -> int:
    """Token cells behind the reported KV buffer: ``kv_bytes / kv_bytes_per_token`` (falls back to ``B * C``)."""
    per_token = kv_cache_bytes(spec, 1, 1, kv_dtype)
    kv = m.memory.get("kv", 0.0)
    if m.estimated or not kv or not per_token:
        return wl.context_len * wl.batch
    return int(round(kv / per_token))


def expected_settings(engine_cfg: Any) -> dict[str, Any]:
    """Engine settings that change what is measured (compared when a table is loaded)."""
    s = dict(engine_cfg.settings or {})
    keep = ("n_batch", "n_ubatch", "decode_context", "tensor_parallel", "max_num_seqs", "gpu_memory_utilization")
    return {k: s[k] for k in keep if k in s}


# -- hybrids (MoE / Mamba / attention / MLP blocks in any order) ---------------------------------
def hybrid_profile_options(parent: ArchSpec, caps: Any, ffn_points: int) -> list[Any]:
    """Distinct block options to profile: every option of the hybrid search space
    (``search.space_hybrid``) and every parent block, MoE blocks as their parts (``table.moe_parts``)."""
    from autocompress_nemo.arch.spec import MoeBlock
    from autocompress_nemo.costs.table import moe_parts
    from autocompress_nemo.search.space import build_space

    out: list[Any] = []
    for d in build_space(parent, caps, ffn_points):
        out += [o for o in d.options if not o.removed and o not in out]
    for b in parent.blocks:
        for p in moe_parts(b) if isinstance(b, MoeBlock) else (b,):
            if not p.removed and p not in out:
                out.append(p)
    return out


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


def build_hybrid_table(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    *,
    ffn_points: int = 8,
    log: Callable[[str], None] | None = None,
) -> CostTable:
    """Cost table of a hybrid parent, by ``engine.settings.profile_method``:

    - ``fit`` (default for measured engines): per-block costs and the constant per forward fitted by
      non-negative least squares to ``N`` children of the search space (``profile/hybrid_fit.py``);
      ``N = profile_models`` (default ``3 x`` the unknowns) plus the parent, in one interleaved session.
    - ``differences`` (default for estimated engines, exact there): one difference of two models per
      option (``_hybrid_differences``).

    Memory constants come from the parent's run in both. Provenance records the method, every
    profiling model's spec hash (``profile_model_hashes``: validation leaves those models out) and,
    for ``fit``, the fit's residuals (``fit``).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    method = str(engine.setting("profile_method", "differences" if engine.estimated else "fit"))
    if method not in ("fit", "differences"):
        raise ValueError(f"engine.settings.profile_method={method!r}: use fit or differences")
    options = hybrid_profile_options(parent, engine.capabilities, int(engine.setting("ffn_grid", ffn_points)))
    t_start = time.time()
    if method == "fit":
        specs, results, blocks, intercept, runs, extra = _hybrid_fit(
            engine, parent, workload, options, int(engine.setting("ffn_grid", ffn_points)), log
        )
    else:
        specs, results, blocks, intercept, runs, extra = _hybrid_differences(engine, parent, workload, options, log)
    base = results[0]  # the parent, in both designs
    dtype = str(engine.cfg.dtype)
    norm_dtype = "f32" if engine.name == "llama_cpp" else dtype
    comp = [m.memory.get("compute", 0.0) for m in results]
    memory = {
        "output_bytes": base.memory.get("output", 0.0),
        "compute_bytes": [],
        "compute_base_bytes": base.memory.get("compute", 0.0),
        "compute_range": [min(comp), max(comp)],
        "weights_overhead_bytes": base.memory.get("weights", 0.0) - weight_bytes(parent, dtype, norm_dtype),
        "kv_tokens": workload.context_len * workload.batch,
        "norm_dtype": norm_dtype,
        # conv-state columns beyond K-1 that the engine keeps (transformers: K), from the base's state
        "conv_extra": conv_extra_columns(parent, workload.batch, "f32", base.memory.get("state", 0.0))
        if not base.estimated
        else 0,
    }
    settings = {kk: v for kk, v in dict(engine.cfg.settings or {}).items()}
    settings.update(
        {"percentile": float(engine.cfg.percentile), "method": f"hybrid_{method}", **extra.pop("settings", {})}
    )
    prov = _table_provenance(
        engine,
        workload,
        parent,
        len(specs),
        t_start,
        settings,
        profile_model_hashes=sorted({spec_hash(s) for s in specs}),
        **extra,
    )
    log(
        f"[profile] hybrid table ({method}): {len(blocks)} block options; intercept prefill "
        f"{intercept['prefill_ms']:.3f} ms, decode {intercept['decode_ms']:.3f} ms; {time.time() - t_start:.0f} s"
    )
    return CostTable(
        provenance=prov,
        parent=parent,
        intercept=intercept,
        layer_overhead={p: 0.0 for p in PHASES},
        blocks=blocks,
        memory=memory,
        runs=runs,
    )


def _table_provenance(
    engine: Any, workload: Any, parent: ArchSpec, n_models: int, t_start: float, settings: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """A cost table's provenance: the engine's fields, the workload, the decode context, the
    settings that must match at load time, the parent, and what this profiling run spent."""
    prov = make_provenance(
        engine.provenance(),
        workload.__dict__,
        workload.decode_context(str(engine.setting("decode_context", "mean"))),
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


def _progress(log: Callable[[str], None], total: int, t_start: float) -> Callable[[str], None]:
    done = [0]

    def progress(msg: str) -> None:
        done[0] += 1
        if done[0] % 10 == 0 or done[0] == total:
            log(f"[profile {done[0]}/{total}] ~{(time.time() - t_start) / done[0] * (total - done[0]):.0f} s left")

    return progress


def _run_row(s: ArchSpec, m: Measurement, **extra: Any) -> dict[str, Any]:
    return {
        "name": s.name,
        **extra,
        "prefill_ms": m.prefill_ms,
        "decode_ms": m.decode_ms,
        "memory": m.memory,
        "raw": m.raw,
        "spread": m.spread,
        "wall_s": round(m.wall_s, 3),
    }


def _hybrid_fit(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    options: list[Any],
    ffn_points: int,
    log: Callable[[str], None],
) -> tuple[
    list[ArchSpec], list[Measurement], list[dict[str, Any]], dict[str, float], list[dict[str, Any]], dict[str, Any]
]:
    """Profiling models = the parent + ``N`` balanced random children; costs by least squares."""
    from autocompress_nemo.profile.hybrid_fit import balanced_choices, feature_matrix, fit_costs
    from autocompress_nemo.search.space import apply_choices, build_space

    decisions = build_space(parent, engine.capabilities, ffn_points)
    columns = list(options)
    n_unknowns = len(columns) + 1
    n = int(engine.setting("profile_models", 0)) or int(
        round(float(engine.setting("profile_models_per_unknown", 3)) * n_unknowns)
    )
    seed = int(engine.setting("profile_seed", 1))
    specs, seen = [parent.replace(name="parent")], {spec_hash(parent)}
    for i, ch in enumerate(balanced_choices([len(d.options) for d in decisions], n, seed)):
        s = apply_choices(parent, decisions, ch).replace(name=f"fit{i}")
        if spec_hash(s) not in seen and not engine.check_servable(s, parent):
            seen.add(spec_hash(s))
            specs.append(s)
    counts = feature_matrix(specs, columns)
    unseen = [c for j, c in enumerate(columns) if not counts[:, j].any()]
    if unseen:
        raise ValueError(f"profiling design never uses {unseen}: raise engine.settings.profile_models")
    log(
        f"[profile] hybrid fit: {len(specs)} profiling models (parent + {len(specs) - 1} balanced children of the "
        f"search space) for {n_unknowns} unknowns; engine {engine.name} ({engine.version()}), workload {workload}"
    )
    t0 = time.time()
    results = engine.measure_many(
        specs, workload, log=_progress(log, len(specs) * int(engine.setting("rounds", 2)), t0)
    )
    fits = {p: fit_costs(counts, np.array([getattr(m, p) for m in results])) for p in PHASES}
    intercept = {p: fits[p].intercept for p in PHASES}
    blocks = [
        {
            "block": c.__dict__,
            **{p: float(fits[p].costs[j]) for p in PHASES},
            "source": "fit",
            "appearances": int(counts[:, j].sum()),
        }
        for j, c in enumerate(columns)
    ]
    runs = [
        _run_row(
            s,
            m,
            k=0,
            block=None,
            blocks=[b.__dict__ for b in s.blocks],
            spec_hash=spec_hash(s),
            **{f"fit_{p}": float(fits[p].fitted[i]) for p in PHASES},
            **{f"loo_err_{p}_pct": float(fits[p].loo_pct[i]) for p in PHASES},
        )
        for i, (s, m) in enumerate(zip(specs, results, strict=True))
    ]
    fit_prov = {
        "models": len(specs),
        "unknowns": n_unknowns,
        **{p: {**fits[p].summary(), "rank": fits[p].rank, "cond": fits[p].cond} for p in PHASES},
        "note": "relative residuals of the weighted NNLS fit (in-sample) and leave-one-out",
    }
    log(
        "[profile] fit residuals: "
        + "; ".join(
            f"{p}: rms {fits[p].summary()['rms_pct']:.2f}%, leave-one-out rms {fits[p].summary()['loo_rms_pct']:.2f}% "
            f"max {fits[p].summary()['loo_max_pct']:.2f}%"
            for p in PHASES
        )
        + f" (rank {fits['decode_ms'].rank} of "
        f"{n_unknowns}, cond {fits['decode_ms'].cond:.0f})"
    )
    return specs, results, blocks, intercept, runs, {"fit": fit_prov, "settings": {"models": len(specs), "seed": seed}}


def _hybrid_differences(
    engine: Engine, parent: ArchSpec, workload: Workload, options: list[Any], log: Callable[[str], None]
) -> tuple[
    list[ArchSpec], list[Measurement], list[dict[str, Any]], dict[str, float], list[dict[str, Any]], dict[str, Any]
]:
    """One difference of two models per option.

    Profiling model of option ``X``: the parent's blocks with ``k`` copies of ``X`` spread among
    them (``spread_copies``; ``k = engine.settings.profile_copies``, default 3); base = the parent
    (``k = 0``). The cost of one ``X`` is the slope ``(T(parent + k X) - T(parent)) / k`` per phase.
    Spread, not appended: a block run back to back with copies of itself is measurably cheaper on
    a CPU (hot code paths and caches) than the same block between blocks of other kinds, as it
    runs in the models being predicted.

    MoE blocks are two additive parts (``table.moe_parts``). The routed part ``R`` is profiled as a
    MoE block without shared expert; a shared width ``S`` as the parent's routed part with shared
    width ``S``, its cost being ``c(R_p + S) - c(R_p)`` — so a block's norm / residual overhead is
    counted once, in the routed part. (A block with no routed experts left is then priced without
    that overhead: a small underestimate.) Intercept = ``T(parent) - sum of the parent's block
    costs`` (embedding, final norm, LM head, framework overhead); no per-layer overhead term.
    """
    import dataclasses

    from autocompress_nemo.arch.spec import MoeBlock
    from autocompress_nemo.costs.table import moe_parts

    k = int(engine.setting("profile_copies", 3))
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
        specs, workload, log=_progress(log, len(specs) * int(engine.setting("rounds", 2)), time.time())
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
        return sum(costs[q][p] for q in moe_parts(b) if not q.removed) if isinstance(b, MoeBlock) else costs[b][p]

    intercept = {p: getattr(base, p) - sum(parent_block_cost(b, p) for b in parent.blocks) for p in PHASES}
    runs = [
        _run_row(s, m, k=0 if i == 0 else k, block=None if i == 0 else jobs[i - 1][1].__dict__, spec_hash=spec_hash(s))
        for i, (s, m) in enumerate(zip(specs, results, strict=True))
    ]
    return specs, results, blocks, intercept, runs, {"settings": {"copies": k}}

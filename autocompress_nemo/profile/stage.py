"""The profile and validate stages, as plain functions of the composed config.

- ``run_profile(cfg, out_dir) -> Path``: build (or reuse) the cost table of ``cfg.target``
  for the parent ``cfg.model``; returns the path of ``cost_table.json`` inside the artifact
  directory ``<out_dir>/cost_table`` (with a manifest; reused when complete for the same
  config hash and provenance).
- ``run_validate(cfg, table_path, out_dir) -> dict``: measure candidate models end to end in
  the engine, compare with the table's predictions, write ``validation.{csv,json,png}`` into
  the artifact ``<out_dir>/validation`` and return the summary (per-metric errors over the models
  the table was not built from; a candidate that is a profiling model — a hybrid's parent — is
  the *reference*: excluded, and its time now vs at profiling gives ``drift_scale`` and
  ``errors_drift_corrected``, the error with the machine's speed change taken out).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.config.engine import settings_of
from autocompress_nemo.config.resolve import search_capabilities
from autocompress_nemo.costs.engines import get_engine
from autocompress_nemo.costs.engines.base import Workload
from autocompress_nemo.costs.predictor import Predictor
from autocompress_nemo.costs.profile import build_table
from autocompress_nemo.costs.profile.provenance import Progress, planned_runs
from autocompress_nemo.costs.table import CostTable, expected_settings, make_provenance
from autocompress_nemo.profile import validate as val
from autocompress_nemo.stages.layout import TABLE_DIR, TABLE_FILE, VALIDATION_DIR
from autocompress_nemo.utils.artifacts import artifact, hash_obj, is_complete


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def parent_spec(cfg: Any) -> ArchSpec:
    return spec_from_model_config(cfg.model)


def profile_config_hash(cfg: Any) -> str:
    """What the table depends on: engine, hardware, workload, the parent's shape and the option grid
    (the search's capabilities under the run's layout and ``search.ffn_options``)."""
    t = cfg.target
    return hash_obj(
        {
            "engine": _plain(t.engine),
            "hardware": _plain(t.hardware),
            "workload": _plain(t.workload),
            "parent": parent_spec(cfg).to_dict(),
            "ffn_options": int(cfg.search.ffn_options),
            "expert_align": search_capabilities(cfg).expert_align,
        }
    )


def expected_provenance(cfg: Any) -> dict[str, Any]:
    """The provenance a table must carry to be valid for ``cfg.target`` (without running anything)."""
    eng = get_engine(cfg.target)
    wl = Workload.from_config(cfg.target.workload)
    prov = make_provenance(
        eng.provenance(),
        wl.__dict__,
        eng.decode_context(wl),
        expected_settings(cfg.target.engine),
        parent_spec(cfg),
    )
    if cfg.target.engine.version:
        want = str(cfg.target.engine.version)
        if want not in prov["engine_version"]:
            raise ValueError(
                f"target.engine.version={want!r} but the installed engine is {prov['engine_version']!r}; "
                "install that version or clear target.engine.version"
            )
    return {k: v for k, v in prov.items() if k not in ("date", "label", "parent_name")}


def load_table(cfg: Any, table_path: str | Path) -> CostTable:
    """Load a table and refuse it (ProvenanceMismatch, naming the fields) if it was built for another target."""
    return CostTable.load(table_path, expected=expected_provenance(cfg))


PROFILE_CACHE_ENV = "ACN_PROFILE_CACHE"
"""Where shared profiles live when ``cache_dir`` is not set (a directory), or ``off`` to never share."""


def profile_cache_key(cfg: Any, provenance: dict[str, Any] | None = None) -> str:
    """The declared inputs of a profile: the target's engine (name, dtype, settings, threads...),
    hardware and workload, the parent's shape, the option grid (``profile_config_hash``), and what the
    table must match when loaded (``expected_provenance``: the installed engine's version, the device
    it reports, the decode context). Any change gives another key, hence a new profile."""
    prov = expected_provenance(cfg) if provenance is None else provenance
    return hash_obj({"config": profile_config_hash(cfg), "provenance": prov})


def shared_profiles_dir(cfg: Any) -> Path | None:
    """The cache of profiles shared by run directories: ``<cache_dir>/profiles`` when ``cache_dir`` is
    set, else ``$ACN_PROFILE_CACHE``, else ``$XDG_CACHE_HOME/autocompress-nemo/profiles`` (default
    ``~/.cache``); None when ``ACN_PROFILE_CACHE=off``."""
    import os

    env = os.environ.get(PROFILE_CACHE_ENV, "")
    if env.lower() in ("off", "0", "none", "false"):
        return None
    given = str(OmegaConf.select(cfg, "cache_dir", default="") or "")
    if given:
        return Path(given).expanduser() / "profiles"
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "autocompress-nemo" / "profiles"


def _usable(cfg: Any, d: Path, h: str) -> bool:
    if not is_complete(d, h):
        return False
    try:
        load_table(cfg, d / TABLE_FILE)
        return True
    except ValueError as e:
        print(f"[profile] not reusing {d}: {e}", file=sys.stderr)
        return False


def _copy_table(src: Path, dest: Path, h: str, stage: str, **extra: Any) -> None:
    import shutil

    with artifact(dest, stage=stage, config_hash=h, extra=extra or None) as tmp:
        shutil.copyfile(src / TABLE_FILE, tmp / TABLE_FILE)


def run_profile(cfg: Any, out_dir: str | Path) -> Path:
    """Build or reuse the cost table; returns the path of ``cost_table.json``.

    Reused, in order: this run directory's complete table; a shared profile with the same declared
    inputs (``profile_cache_key``, under ``shared_profiles_dir``), copied in; else profiled here and
    then published to the shared cache for the next run directory."""
    out = Path(out_dir) / TABLE_DIR
    h = profile_config_hash(cfg)
    if is_complete(out, h):
        try:
            load_table(cfg, out / TABLE_FILE)
            print(f"[profile] reusing {out / TABLE_FILE} (complete, provenance matches)", file=sys.stderr)
            return out / TABLE_FILE
        except ValueError as e:
            print(f"[profile] rebuilding: {e}", file=sys.stderr)
    shared_root = shared_profiles_dir(cfg)
    shared = None
    if shared_root is not None:
        prov = expected_provenance(cfg)
        if not prov.get("estimated"):  # an analytic table costs nothing to rebuild: never shared
            shared = shared_root / profile_cache_key(cfg, prov)
    if shared is not None and _usable(cfg, shared, h):
        _copy_table(shared, out, h, "profile", reused_from=str(shared))
        print(
            f"[profile] reusing the shared profile {shared / TABLE_FILE} (same engine, device, workload, parent, "
            "dtype and profiling settings; any change re-profiles)",
            file=sys.stderr,
        )
        return out / TABLE_FILE
    parent = parent_spec(cfg)
    wl = Workload.from_config(cfg.target.workload)
    with artifact(out, stage="profile", config_hash=h, inputs={"parent": parent.to_json(None)}) as tmp:
        engine = get_engine(cfg.target, workdir=tmp / "work")
        table = build_table(engine, parent, wl, ffn_points=int(cfg.search.ffn_options), caps=search_capabilities(cfg))
        table.provenance["target"] = str(cfg.target.name)
        table.save(tmp / TABLE_FILE)
        _rmtree(tmp / "work")
    if shared is not None:
        try:
            _copy_table(out, shared, h, "profile", profiled_in=str(out))
            print(f"[profile] shared as {shared} for other run directories", file=sys.stderr)
        except OSError as e:  # a read-only or full cache never fails the run
            print(f"[profile] could not share the profile in {shared}: {e}", file=sys.stderr)
    print(
        f"[profile] wrote {out / TABLE_FILE}: {table.provenance['engine_runs']} engine runs in "
        f"{table.provenance['profile_wall_s']:.0f} s ({table.label})",
        file=sys.stderr,
    )
    return out / TABLE_FILE


def run_validate(
    cfg: Any,
    table_path: str | Path,
    out_dir: str | Path,
    *,
    n_random: int | None = None,
    seed: int | None = None,
    specs: list[ArchSpec] | None = None,
) -> dict[str, Any]:
    """Measure candidate models end to end and report predicted vs measured; returns the summary.
    ``specs``: these models instead of the candidates drawn for the target (e.g. one list validated
    against two engines' tables); the parent among them (named ``parent``) is the reference."""
    table = load_table(cfg, table_path)
    pred = Predictor(table, cfg.target)
    parent = parent_spec(cfg)
    wl = Workload.from_config(cfg.target.workload)
    n_rand = int(n_random if n_random is not None else settings_of(cfg.target.engine.settings).validate_random)
    if specs is None:
        specs = val.candidates(
            parent,
            search_capabilities(cfg),
            n_rand,
            int(seed if seed is not None else cfg.seed),
            int(cfg.search.ffn_options),
        )
    out = Path(out_dir) / VALIDATION_DIR
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    with artifact(out, stage="validate", config_hash=hash_obj([str(table_path), n_rand, len(specs)])) as tmp:
        engine = get_engine(cfg.target, workdir=tmp / "work")
        reference = parent.replace(name="parent")
        progress = Progress(
            lambda line: print(line, file=sys.stderr, flush=True),
            planned_runs(engine, specs, reference),
            t0,
            label="validate",
            detail=True,
        )

        # every model timed next to the parent; its ratio expressed in the table's parent times
        measured = engine.measure_many(specs, wl, log=progress, reference=reference, scale=table.reference_times())
        for spec, m in zip(specs, measured, strict=True):
            rows.append(_validation_row(spec, m, pred.predict(spec), table, wl.output_len))
        ref = next(
            (r for r in rows if r["reference"] and "table_decode_ms" in r),
            next((r for r in rows if r["reference"]), None),
        )
        drift = val.drift_scale(ref, wl.output_len)
        summary = {
            "target": str(cfg.target.name),
            "engine": table.provenance["engine"],
            "label": table.label,
            "estimated": table.estimated,
            "models": sum(not r["reference"] for r in rows),
            "reference": ref["name"] if ref else None,
            "engine_runs": getattr(engine, "runs", 0),
            "errors": val.errors(rows),
            **_reference_summary(measured, rows),
            "wall_s": round(time.time() - t0, 1),
            "table": str(table_path),
        }
        if drift:  # the same errors with the machine's speed change since profiling taken out
            summary["drift_scale"] = drift
            summary["errors_drift_corrected"] = val.errors(rows, drift)
        _rmtree(tmp / "work")
        val.write_report(rows, summary, tmp)
    summary["files"] = {k: str(out / f"validation.{k}") for k in ("csv", "json", "png")}
    return summary


def _validation_row(spec: ArchSpec, m: Any, p: dict[str, Any], table: Any, output_len: int) -> dict[str, Any]:
    """One model of the validation: measured ``m`` against predicted ``p``, each metric's error, the
    memory by part and, when timed as a ratio to the parent, its absolute times and spread."""
    meas = _latencies(m.prefill_ms, m.decode_ms, m.memory_bytes, output_len)
    row: dict[str, Any] = {
        "name": spec.name,
        "pattern": spec.pattern,
        "layers": spec.num_layers,
        "reference": val.is_reference(spec, table),
    }
    then = val.profiled_time(spec, table) if row["reference"] else None
    row.update({f"table_{k}": v for k, v in (then or {}).items()})  # measured at profiling
    for k in val.METRICS:
        row[f"pred_{k}"], row[f"meas_{k}"] = float(p[k]), float(meas[k])
        row[f"err_{k}_pct"] = 100.0 * (p[k] - meas[k]) / meas[k] if meas[k] else float("nan")
    for part, v in m.memory.items():
        row[f"meas_mem_{part}"], row[f"pred_mem_{part}"] = v, p["memory"].get(part, 0.0)
    if m.ratio:  # the old method: the model's own absolute time, next to the ratio
        ab = _latencies(m.absolute["prefill_ms"], m.absolute["decode_ms"], m.memory_bytes, output_len)
        row.update({f"abs_{k}": float(v) for k, v in ab.items()})
        row.update({f"ratio_{k}": v for k, v in m.ratio.items()})
        row.update({f"ratio_rel_iqr_{k}": v["rel_iqr"] for k, v in m.ratio_spread.items()})
        row["flags"] = m.flags
    row["spec"] = spec.to_dict()
    row["spread"] = m.spread
    print(
        f"    {spec.name}: decode {meas['decode_ms']:.3f} ms (pred {p['decode_ms']:.3f}, {row['err_decode_ms_pct']:+.2f}%), "
        f"prefill {meas['prefill_ms']:.1f} ms ({row['err_prefill_ms_pct']:+.2f}%), memory "
        f"{row['err_memory_bytes_pct']:+.3f}%",
        file=sys.stderr,
        flush=True,
    )
    return row


def _latencies(prefill: float, decode: float, memory: float, output_len: int) -> dict[str, float]:
    return {
        "prefill_ms": prefill,
        "decode_ms": decode,
        "response_latency_ms": prefill + output_len * decode,
        "memory_bytes": memory,
    }


def _reference_summary(measured: list[Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How the timing was referenced: the reference's times and variation, the load average, the
    flagged measurements, and the errors the old method (absolute times) would have shown."""
    from autocompress_nemo.costs.engines.paired import all_flags

    ref = next((m.reference for m in measured if m.reference), None)
    if not ref:
        return {"timing": "absolute (no reference timed)"}
    for f in all_flags(measured):
        print(f"[validate] flagged: {f}", file=sys.stderr, flush=True)
    return {
        "timing": "ratio to the parent timed in the same rounds x the parent's time in the cost table",
        "reference": {k: v for k, v in ref.items() if k != "flags"},
        "flags": all_flags(measured),
        "errors_absolute": val.errors(rows, measured="abs"),
    }


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)

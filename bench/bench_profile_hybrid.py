"""Profile a hybrid (Mamba / attention / MoE) target from scratch and validate its table; prints JSON.

    python bench/bench_profile_hybrid.py [--compare] [+target=small_hybrid_cpu model=small_hybrid] [overrides]

``--compare``: build the table both ways (``profile_method=differences``, then ``fit``) and validate
both back to back on the same candidates.

Engine: PyTorch eager (transformers' NemotronH) on this CPU — llama.cpp cannot serve per-block
hybrids (conf/engine/torch_eager_cpu.yaml). Prints: table wall time, engine runs, validation
models (none of them used to build the table; the parent, the table's base model, is timed again
as the reference), and decode / prefill / response / memory mean and max absolute % errors —
raw, and with the machine's speed change between profiling and validation taken out
(``drift_scale``: the reference's time now / at profiling) — plus the load before and after.
Goals (issue 6 item 4): decode mean <= 5 %, max <= 15 %.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from autocompress_nemo.config.entry import compose
from autocompress_nemo.profile.stage import run_profile, run_validate

DEFAULT = ["+target=small_hybrid_cpu", "model=small_hybrid"]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _errs(e: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m, short in (
        ("decode_ms", "decode"),
        ("prefill_ms", "prefill"),
        ("response_latency_ms", "response"),
        ("memory_bytes", "memory"),
    ):
        out[f"{short}_mean_pct"] = round(e[m]["mape"], 3 if short == "memory" else 2)
        out[f"{short}_max_pct"] = round(e[m]["max_ape"], 3 if short == "memory" else 2)
    return out


def _one(cfg, out: Path, summary: dict, t_table: float, table_path: Path) -> dict:
    t = json.loads(table_path.read_text())
    prov = t["provenance"]
    return {
        "method": prov["profile"].get("method"),
        "table_wall_s": round(t_table, 1),
        "profile_models": prov["profile_models"],
        "profile_engine_runs": prov["engine_runs"],
        "fit_residuals": {p: {k: round(v, 2) for k, v in prov["fit"][p].items()} for p in ("decode_ms", "prefill_ms")}
        if "fit" in prov
        else None,
        "intercept": {k: round(v, 3) for k, v in t["intercept"].items()},
        "validation_models": summary["models"],
        "validation_reference": summary.get("reference"),
        "validation_engine_runs": summary["engine_runs"],
        "validation_wall_s": summary["wall_s"],
        "errors": _errs(summary["errors"]),
        "drift_scale": {k: round(v, 4) for k, v in summary.get("drift_scale", {}).items()},
        "errors_drift_corrected": _errs(summary["errors_drift_corrected"])
        if "errors_drift_corrected" in summary
        else None,
        "out_dir": str(out),
    }


def main(argv: list[str]) -> dict:
    """``--compare``: profile with ``differences`` (before) then ``fit`` (after), then validate both
    tables back to back (same candidates, same machine state as far as a shared machine allows)."""
    compare = "--compare" in argv
    argv = [a for a in argv if a != "--compare"] or DEFAULT
    methods = ["differences", "fit"] if compare else [None]
    load_before = loadavg()
    tables = []
    for m in methods:
        cfg = compose(argv + ([f"target.engine.settings.profile_method={m}"] if m else []))
        out = Path(tempfile.mkdtemp(prefix="acn-bench-profile-hybrid-"))
        t0 = time.time()
        tables.append((cfg, out, run_profile(cfg, out), time.time() - t0))
    load_mid = loadavg()
    runs = []
    for cfg, out, table_path, t_table in tables:
        runs.append(_one(cfg, out, run_validate(cfg, table_path, out), t_table, table_path))
    prov = json.loads(tables[0][2].read_text())["provenance"]
    result = {
        "target": str(tables[0][0].target.name),
        "model": str(tables[0][0].model.name),
        "engine": prov["engine_version"],
        "measured_in": "PyTorch eager (transformers) on this CPU, 1 thread, thread CPU time",
        "threads": prov["threads"],
        "label": prov["label"],
        "runs": runs,
        "goals_pct": {"decode_mean": 5.0, "decode_max": 15.0},
        "loadavg_before": load_before,
        "loadavg_after_profiling": load_mid,
        "loadavg_after": loadavg(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

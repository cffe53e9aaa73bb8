"""Profile a hybrid (Mamba / attention / MoE) model's cost table in llama.cpp and in the PyTorch-eager
fallback, validate both on the same held-out models; prints JSON.

    python bench/bench_profile_hybrid.py [--engines llama_cpp,torch_eager] [model=small_hybrid] [overrides]

llama.cpp: ``+target=small_hybrid_cpu`` (``nemotron_h_moe`` GGUF, one thread). The eager fallback
(transformers' NemotronH): ``+target=small_hybrid_eager_cpu`` run at the llama.cpp target's workload,
with attention removal allowed (the candidates keep one attention block, which it needs). The
held-out models are drawn once from the llama.cpp search space (``profile/validate.candidates``):
the parent (each table's reference, left out of the errors), the smallest child, a middle one and
random children; none of them profiled. Per engine: table wall time, engine runs, decode / prefill /
response / memory mean and max absolute % errors — raw, and with the machine's speed change between
profiling and validation taken out (``drift_scale``) — plus the load before and after.
Goals (issue 15): llama.cpp decode mean <= 3 %, memory <= 1 %.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.resolve import search_capabilities
from autocompress_nemo.profile import validate as val
from autocompress_nemo.profile.stage import parent_spec, run_profile, run_validate

TARGETS = {"llama_cpp": "small_hybrid_cpu", "torch_eager": "small_hybrid_eager_cpu"}
MEASURED_IN = {
    "llama_cpp": "llama.cpp (llama-cpp-python) on this CPU, 1 thread, thread CPU time",
    "torch_eager": "PyTorch eager (transformers NemotronH) on this CPU, 1 thread, thread CPU time",
}


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


def _config(engine: str, overrides: list[str], workload: dict | None) -> object:
    over = [f"+target={TARGETS[engine]}", "model=small_hybrid", *overrides]
    if workload is not None:  # the fallback at the llama.cpp target's workload, attention removal allowed
        over += [f"target.workload.{k}={v}" for k, v in workload.items()]
        over += ["target.engine.capabilities.remove_attention=true"]
    return compose(over)


def main(argv: list[str]) -> dict:
    engines = ["llama_cpp", "torch_eager"]
    if "--engines" in argv:
        i = argv.index("--engines")
        engines = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2 :]
    unknown = sorted(set(engines) - set(TARGETS))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; known: {sorted(TARGETS)}")
    load_before = loadavg()
    base = _config("llama_cpp", argv, None)
    wl = {k: int(base.target.workload[k]) for k in ("batch", "input_len", "output_len", "context_len")}
    parent = parent_spec(base)
    specs = val.candidates(
        parent,
        search_capabilities(base),
        int(base.target.engine.settings.validate_random),
        int(base.seed),
        int(base.search.ffn_options),
    )
    tables = []
    for e in engines:
        cfg = base if e == "llama_cpp" else _config(e, argv, wl)
        out = Path(tempfile.mkdtemp(prefix=f"acn-bench-profile-hybrid-{e}-"))
        t0 = time.time()
        tables.append((e, cfg, out, run_profile(cfg, out), time.time() - t0))
    load_mid = loadavg()
    runs = {}
    for e, cfg, out, table_path, t_table in tables:
        summary = run_validate(cfg, table_path, out, specs=specs)
        prov = json.loads(table_path.read_text())["provenance"]
        runs[e] = {
            "target": str(cfg.target.name),
            "measured_in": MEASURED_IN[e],
            "engine": prov["engine_version"],
            **_one(cfg, out, summary, t_table, table_path),
        }
    result = {
        "model": str(base.model.name),
        "workload": wl,
        "held_out_models": [{"name": s.name, "pattern": s.pattern} for s in specs],
        "runs": runs,
        "goals_pct": {"llama_cpp_decode_mean": 3.0, "llama_cpp_memory_mean": 1.0},
        "loadavg_before": load_before,
        "loadavg_after_profiling": load_mid,
        "loadavg_after": loadavg(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

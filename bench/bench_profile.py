"""Profile one target from scratch and validate its cost table; prints JSON.

    python bench/bench_profile.py [+target=cpu_chat] [other overrides]

Prints: wall time to build the table, number of engine runs (profiling and validation),
validation errors (mean absolute % error of decode, prefill, response latency and memory over
the validation models, none of them used to build the table) and the machine load
(``/proc/loadavg``) before and after, since timing accuracy on a shared machine depends on it.
Goals (issue 3): table under 10 min on 2 cores; decode within 3 %, prefill within 5 %,
memory within 1 % of what llama.cpp reports.
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


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main(argv: list[str]) -> dict:
    overrides = argv or ["+target=cpu_chat"]
    cfg = compose(overrides)
    out = Path(tempfile.mkdtemp(prefix="acn-bench-profile-"))
    load_before = loadavg()
    t0 = time.time()
    table_path = run_profile(cfg, out)
    t_table = time.time() - t0
    prov = json.loads(table_path.read_text())["provenance"]
    t1 = time.time()
    summary = run_validate(cfg, table_path, out)
    t_val = time.time() - t1
    errs = summary["errors"]
    result = {
        "target": str(cfg.target.name),
        "engine": prov["engine_version"],
        "threads": prov["threads"],
        "label": summary["label"],
        "table_wall_s": round(t_table, 1),
        "table_goal_s": 600,
        "profile_engine_runs": prov["engine_runs"],
        "profile_models": prov["profile_models"],
        "validation_models": summary["models"],
        "validation_engine_runs": summary["engine_runs"],
        "validation_wall_s": round(t_val, 1),
        "decode_mape_pct": round(errs["decode_ms"]["mape"], 2),
        "prefill_mape_pct": round(errs["prefill_ms"]["mape"], 2),
        "response_latency_mape_pct": round(errs["response_latency_ms"]["mape"], 2),
        "memory_mape_pct": round(errs["memory_bytes"]["mape"], 3),
        "decode_max_ape_pct": round(errs["decode_ms"]["max_ape"], 2),
        "prefill_max_ape_pct": round(errs["prefill_ms"]["max_ape"], 2),
        "goals_pct": {"decode": 3.0, "prefill": 5.0, "memory": 1.0},
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "cpu_count": os.cpu_count(),
        "out_dir": str(out),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

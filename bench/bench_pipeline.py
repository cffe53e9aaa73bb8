"""Where a pipeline run's time goes: every stage's seconds, share of the job, peak resident memory,
and for the stages that count their arithmetic (rank, reconstruct, distill: ``utils/work.py``) the
fraction of their FLOP bound, the bound being the FLOPs at this machine's float32 matmul rate measured
in the same run (before and after the pipeline, the best of both, on the parent's own ``[rows, h] x
[h, ffn]`` shape, as ``bench_distill.py`` does). Prints one JSON object.

    python bench/bench_pipeline.py [--run-dir DIR] [--record-only] [--commit SHA] [OVERRIDE ...]

Runs ``python -m autocompress_nemo.search OVERRIDE... run_dir=DIR`` (the default job with no
override) and reads its ``record.json`` (the runner's record: seconds, ``peak_rss_gb``, ``flops`` per
stage). ``--record-only``: read ``DIR``'s record without running. ``--commit SHA``: the same run on an
older commit too (a ``git worktree``), the two back to back on this machine, each stage's seconds as a
ratio new/old; a commit from before the record existed is read from its ``[stage] done in X s``
lines. Also reported: the run directory's bytes against the bytes of the models it holds (the sorted
parent and each stage's student weights; the token cache apart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DONE = re.compile(r"^\[(?P<stage>[\w@.]+)\] done in (?P<s>[0-9.]+) s")


def matmul_gflops(run_dir: Path, rows: int = 2048) -> float | None:
    """Best float32 GFLOP/s of ``[rows, h] x [h, ffn]`` on the parent's shape (``rank/spec.json``)."""
    from autocompress_nemo.arch.spec import ArchSpec
    from autocompress_nemo.utils.machine import ffn_matmul_flops_per_s

    spec_file = run_dir / "rank" / "spec.json"
    if not spec_file.is_file():
        return None
    return ffn_matmul_flops_per_s(ArchSpec.from_json(spec_file.read_text()), rows) / 1e9


def run_job(python: str, cwd: Path, overrides: list[str], run_dir: Path) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "autocompress_nemo.search", *overrides, f"run_dir={run_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(cwd)),
    )
    wall = time.perf_counter() - t
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{run_dir.name}.out").write_text(proc.stdout + proc.stderr)  # what the run printed
    if proc.returncode != 0:
        raise SystemExit(f"the pipeline failed (exit {proc.returncode}) in {cwd}:\n{proc.stderr[-4000:]}")
    return wall, proc.stdout + proc.stderr


def stage_rows(run_dir: Path, output: str = "") -> list[dict[str, Any]]:
    """The record's rows of the stages that ran (or, for a commit without a record, the log's)."""
    rec = run_dir / "record.json"
    if rec.is_file():
        return [r for r in json.loads(rec.read_text())["stages"] if r.get("status") == "ran"]
    return [{"stage": m["stage"], "seconds": float(m["s"])} for ln in output.splitlines() if (m := DONE.match(ln))]


def disk(run_dir: Path) -> dict[str, Any]:
    files = [p for p in run_dir.rglob("*") if p.is_file() and ".cache" not in p.relative_to(run_dir).parts]
    models = [p for p in run_dir.glob("*/model.safetensors") if not p.parent.name.startswith("export")]
    total, held = sum(p.stat().st_size for p in files), sum(p.stat().st_size for p in models)
    return {"run_dir_bytes": total, "models_bytes": held, "ratio": round(total / held, 2) if held else None}


def summarize(rows: list[dict[str, Any]], gflops: float | None, wall: float | None) -> dict[str, Any]:
    total = sum(float(r["seconds"]) for r in rows)
    out = []
    for r in rows:
        s = float(r["seconds"])
        row: dict[str, Any] = {
            "stage": r["stage"],
            "seconds": round(s, 1),
            "share": round(s / total, 3) if total else None,
        }
        for k in ("peak_rss_gb", "child_peak_rss_gb"):
            if k in r:
                row[k] = r[k]
        if r.get("flops") and gflops:
            bound = float(r["flops"]) / (gflops * 1e9)
            row.update(tflop=round(float(r["flops"]) / 1e12, 3), bound_s=round(bound, 1))
            row["fraction_of_bound"] = round(bound / s, 3) if s > 0 else None
        out.append(row)
    peaks = [r[k] for r in rows for k in ("peak_rss_gb", "child_peak_rss_gb") if k in r]
    return {
        "stages": out,
        "stages_s": round(total, 1),
        "job_wall_s": round(wall, 1) if wall is not None else None,
        "peak_rss_gb": max(peaks) if peaks else None,
    }


def measure(python: str, cwd: Path, overrides: list[str], run_dir: Path, record_only: bool) -> dict[str, Any]:
    wall, output = (None, "") if record_only else run_job(python, cwd, overrides, run_dir)
    rates = [g for _ in range(3) if (g := matmul_gflops(run_dir))]  # the best of three: load only slows it
    gflops = max(rates) if rates else None
    res = summarize(stage_rows(run_dir, output), gflops, wall)
    res.update(matmul_gflops=round(gflops, 1) if gflops else None, disk=disk(run_dir), run_dir=str(run_dir))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--record-only", action="store_true")
    ap.add_argument("--commit", default=None, help="an older commit measured back to back with this checkout")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.record_only and a.run_dir is None:
        raise SystemExit("--record-only reads an existing run: give --run-dir")
    base = a.run_dir or Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    result: dict[str, Any] = {
        "bench": "pipeline",
        "machine": f"{platform.machine()} {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
        "overrides": a.overrides,
        "measured": "wall seconds of each stage on this machine (record.json); bounds at the matmul rate measured here",
    }
    new_dir = base if a.run_dir and a.record_only else base / "new"
    result["new"] = measure(sys.executable, ROOT, a.overrides, new_dir, a.record_only)
    if a.commit:
        tree = Path(tempfile.mkdtemp(prefix="bench_pipeline_old_")) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.commit], check=True)
        try:
            result["old"] = measure(sys.executable, tree, a.overrides, base / "old", False)
            result["old"]["commit"] = a.commit
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        old = {r["stage"]: r["seconds"] for r in result["old"]["stages"]}
        result["ratio_new_over_old"] = {
            r["stage"]: round(r["seconds"] / old[r["stage"]], 3) for r in result["new"]["stages"] if old.get(r["stage"])
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

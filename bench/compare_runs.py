"""Compare two run directories of the same command (e.g. before / after a refactor): the chosen
architectures, search trajectories, evaluations and cost tables as JSON (wall-clock times, dates and
paths left out), and every weight file tensor by tensor. Prints one JSON object; exit status 0 when
everything compared is identical, 1 otherwise.

    python bench/compare_runs.py RUN_DIR_A RUN_DIR_B [--ignore KEY,KEY]

``--ignore`` leaves more JSON keys out (e.g. ``provenance`` when the cost tables' settings record
gained fields between the two builds).

Deterministic comparisons need a deterministic engine: use the analytic roofline engine
(``engine@target.engine=roofline``); a measured engine's timings differ run to run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOLATILE = {"wall_s", "search_wall_s", "profile_wall_s", "date", "step_s", "tokens_per_s", "checkpoint", "tensorboard"}
JSON_FILES = ("arch.json", "trajectory.json", "evaluation.json", "cost_table.json", "distill.json")


def _strip(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items() if k not in VOLATILE}
    if isinstance(o, list):
        return [_strip(v) for v in o]
    return o


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one run" for k in sorted(set(a) ^ set(b))]
        return out + [d for k in sorted(set(a) & set(b)) for d in _diff(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:60]} -> {str(b)[:60]}"]


def compare(a: Path, b: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for fa in sorted(a.rglob("*")):
        rel = fa.relative_to(a)
        fb = b / rel
        if ".tmp-" in str(rel) or ".ckpt" in str(rel) or not fb.is_file():
            continue
        if fa.name in JSON_FILES:
            d = _diff(_strip(json.loads(fa.read_text())), _strip(json.loads(fb.read_text())))
            out[str(rel)] = "identical" if not d else d[:10]
        elif fa.suffix == ".safetensors":
            x, y = load_file(fa), load_file(fb)
            same = x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            out[str(rel)] = f"identical ({len(x)} tensors)" if same else "different tensors"
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--ignore" in args:
        i = args.index("--ignore")
        VOLATILE.update(args[i + 1].split(","))
        del args[i : i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    res = compare(Path(args[0]), Path(args[1]))
    print(json.dumps(res, indent=1))
    sys.exit(0 if res and all(str(v).startswith("identical") for v in res.values()) else 1)

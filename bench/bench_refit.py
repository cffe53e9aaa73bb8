"""The student's start before recovery: plain slice, the parallel least-squares re-fit (every block
on the parent's inputs) and the sequential one (layer after layer on the student's own inputs),
side by side on a real model, optionally followed by the same recovery distillation (issue 36, item 3).

    python bench/bench_refit.py [--run runs/smol] [--children 768x6,512x3] [--arch path/arch.json]
        [--tokens 0] [key=value ...]

Students: uniform children of the run's sorted parent (``<run>/rank``; ``FFNxHEADS``: every MLP
``FFN`` wide, every attention block ``HEADS`` query heads in the parent's KV groups, as
``bench/bench_local.py`` builds them) and, with ``--arch``, the child of a search stage's
``arch.json``. For each start: KD to the parent on the search judge's calibration batches (what
extract reports), held-out perplexity on the run's held-out text, the re-fit's wall seconds, and,
with ``--tokens N``, held-out perplexity after N recovery tokens of the distill stage's schedule.
Prints one JSON object and writes it to ``<run>/bench_refit/<tag>.json``.

Figures: PyTorch float32 on this CPU (the project's Megatron model); seconds measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/smol", help="a run directory holding rank/ (the sorted parent)")
    ap.add_argument("--children", default="768x6,512x3", help="uniform children FFNxHEADS, comma separated")
    ap.add_argument("--arch", default="", help="also the child of this arch.json")
    ap.add_argument("--starts", default="slice,least_squares,sequential")
    ap.add_argument("--tokens", type=int, default=0, help="recovery tokens after each start (0: none)")
    ap.add_argument("--tag", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    from omegaconf import OmegaConf

    from autocompress_nemo.arch.spec import ArchSpec
    from autocompress_nemo.context import Context, load_weights
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.extract.slice import slice_state_dict
    from autocompress_nemo.stages.distill import train_batches
    from autocompress_nemo.stages.evaluate import heldout_perplexity
    from autocompress_nemo.stages.extract import refit, sliced_kd
    from autocompress_nemo.utils.artifacts import write_json_atomic
    from bench.bench_local import _child

    run = Path(a.run).resolve()
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides)) if a.overrides else cfg
    cfg.run_dir = str(run)
    ctx = Context(cfg, say=_say)
    ctx.init_distributed()
    pspec, psd = load_weights(run / "rank")
    children = []
    for c in [x for x in a.children.split(",") if x]:
        ffn, heads = (int(v) for v in c.split("x"))
        children.append((c, _child(pspec, ffn, heads)))
    if a.arch:
        children.append((Path(a.arch).parent.name, ArchSpec.from_dict(json.loads(Path(a.arch).read_text())["child"])))
    tag = a.tag or f"{a.children.replace(',', '_')}_t{a.tokens}"
    out = run / "bench_refit" / tag
    result: dict[str, Any] = {
        "bench": "refit_start",
        "run": str(run),
        "overrides": a.overrides,
        "measured": f"PyTorch float32 on CPU {platform.machine()}, torch threads {torch.get_num_threads()}; held-out "
        f"perplexity on {int(cfg.evaluate.heldout_batches)} batches of 2 x {int(cfg.evaluate.seq_len)} tokens; KD on the "
        f"search judge's batches; calibration {int(cfg.extract.refit_batches)} x 2 x {int(cfg.extract.refit_seq_len)} tokens",
        "parent": heldout_perplexity(ctx, pspec, psd, lm_eval=False)["heldout_ppl"],
        "children": {},
    }
    teacher = ctx.model(pspec, psd) if a.tokens else None
    for name, child in children:
        sliced = slice_state_dict(pspec, psd, child)
        rows: dict[str, Any] = {}
        for start in [s for s in a.starts.split(",") if s]:
            t0 = time.perf_counter()
            if start == "slice":
                sd, kd = sliced, sliced_kd(ctx, pspec, psd, child, sliced)
            else:
                c2 = OmegaConf.merge(cfg, {"extract": {"refit": start}})
                ctx2 = Context(c2, say=_say)
                ctx2._shared = ctx._shared
                rec: dict[str, Any] = {}
                sd = refit(ctx2, pspec, psd, child, sliced, rec)
                kd = rec["refit"]["refit_kd"]
            row: dict[str, Any] = {"kd": kd, "seconds": time.perf_counter() - t0}
            row["heldout_ppl"] = heldout_perplexity(ctx, child, sd, lm_eval=False)["heldout_ppl"]
            if a.tokens:
                student = ctx.model(child, sd)
                d = OmegaConf.merge(cfg.distill, {"tokens": a.tokens, "wandb_project": ""})
                distill(
                    student,
                    teacher,
                    ctx.forward,
                    train_batches(ctx, d),
                    d,
                    out / name / start,
                    int(cfg.seed),
                    log=_say,
                    name=f"{name}/{start}",
                )
                row["after_recovery_ppl"] = heldout_perplexity(ctx, child, ctx.to_hf(child, student), lm_eval=False)[
                    "heldout_ppl"
                ]
            rows[start] = row
            _say(f"[bench_refit] {name} {start}: {row}")
            result["children"][name] = rows
            write_json_atomic(out.with_suffix(".json"), result)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

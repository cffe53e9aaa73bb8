"""Quality versus recovery tokens: the AutoCompress and Minitron++ students of one run, distilled
at several token budgets, their held-out perplexity next to the parent's.

    python bench/bench_quality.py [--run runs/cpu_chat__smollm2_135m] [--tokens 32768,131072]
        [--methods autocompress,minitron_pp] [--tag default] [--budget 0.6x] [--start extract|slice]
        [distill.lr=3e-4 ...]

For each method and each budget: the run's extracted student (``extract_<method>``, sliced from
the sorted parent) is distilled from the run's sorted parent (``rank``) by the production code
(``distill.recover.distill`` on the distill stage's batches, ``stages.distill.train_batches``)
with ``distill.tokens`` set to the budget and its own full learning-rate schedule, then scored
on the run's held-out text (``stages.evaluate.heldout_perplexity``: PyTorch, the evaluate
stage's batches). Every budget is its own run (a cosine schedule cut short is not a recovery
at that budget); each resumes from its checkpoint under
``<run>/bench_quality/<tag>/<method>_<tokens>/``, so the bench continues where it stopped and a
finished point costs only its evaluation. Without overrides, a budget equal to the run's own
``distill.tokens`` is the run's ``distill_<method>`` student (same config, same batches), evaluated
and not distilled again. Overrides (``key=value``, OmegaConf dot-list) change
the run's config for this bench only (e.g. ``distill.lr=3e-4``); use a ``--tag`` per setting.

``--start slice`` starts every student from the plain slice of the sorted parent instead of the
extracted weights (``extract.refit`` re-fits them by least squares): the comparison of which
weights start the student (use its own ``--tag``).

``--budget B`` reads one budget of a family run (``search.budgets``): its stages
``extract_<method>@B`` / ``distill_<method>@B``, written to ``<run>/bench_quality/<tag>@B/``.

Prints one JSON object and writes it, with a PNG plot, to ``<run>/bench_quality/<tag>/``
(``quality.json``, ``quality.png``); the run's report embeds the ``default`` tag when present
(a family's ``report@B`` its ``default@B``).
Figures: held-out perplexity and KD measured in PyTorch (float32) on this machine; tokens/s of
the recovery measured here.
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


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _config(run: Path, overrides: list[str]) -> Any:
    from omegaconf import OmegaConf

    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise SystemExit(
            f"--run {run}: no {path}; point --run at a pipeline run directory (python -m autocompress_nemo.search)"
        )
    cfg = OmegaConf.load(path)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise SystemExit(f"overrides must be key=value (OmegaConf dot-list), got {bad}")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    cfg.run_dir = str(run)
    return cfg


def _student(run: Path, method: str, suffix: str, start: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The extracted student, or (``start="slice"``) its architecture sliced plainly from the sorted parent."""
    from autocompress_nemo.context import load_weights
    from autocompress_nemo.extract.slice import slice_state_dict

    cspec, csd = load_weights(run / f"extract_{method}{suffix}")
    if start == "slice":
        pspec, psd = load_weights(run / "rank")
        csd = slice_state_dict(pspec, psd, cspec)
    return cspec, csd


def _point(
    ctx: Any,
    run: Path,
    method: str,
    tokens: int,
    teacher: torch.nn.Module,
    out: Path,
    reuse: bool,
    suffix: str = "",
    start: str = "extract",
) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.stages.distill import train_batches
    from autocompress_nemo.stages.evaluate import heldout_perplexity

    cspec, csd = _student(run, method, suffix, start)
    t0 = time.perf_counter()
    done = _pipeline_point(run, method + suffix, tokens) if reuse else None
    if done is not None:  # the run's own distill stage at this budget: evaluated, not repeated
        res, sd = done
        ev = heldout_perplexity(ctx, cspec, sd, lm_eval=False)
        return _row(method, res, ev, time.perf_counter() - t0, source=f"the run's distill_{method}{suffix} stage")
    student = ctx.model(cspec, csd)
    # the recovery budget split as the pipeline splits it: reconstruct.fraction locally, the rest globally
    from autocompress_nemo.stages.reconstruct import reconstruct, split_tokens

    budget_cfg = OmegaConf.merge(ctx.cfg, {"distill": {"tokens": int(tokens)}})
    local, rest = split_tokens(budget_cfg)
    local_rec = None
    if local > 0:
        local_rec = reconstruct(ctx, teacher, student, local, out / "local")
        local_rec["heldout"] = heldout_perplexity(ctx, cspec, ctx.to_hf(cspec, student), lm_eval=False)
    d = OmegaConf.merge(ctx.cfg.distill, {"tokens": int(rest), "wandb_project": ""})
    res = distill(
        student,
        teacher,
        ctx.forward,
        train_batches(ctx, d),
        d,
        out,
        int(ctx.cfg.seed),
        log=_say,
        name=f"{method}@{tokens}",
    )
    ev = heldout_perplexity(ctx, cspec, ctx.to_hf(cspec, student), lm_eval=False)
    row = _row(method, res, ev, time.perf_counter() - t0, source=f"bench_quality ({out})")
    row["local_tokens"], row["global_tokens"] = local, int(res["tokens"])
    row["tokens"] = local + int(res["tokens"])  # the recovery budget: local + global
    if local_rec is not None:
        row["after_local"] = {
            "heldout_ppl": local_rec["heldout"]["heldout_ppl"],
            "kd_to_parent_heldout": local_rec["heldout"]["kd_to_parent"],
            "layer_nmse_mean_before": sum(local_rec["layer_nmse_before"]) / len(local_rec["layer_nmse_before"]),
            "layer_nmse_mean_after": sum(local_rec["layer_nmse_after"]) / len(local_rec["layer_nmse_after"]),
            "tokens_per_s": local_rec["tokens_per_s"],
            "wall_s": local_rec["wall_s"],
        }
    return row


def _pipeline_point(run: Path, method: str, tokens: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The run's ``distill_<method>`` result when it recovered exactly ``tokens`` tokens (same
    config: the bench reads the run's own, without overrides)."""
    from autocompress_nemo.context import load_weights, read_json
    from autocompress_nemo.stages.layout import DistillDir

    d = DistillDir(run / f"distill_{method}")
    if not (d.record.is_file() and (d.dir / "model.safetensors").is_file()):
        return None
    rec = read_json(d.record)
    if int(rec.get("tokens", -1)) != int(tokens):
        return None
    return rec, load_weights(d.dir)[1]


def _row(method: str, res: dict[str, Any], ev: dict[str, Any], wall: float, source: str) -> dict[str, Any]:
    hist = res.get("history") or []
    tail = [r["kd"] for r in hist[-max(1, len(hist) // 10) :]] or [float("nan")]
    return {
        "method": method,
        "tokens": res["tokens"],
        "steps": res["steps"],
        "heldout_ppl": ev["heldout_ppl"],
        "heldout_nll": ev["heldout_nll"],
        "kd_to_parent_heldout": ev["kd_to_parent"],
        "train_kd_last_tenth": sum(tail) / len(tail),
        "tokens_per_s": res["tokens_per_s"] if res.get("tokens_this_run") else None,
        "wall_s": wall,
        "resumed_from_step": res.get("resumed_from_step", 0),
        "source": source,
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, rows in result["curves"].items():
        xs = [0] + [r["tokens"] for r in rows]
        ys = [result["before_recovery"][m]["heldout_ppl"]] + [r["heldout_ppl"] for r in rows]
        ax.plot(xs, ys, marker="o", label=result["labels"].get(m, m))
    ax.axhline(result["parent"]["heldout_ppl"], color="k", ls="--", label="parent")
    ax.set_xscale("symlog", linthresh=max(1, min(result["token_budgets"])))
    ax.set_yscale("log")
    ax.set_xlabel("recovery tokens")
    ax.set_ylabel("held-out perplexity (PyTorch)")
    ax.set_title(f"{result['target']}: quality vs recovery tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/cpu_chat__smollm2_135m", help="a pipeline run directory")
    ap.add_argument("--tokens", default="32768,131072", help="comma-separated recovery token budgets")
    ap.add_argument("--methods", default="autocompress,minitron_pp")
    ap.add_argument("--tag", default="default", help="output sub-directory (one per setting)")
    ap.add_argument("--budget", default="", help="one budget of a family run (search.budgets), e.g. 0.6x")
    ap.add_argument(
        "--start", default="extract", choices=("extract", "slice"), help="the extracted weights or the plain slice"
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (OmegaConf dot-list)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    run = Path(a.run).resolve()
    budgets = sorted({int(t) for t in a.tokens.split(",") if t.strip()})
    methods = [m for m in a.methods.split(",") if m.strip()]
    suffix = f"@{a.budget}" if a.budget else ""
    missing = [m for m in methods if not (run / f"extract_{m}{suffix}" / "spec.json").is_file()]
    if missing:
        have = sorted(p.name.split("@", 1)[1] for p in run.glob("extract_autocompress@*"))
        raise SystemExit(
            f"--run {run}: no extracted student for {missing} (extract_<method>{suffix}/spec.json); run the pipeline "
            "first (with baseline=true for minitron_pp) or choose --methods among those present"
            + (f"; this run is a family: --budget one of {have}" if have else "")
        )
    from autocompress_nemo.context import Context, load_weights
    from autocompress_nemo.stages.common import METHODS
    from autocompress_nemo.stages.evaluate import heldout_perplexity
    from autocompress_nemo.utils.artifacts import write_json_atomic

    cfg = _config(run, a.overrides)
    ctx = Context(cfg, say=_say)
    ctx.init_distributed()
    out = run / "bench_quality" / f"{a.tag}{suffix}"
    out.mkdir(parents=True, exist_ok=True)
    pspec, psd = load_weights(run / "rank")
    teacher = ctx.model(pspec, psd)
    result: dict[str, Any] = {
        "bench": "quality",
        "run": str(run),
        "target": str(cfg.target.name),
        "tag": a.tag,
        "budget": a.budget or None,
        "start": a.start,
        "overrides": a.overrides,
        "distill": {k: v for k, v in dict(cfg.distill).items() if k != "tokens"},
        "token_budgets": budgets,
        "measured": f"held-out perplexity in PyTorch float32 on CPU {platform.machine()} "
        f"({int(cfg.evaluate.heldout_batches)} batches of 2 x {int(cfg.evaluate.seq_len)} tokens)",
        "labels": {m: METHODS.get(m, m) for m in methods},
        "parent": heldout_perplexity(ctx, pspec, psd, lm_eval=False),
        "before_recovery": {},
        "curves": {m: [] for m in methods},
    }
    for m in methods:
        cspec, csd = _student(run, m, suffix, a.start)
        result["before_recovery"][m] = heldout_perplexity(ctx, cspec, csd, lm_eval=False)
    for tokens in budgets:  # both methods at each budget before the next: a stopped bench stays comparable
        for m in methods:
            row = _point(
                ctx,
                run,
                m,
                tokens,
                teacher,
                out / f"{m}_{tokens}",
                reuse=not a.overrides and a.start == "extract",
                suffix=suffix,
                start=a.start,
            )
            row["ratio_to_parent"] = row["heldout_ppl"] / result["parent"]["heldout_ppl"]
            result["curves"][m].append(row)
            _say(
                f"[bench_quality] {m} @ {row['tokens']} tokens: held-out ppl {row['heldout_ppl']:.2f} ({row['ratio_to_parent']:.2f}x parent)"
            )
            write_json_atomic(out / "quality.json", result)  # a stopped bench keeps its finished points
    curves = result["curves"]
    if "autocompress" in curves and "minitron_pp" in curves:
        result["autocompress_below_minitron_at_every_budget"] = all(
            a_["heldout_ppl"] < b_["heldout_ppl"]
            for a_, b_ in zip(curves["autocompress"], curves["minitron_pp"], strict=True)
        )
    if "autocompress" in curves:
        first, last = curves["autocompress"][0], curves["autocompress"][-1]
        result["goals"] = {
            f"autocompress_at_{first['tokens']}_ratio": first["ratio_to_parent"],
            "goal_at_32768_le_1.5x": first["ratio_to_parent"] <= 1.5 if first["tokens"] == 32768 else None,
            f"autocompress_at_{last['tokens']}_ratio": last["ratio_to_parent"],
            "goal_at_largest_le_1.2x": last["ratio_to_parent"] <= 1.2,
        }
    from autocompress_nemo.report.quality_curve import gap_power_law

    ext = {m: e for m, pts in curves.items() if (e := gap_power_law(pts, result["parent"]["heldout_ppl"]))}
    if ext:
        result["extrapolation"] = ext
    _plot(result, out / "quality.png")
    result["plot"] = str(out / "quality.png")
    write_json_atomic(out / "quality.json", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

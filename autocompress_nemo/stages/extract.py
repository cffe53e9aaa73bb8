"""extract_<method>: the chosen architecture sliced from the sorted **parent** weights (every model
family), checked against the child the search judged (same KD on the same batches) before any
training, written once, as weights (``ExtractDir``): the other formats are the export stage's."""

from __future__ import annotations

from pathlib import Path

import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import describe
from autocompress_nemo.context import Context, load_weights, read_json, save_weights
from autocompress_nemo.stages.common import JUDGE_READS, judge_batches, refit_batches
from autocompress_nemo.stages.declare import LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import ExtractDir, RankDir, SearchDir
from autocompress_nemo.utils.artifacts import write_json_atomic


def run(ctx: Context, out: Path, rank: RankDir, search: SearchDir) -> None:
    from autocompress_nemo.extract.slice import slice_state_dict

    spec, sd = load_weights(rank.dir)
    rec = read_json(search.arch)
    child = ArchSpec.from_dict(rec["child"])
    child_sd = slice_state_dict(spec, sd, child)
    guard = rec.get("quality_guard")
    if guard and guard.get("judge") == "kd" and not guard.get("judge_refit") and child != spec:
        guard["sliced_kd"] = sliced_kd(ctx, spec, sd, child, child_sd)
        ref = float(guard["final_kd"])
        ctx.say(f"[extract] KD of the sliced student {guard['sliced_kd']:.4f} (the search judged {ref:.4f})")
        if abs(guard["sliced_kd"] - ref) > 0.02 * abs(ref) + 1e-3:
            raise ValueError(
                f"the sliced student's KD to the parent ({guard['sliced_kd']:.4f}) differs from the child the search "
                f"judged ({ref:.4f}) on the same batches: slicing and the supernet disagree; not training it"
            )
    if str(ctx.cfg.extract.refit) in ("least_squares", "sequential"):
        child_sd = refit(ctx, spec, sd, child, child_sd, rec)
        check_refit_judged(ctx, rec)
    art = ExtractDir(out)
    save_weights(out, child, child_sd)
    write_json_atomic(art.arch, rec)
    ctx.say(
        f"[extract] {describe(child)}: {param_count(child):,} parameters "
        f"({param_count(child) / param_count(spec):.1%} of the parent)"
    )


def check_refit_judged(ctx: Context, rec: dict) -> None:
    """When the search judged children re-fit (``search.judge_refit``), the re-fit student's KD must be
    the one the guard judged: the same least-squares solve on the same batches."""
    guard, fit = rec.get("quality_guard") or {}, rec.get("refit") or {}
    if not (guard.get("judge_refit") and fit.get("method") == "least_squares" and "refit_kd" in fit):
        return
    got, ref = float(fit["refit_kd"]), float(guard["final_kd"])
    ctx.say(f"[extract] KD of the re-fit student {got:.4f} (the search judged {ref:.4f})")
    if abs(got - ref) > 0.02 * abs(ref) + 1e-3:
        raise ValueError(
            f"the re-fit student's KD to the parent ({got:.4f}) differs from the child the search judged ({ref:.4f}) "
            "on the same batches: the judge's re-fit and extract's disagree; not training it"
        )


def sliced_kd(
    ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], child: ArchSpec, child_sd: dict[str, torch.Tensor]
) -> float:
    """KD loss to the sorted parent of the sliced student on the search judge's calibration batches
    (``stages.search.settle_choices``): the number the quality guard judged, recomputed on the real child."""
    from autocompress_nemo.distill.kd import kd_loss
    from autocompress_nemo.distill.optim import Parallel
    from autocompress_nemo.search.judge import local_rows, world_mean

    s, par = ctx.cfg.search, Parallel.detect()
    teacher, student = ctx.model(spec, sd), ctx.model(child, child_sd)
    teacher.eval()
    student.eval()
    vals = []
    with torch.no_grad():
        for b in judge_batches(ctx):
            x = local_rows(b, par)
            vals.append(float(kd_loss(ctx.forward(student, x), ctx.forward(teacher, x), float(s.kd_temperature))))
    return world_mean(sum(vals) / len(vals))


def refit(
    ctx: Context,
    spec: ArchSpec,
    sd: dict[str, torch.Tensor],
    child: ArchSpec,
    child_sd: dict[str, torch.Tensor],
    rec: dict,
) -> dict[str, torch.Tensor]:
    """The student's weights with its narrowed blocks' output projections re-fit by least squares to
    the sorted parent's (``extract/compensate.py``: all at once on the parent's inputs, or with
    ``extract.refit=sequential`` layer after layer on the student's own), kept only when the KD to
    the parent on the judge's batches improves on the plain slice; ``rec["refit"]`` records both KDs
    and every block's error."""
    from autocompress_nemo.extract.compensate import (
        collect_grams,
        refit_blocks,
        refit_state_dict,
        sequential_problem,
        sequential_refit,
    )

    e = ctx.cfg.extract
    method = str(e.refit)
    blocks = refit_blocks(spec, child)
    if not blocks:
        rec["refit"] = {"method": method, "blocks": [], "used": False, "why": "no narrowed block to re-fit"}
        return child_sd
    batches = refit_batches(ctx)
    parent_m = ctx.model(spec, sd)
    live = ctx.model(child, child_sd) if method == "sequential" else None
    why = sequential_problem(parent_m, live) if live is not None else None
    if why:
        ctx.say(f"[extract] extract.refit=sequential: {why}; re-fitting every block on the parent's inputs instead")
        rec["refit_fallback"] = why
    if live is not None and not why:
        new_sd, records, tokens = sequential_refit(
            parent_m, live, spec, sd, child, child_sd, batches, ctx.forward, float(e.ridge)
        )
    else:
        grams, tokens = collect_grams(parent_m, spec, blocks, batches, ctx.forward)
        new_sd, records = refit_state_dict(spec, sd, child, child_sd, grams, float(e.ridge))
    known = (rec.get("quality_guard") or {}).get("sliced_kd")  # run() measured it on the same batches
    sliced = float(known) if known is not None else sliced_kd(ctx, spec, sd, child, child_sd)
    fitted = sliced_kd(ctx, spec, sd, child, new_sd)
    used = fitted < sliced
    rec["refit"] = {
        "method": method,
        "tokens": tokens,
        "ridge": float(e.ridge),
        "sliced_kd": sliced,
        "refit_kd": fitted,
        "used": used,
        "blocks": records,
    }
    mean = lambda k: sum(r[k] for r in records) / len(records)  # noqa: E731
    ctx.say(
        f"[extract] {'sequential ' if method == 'sequential' else ''}least-squares re-fit of {len(records)} output "
        f"projections on {tokens:,} tokens: "
        f"mean relative output error {mean('sliced_error'):.4f} -> {mean('refit_error'):.4f}; KD to the parent "
        f"{sliced:.4f} -> {fitted:.4f} on the judge's batches"
        + ("" if used else ": no better, the student keeps the plain slice")
    )
    return new_sd if used else child_sd


STAGE = Stage(
    "extract",
    reads=reads(PARENT, LAYOUT, JUDGE_READS, "extract"),
    needs=("rank", "search"),
    per_method=True,
    script="the searched architecture sliced out of the parent in <run_dir>/extract_<method>",
    entry=lambda ctx, out, inp: run(ctx, out, RankDir(inp["rank"]), SearchDir(inp["search"])),
)

"""distill_<method>: recovery distillation of the extracted student from the sorted parent (every
model family); resumes from its checkpoint (``<run_dir>/distill_<method>.ckpt``)."""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.context import Context, load_weights, save_weights
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import DistillDir, ExtractDir, RankDir
from autocompress_nemo.utils.artifacts import write_json_atomic

STAGE = Stage("distill", reads=reads(PARENT, LAYOUT, DATA, "distill"), needs=("rank", "extract"), per_method=True)


def run(ctx: Context, out: Path, rank: RankDir, student: ExtractDir, ckpt_dir: Path) -> None:
    from autocompress_nemo.distill.recover import distill as run_distill

    d = ctx.cfg.distill
    pspec, psd = load_weights(rank.dir)
    cspec, csd = load_weights(student.dir)
    teacher = ctx.model(pspec, psd)
    for p in teacher.parameters():
        p.requires_grad_(False)
    model = ctx.model(cspec, csd)
    seq, bs = int(d.seq_len), int(d.batch_size)
    result = run_distill(
        model,
        teacher,
        ctx.forward,
        lambda step: ctx.batch_at("train", step, bs, seq, seed_offset=29),
        d,
        ckpt_dir,
        int(ctx.cfg.seed),
        log=ctx.say,  # resumed / set aside: on the run's output, with the stage lines
    )
    save_weights(out, cspec, ctx.to_hf(cspec, model))
    write_json_atomic(DistillDir(out).record, result)

"""distill_<method>: recovery distillation of the extracted student from the sorted parent (every
model family); resumes from its checkpoint (``<run_dir>/distill_<method>.ckpt``), or starts from a
Megatron-LM distributed checkpoint (``distill.init_from``). Writes the distilled student once, as
weights, with ``distill.json`` (the export stage writes the Megatron-LM checkpoint, GGUF and HF)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from autocompress_nemo.arch.counts import forward_flops_per_token
from autocompress_nemo.context import Context, load_weights, save_weights
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import DistillDir, ExtractDir, RankDir
from autocompress_nemo.utils.artifacts import write_json_atomic


def train_batches(ctx: Context, d: Any) -> Callable[[int], torch.Tensor]:
    """The recovery's global batch at each step (``d``: the distill config): the same for every
    student of a run, so AutoCompress and Minitron++ (and ``bench/bench_quality.py``) see one text."""
    seq, bs = int(d.seq_len), int(d.batch_size)
    return lambda step: ctx.batch_at("train", step, bs, seq, seed_offset=29)


def run(ctx: Context, out: Path, rank: RankDir, student: ExtractDir, ckpt_dir: Path | None) -> None:
    from autocompress_nemo.distill.recover import distill as run_distill
    from autocompress_nemo.stages.reconstruct import split_tokens

    assert ckpt_dir is not None  # a resumable stage: the runner gives it its checkpoint directory

    local, global_tokens = split_tokens(ctx.cfg)
    d = OmegaConf.merge(ctx.cfg.distill, {"tokens": global_tokens})  # the rest of the recovery budget
    pspec, psd = load_weights(rank.dir)
    cspec, csd = load_weights(student.dir)
    teacher = ctx.model(pspec, psd)
    for p in teacher.parameters():
        p.requires_grad_(False)
    model = ctx.model(cspec, csd)
    init_from = str(getattr(d, "init_from", "") or "") or None
    if init_from:
        from autocompress_nemo.models.dist_checkpoint import read_spec

        if read_spec(init_from) != cspec:
            raise ValueError(
                f"distill.init_from={init_from}: that checkpoint's spec.json is not this run's extracted student "
                f"({cspec.name}); start from a checkpoint of the same architecture or unset distill.init_from"
            )
    result = run_distill(
        model,
        teacher,
        ctx.forward,
        train_batches(ctx, d),
        d,
        ckpt_dir,
        int(ctx.cfg.seed),
        log=ctx.say,  # resumed / set aside: on the run's output, with the stage lines
        init_from=init_from,
        # the teacher's forward, the student's forward and backward (``utils.work``: the FLOP bound)
        flops_per_token=forward_flops_per_token(pspec, int(d.seq_len))
        + 3 * forward_flops_per_token(cspec, int(d.seq_len)),
    )
    save_weights(out, cspec, ctx.to_hf(cspec, model))
    result.update(local_tokens=local, recovery_tokens=local + int(result["tokens"]))
    write_json_atomic(DistillDir(out).record, result)


STAGE = Stage(
    "distill",
    reads=reads(PARENT, LAYOUT, DATA, "distill", "reconstruct.fraction"),
    needs=("rank", "reconstruct|extract"),
    per_method=True,
    distributed=True,
    resumable=True,
    script="the recovered student in <run_dir>/distill_<method>",
    entry=lambda ctx, out, inp: run(
        ctx, out, RankDir(inp["rank"]), ExtractDir(inp["reconstruct|extract"]), inp.checkpoint
    ),
)

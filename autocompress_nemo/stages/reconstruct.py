"""reconstruct_<method>: blockwise local distillation of the extracted student before global
distillation (``distill/local.py``): every student layer learns, on the parent's own input
activations at that layer, to reproduce the parent layer's output. Its tokens are part of the
recovery budget: ``reconstruct.fraction`` of ``distill.tokens`` here, the rest in ``distill``.
Resumes from its checkpoint (``<run_dir>/reconstruct_<method>.ckpt``) through the one trainer
(``distill.recover.train``); writes the student's weights and ``reconstruct.json`` (losses, the
per-layer error before and after on fixed batches, tokens, tokens per second)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from autocompress_nemo.arch.counts import forward_flops_per_token
from autocompress_nemo.context import Context, load_weights, save_weights
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import ExtractDir, RankDir
from autocompress_nemo.utils.artifacts import write_json_atomic

RECORD = "reconstruct.json"
SPLIT_READS = ("reconstruct.fraction", "distill.tokens", "distill.batch_size", "distill.seq_len")
"""What the split of ``distill.tokens`` between local and global steps reads."""


def split_tokens(cfg: Any) -> tuple[int, int]:
    """``(local, global)`` recovery tokens, each a whole number of ``distill.batch_size x
    distill.seq_len`` steps: ``reconstruct.fraction`` of ``distill.tokens`` (rounded down to whole
    steps) locally, the rest globally (at least one step)."""
    d, frac = cfg.distill, float(cfg.reconstruct.fraction)
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"reconstruct.fraction={frac}: give a share of distill.tokens in [0, 1)")
    per_step = int(d.batch_size) * int(d.seq_len)
    total = int(d.tokens)
    local = (int(frac * total) // per_step) * per_step
    return local, max(per_step, total - local)


def _disabled(cfg: Any) -> str | None:
    local, _ = split_tokens(cfg)
    if local <= 0:
        return (
            f"reconstruct.fraction={cfg.reconstruct.fraction} of distill.tokens={cfg.distill.tokens} is under one step: "
            "no local reconstruction, all recovery tokens go to distill"
        )
    return None


def trainer_config(cfg: Any, tokens: int) -> SimpleNamespace:
    """The trainer's settings for the local steps: ``reconstruct``'s schedule, ``distill``'s batch
    shape and precision policy."""
    r, d = cfg.reconstruct, cfg.distill
    return SimpleNamespace(
        tokens=tokens,
        lr=float(r.lr),
        min_lr=float(r.min_lr),
        warmup_steps=int(r.warmup_steps),
        batch_size=int(d.batch_size),
        seq_len=int(d.seq_len),
        teacher_precision=str(d.teacher_precision),
        checkpoint_every=int(r.checkpoint_every),
        log_every=int(d.log_every),
        weight_decay=0.0,
        grad_clip=1.0,
    )


def changed_layers(parent: Any, model: Any) -> list[Any]:
    """The student's Megatron layers that hold a block the slice changed (narrowed or removed)."""
    from autocompress_nemo.models.megatron import block_layers

    pspec, cspec = parent.arch_spec, model.arch_spec
    layers = block_layers(model)
    out: dict[int, Any] = {}
    for i, layer in layers.items():
        if cspec.blocks[i] != pspec.blocks[i]:
            out[id(layer)] = layer
    return list(out.values())


def train_only_changed(parent: Any, model: Any) -> int:
    """Only the layers the slice changed learn: embedding, final norm, head and every layer kept
    whole stay the parent's (Adam would turn an unchanged layer's zero gradients into noise).
    Returns how many layers learn."""
    changed = changed_layers(parent, model)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in changed:
        for p in layer.parameters():
            p.requires_grad_(True)
    return len(changed)


def reconstruct(
    ctx: Context, parent: Any, model: Any, tokens: int, ckpt_dir: Path, flops_per_token: float = 0.0
) -> dict[str, Any]:
    """Train ``model``'s layers on the local objective for ``tokens`` tokens (resumable from
    ``ckpt_dir``); the record: tokens, per-layer error before / after on fixed batches, losses,
    tokens per second. Used by the stage and by ``bench/bench_quality.py``. ``flops_per_token``:
    the trainer's count (:func:`local_flops_per_token`)."""
    from autocompress_nemo.distill.local import layer_errors, local_objective
    from autocompress_nemo.distill.recover import teacher_precision, train

    cfg = ctx.cfg
    tcfg = trainer_config(cfg, tokens)
    train_only_changed(parent, model)
    bs, seq = tcfg.batch_size, tcfg.seq_len
    probe = [ctx.batch_at("train", i, bs, seq, seed_offset=43) for i in range(2)]
    before = layer_errors(model, parent, ctx.forward, probe)
    objective = local_objective(
        model,
        parent,
        ctx.forward,
        str(cfg.reconstruct.loss),
        teacher_precision(tcfg.teacher_precision, parent),
        unit=str(cfg.reconstruct.get("unit", "layer")),
    )
    result = train(
        model,
        objective,
        lambda step: ctx.batch_at("train", step, bs, seq, seed_offset=37),
        tcfg,
        ckpt_dir,
        int(cfg.seed),
        log=ctx.say,
        name="reconstruct",
        flops_per_token=flops_per_token,
    )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    after = layer_errors(model, parent, ctx.forward, probe)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    ctx.say(
        f"[reconstruct] {result['tokens']:,} local tokens: mean layer error {mean(before):.4f} -> {mean(after):.4f} "
        f"(parent's inputs, {len(before)} layers), {result['tokens_per_s']:.0f} tok/s"
    )
    return {
        "tokens": result["tokens"],
        "loss": str(cfg.reconstruct.loss),
        "unit": str(cfg.reconstruct.get("unit", "layer")),
        "layer_nmse_before": before,
        "layer_nmse_after": after,
        "first_loss": result["first_loss"],
        "final_loss": result["final_loss"],
        "tokens_per_s": result["tokens_per_s"],
        "wall_s": result["wall_s"],
        "history": result["history"],
    }


def local_flops_per_token(parent: Any, student: Any, seq: int) -> float:
    """A local step's arithmetic per token: the parent's layers forward (their inputs and outputs), the
    student's layers forward and backward; no LM head on either side, no teacher logits."""
    return forward_flops_per_token(parent, seq, head=False) + 3 * forward_flops_per_token(student, seq, head=False)


def run(ctx: Context, out: Path, rank: RankDir, student: ExtractDir, ckpt_dir: Path | None) -> None:
    from autocompress_nemo.distill.local import layer_problem

    assert ckpt_dir is not None  # a resumable stage: the runner gives it its checkpoint directory

    local, rest = split_tokens(ctx.cfg)
    pspec, psd = load_weights(rank.dir)
    cspec, csd = load_weights(student.dir)
    parent, model = ctx.model(pspec, psd), ctx.model(cspec, csd)
    why = layer_problem(parent, model)
    if why:  # (a pruned hidden size): the extracted student goes on as it is, and the record says why
        ctx.say(f"[reconstruct] not run: {why}; the extracted student goes to distill unchanged")
        save_weights(out, cspec, csd)
        write_json_atomic(out / RECORD, {"tokens": 0, "skipped": why, "split": {"local": 0, "global": rest}})
        return
    flops = local_flops_per_token(pspec, cspec, int(ctx.cfg.distill.seq_len))
    record = reconstruct(ctx, parent, model, local, ckpt_dir, flops)
    record["split"] = {"local": local, "global": rest, "fraction": float(ctx.cfg.reconstruct.fraction)}
    save_weights(out, cspec, ctx.to_hf(cspec, model))
    write_json_atomic(out / RECORD, record)


STAGE = Stage(
    "reconstruct",
    reads=reads(
        PARENT, LAYOUT, DATA, "reconstruct", *SPLIT_READS[1:], "distill.teacher_precision", "distill.log_every"
    ),
    needs=("rank", "extract"),
    per_method=True,
    distributed=True,
    resumable=True,
    joins=("distill",),
    enabled=_disabled,
    entry=lambda ctx, out, inp: run(ctx, out, RankDir(inp["rank"]), ExtractDir(inp["extract"]), inp.checkpoint),
)

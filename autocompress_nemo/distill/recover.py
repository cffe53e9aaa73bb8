"""Recovery distillation of the extracted student from the parent (DESIGN.md section 4, "Distill").

Legend: B batch, T tokens, V vocab, H hidden.

Loss per step: ``kd_loss(student, teacher, T) + w * hidden_state_loss(...)`` — forward KL on
logits at temperature ``T`` (``distill.temperature``) plus, when ``w =
distill.intermediate_weight > 0``, the normalized MSE between the residual streams after
matched layers (student layer ``i`` of ``L_s`` is matched with teacher layer
``round((i + 1) * L_t / L_s) - 1``, i.e. layer for layer when the depths agree).

Budget: ``steps = max(1, distill.tokens // (distill.batch_size * distill.seq_len))``.
Data: ``batch_at(step)`` returns the step's *global* batch ``[B, T]`` and must be
deterministic (the same tensor for the same step in every process and every run); each
data-parallel rank takes its contiguous ``B / dp`` rows and gradients are averaged over DP,
so a DP run follows the single-process run. Under expert parallelism (world = DP x EP at TP=1)
each rank still takes ``B / dp`` rows; routed experts see the rows of every EP rank through the
token dispatcher, and their gradients are reduced over the expert-data-parallel group only
(``optim.reduce_gradients``), so EP=2 follows EP=1 too (tests/test_ep_stages.py).

Resume: checkpoints every ``distill.checkpoint_every`` steps (and at the end) hold model,
optimizer, scheduler, step, RNG states and the per-step history; ``distill`` started again
with the same ``out_dir`` continues from the latest one and reaches the same final weights
as an uninterrupted run (bitwise on one process: same data, same order of operations).
Megatron students trained by ``torch.optim.AdamW`` checkpoint as Megatron-LM distributed
checkpoints (``distill.dist_state``: ``<out_dir>/checkpoints/latest_checkpointed_iteration.txt``,
``iter_0000050/``, the AdamW state sharded like the parameters); other students and Megatron's
own optimizer as ``torch.save`` shards (``distill.checkpoint``).

Language modelling (``teacher=None``): the loss is next-token cross entropy on the batch itself
(``kd.lm_loss``), no teacher — the same loop, optimizer, schedule and checkpoints pretrain a model
from random weights (``pretrain/``). ``evaluate(model)`` every ``eval_every`` steps records a
held-out metric in that step's history row (``row["eval"]``); ``should_stop(evals)`` may then end the
run early (the reason is kept in the row as ``row["stopped"]`` and checkpointed, so a restarted run
stops there too).

Contract: any ``torch.nn.Module`` pair plus ``forward(model, input_ids_BT) -> logits_BTV``
(``models.builder.forward_logits`` for Megatron models). Under tensor parallelism the
forward must return full-vocabulary logits on every TP rank (``forward_logits`` does).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.distill.checkpoint import CheckpointStore, rng_state, set_rng_state
from autocompress_nemo.distill.dist_state import DistState
from autocompress_nemo.distill.dist_state import supports as dist_supports
from autocompress_nemo.distill.kd import hidden_state_loss, kd_loss, lm_loss
from autocompress_nemo.distill.monitor import Monitor
from autocompress_nemo.distill.optim import Parallel, build_optimizer, opt_field
from autocompress_nemo.models.dist_checkpoint import unwrap
from autocompress_nemo.utils import work
from autocompress_nemo.utils.artifacts import write_json_atomic
from autocompress_nemo.utils.interrupts import ctrl_c_deferred

Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
_log = logging.getLogger("autocompress.distill")


def num_steps(cfg: Any) -> int:
    """``max(1, tokens // (batch_size * seq_len))``."""
    per_step = int(cfg.batch_size) * int(cfg.seq_len)
    if per_step <= 0:
        raise ValueError(f"distill.batch_size={cfg.batch_size} x distill.seq_len={cfg.seq_len} must be positive")
    return max(1, int(cfg.tokens) // per_step)


# ---------------------------------------------------------------------------------------------
# intermediate (hidden-state) capture
# ---------------------------------------------------------------------------------------------
def find_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's sequence of layers: Megatron ``decoder.layers``, HF ``model.layers``, ``layers``."""
    m = unwrap(model)
    for path in ("decoder.layers", "model.layers", "layers", "transformer.h"):
        obj: Any = m
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList | list) and len(obj):
            return list(obj)
    raise ValueError(
        f"{type(m).__name__} has no decoder.layers / model.layers / layers: the intermediate "
        "loss cannot find its layers; set distill.intermediate_weight=0"
    )


class HiddenCapture:
    """Forward hooks that keep the output hidden state of chosen layers during one forward."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.states: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._hook) for layer in layers]

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        h = output[0] if isinstance(output, tuple | list) else output
        self.states.append(_gather_sequence_parallel(module, h))

    def take(self) -> list[torch.Tensor]:
        out, self.states = self.states, []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _gather_sequence_parallel(module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Under Megatron sequence parallelism a layer's output holds this rank's T/tp slice:
    gather it (backward: take the slice), so the loss is the same on every TP rank."""
    cfg = getattr(module, "config", None)
    if not getattr(cfg, "sequence_parallel", False):
        return h
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)


def matched_layers(n_student: int, n_teacher: int) -> list[int]:
    """Teacher layer index for each student layer: ``round((i + 1) * L_t / L_s) - 1``."""
    return [max(0, round((i + 1) * n_teacher / n_student) - 1) for i in range(n_student)]


def teacher_precision(name: str, teacher: torch.nn.Module) -> Callable[[], Any]:
    """A context factory for the teacher's forward: ``fp32`` as is, ``bf16`` under ``torch.autocast``,
    ``auto`` = ``bf16`` where the device multiplies bfloat16 natively (``native_bf16``), else ``fp32``."""
    device = next(teacher.parameters()).device.type
    if name == "auto":
        name = "bf16" if native_bf16(device) else "fp32"
    if name == "fp32":
        return contextlib.nullcontext
    if name == "bf16":
        return lambda: torch.autocast(device_type=device, dtype=torch.bfloat16)
    raise ValueError(f"distill.teacher_precision={name!r}: use 'auto', 'fp32' or 'bf16'")


def native_bf16(device: str) -> bool:
    """CUDA with bfloat16 support, or a CPU with AVX512-BF16 / AMX-BF16 instructions (``/proc/cpuinfo``):
    where a bf16 matmul is faster than a float32 one (2.2-2.5x measured on this CPU's AVX512-BF16)."""
    if device == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _fmt(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items() if k != "tokens")


def _fingerprint(cfg: Any, steps: int, seed: int, opt_name: str, lm: bool = False) -> dict[str, Any]:
    keys = (
        "lr",
        "min_lr",
        "warmup_steps",
        "batch_size",
        "seq_len",
        "temperature",
        "intermediate_weight",
        "teacher_precision",
    )
    fp = {k: opt_field(cfg, k, None) for k in keys}
    fp.update(steps=steps, seed=seed, optimizer=opt_name)
    if lm:  # language modelling: other loss, and the optimizer extras matter
        fp.update(loss="lm", **{k: opt_field(cfg, k, None) for k in ("weight_decay", "grad_clip")})
    return {k: (float(v) if isinstance(v, float) else v) for k, v in fp.items()}


def _local_rows(x_BT: torch.Tensor, par: Parallel, batch_size: int) -> torch.Tensor:
    if x_BT.dim() != 2:
        raise ValueError(f"batch_at(step) must return token ids [B, T], got shape {tuple(x_BT.shape)}")
    if x_BT.shape[0] != batch_size:
        raise ValueError(
            f"batch_at(step) returned {x_BT.shape[0]} sequences but distill.batch_size={batch_size}: "
            "the token budget assumes one global batch per step"
        )
    if batch_size % par.dp_size:
        raise ValueError(
            f"distill.batch_size={batch_size} is not divisible by the data-parallel size "
            f"{par.dp_size}; choose a multiple of it"
        )
    n = batch_size // par.dp_size
    return x_BT[par.dp_rank * n : (par.dp_rank + 1) * n]


@dataclass
class Objective:
    """What one training run optimizes (the trainer's plug-in; torchtitan / Megatron-Bridge style):
    ``loss(x_BT) -> (loss, metrics)`` on one micro-batch of this rank's rows; ``metrics`` are floats
    averaged over micro-batches and data-parallel ranks into the step's history row. ``kind`` names
    it in the checkpoint fingerprint and the record (``kd``, ``lm``, ``local``, ...); ``fingerprint``
    adds the settings a resumed run must share. ``setup`` / ``teardown`` run around the loop
    (hooks)."""

    kind: str
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None


def distill(
    student: torch.nn.Module,
    teacher: torch.nn.Module | None,
    forward: Forward,
    batch_at: Callable[[int], torch.Tensor],
    cfg: Any,
    out_dir: str | Path,
    seed: int,
    **trainer: Any,
) -> dict[str, Any]:
    """Recover ``student`` from ``teacher`` for ``cfg.tokens`` tokens; resumable from ``out_dir``.
    ``teacher=None``: train ``student`` as a language model (next-token cross entropy) instead.
    The loop is :func:`train`'s; this builds the objective (KD on logits, optionally plus the
    hidden-state loss; or LM cross entropy) and passes everything else (``trainer``: optimizer,
    micro_batch_size, log, name — ``distill`` by default —, init_from, evaluate, eval_every,
    should_stop) through."""
    temperature = float(opt_field(cfg, "temperature", 1.0))
    w_hidden = float(opt_field(cfg, "intermediate_weight", 0.0))
    lm = teacher is None
    if lm and w_hidden > 0:
        raise ValueError("language modelling (no teacher) has no hidden-state loss; set intermediate_weight=0")
    if lm:
        objective = Objective("lm", lambda x: _metric(lm_loss(forward(student, x), x), "ce"))
        objective.fingerprint = {"loss": "lm", **{k: opt_field(cfg, k, None) for k in ("weight_decay", "grad_clip")}}
    else:
        assert teacher is not None
        teacher_ctx = teacher_precision(str(opt_field(cfg, "teacher_precision", "fp32")), teacher)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        caps: list[HiddenCapture] = []

        def setup() -> None:
            if w_hidden > 0:
                s_layers, t_layers = find_layers(student), find_layers(teacher)
                caps[:] = [
                    HiddenCapture(s_layers),
                    HiddenCapture([t_layers[j] for j in matched_layers(len(s_layers), len(t_layers))]),
                ]

        def teardown() -> None:
            for c in caps:
                c.remove()

        def kd_step(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            with torch.no_grad(), teacher_ctx():
                t_logits_BTV = forward(teacher, x)
            kd = kd_loss(forward(student, x), t_logits_BTV, temperature)
            loss, hid = kd, 0.0
            if caps:
                h = hidden_state_loss(caps[0].take(), caps[1].take())
                loss, hid = loss + w_hidden * h, float(h.detach())
            return loss, {"kd": float(kd.detach()), "hidden": hid}

        objective = Objective("kd", kd_step, {}, setup, teardown)
    result = train(student, objective, batch_at, cfg, out_dir, seed, **{"name": "distill", **trainer})
    result.update(temperature=temperature, intermediate_weight=w_hidden, loss_kind="lm" if lm else "kd")
    return result


def _metric(loss: torch.Tensor, key: str) -> tuple[torch.Tensor, dict[str, float]]:
    return loss, {key: float(loss.detach())}


def train(
    student: torch.nn.Module,
    objective: Objective,
    batch_at: Callable[[int], torch.Tensor],
    cfg: Any,
    out_dir: str | Path,
    seed: int,
    *,
    optimizer: str = "auto",
    micro_batch_size: int | None = None,
    log: Callable[[str], None] | None = None,
    name: str = "train",
    init_from: str | Path | None = None,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    eval_every: int = 0,
    should_stop: Callable[[list[dict[str, Any]]], str | None] | None = None,
    flops_per_token: float = 0.0,
) -> dict[str, Any]:
    """The one training loop: ``student``'s trainable parameters (``requires_grad``) optimized on
    ``objective.loss`` for ``cfg.tokens`` tokens; resumable from ``out_dir``.

    ``cfg``: ``config.schema.DistillConfig`` (or any object with its fields; optional extras
    ``weight_decay``, ``grad_clip``, ``adam_beta1/2``, ``adam_eps``). ``optimizer``: ``auto``
    (Megatron's on CUDA for Megatron models, else ``torch.optim.AdamW``), ``torch``,
    ``megatron``. ``micro_batch_size``: split each rank's rows into micro-batches with
    gradient accumulation (same result, less activation memory). ``init_from``: a Megatron-LM
    distributed checkpoint (``models.dist_checkpoint``, any TP size) whose weights the student
    starts from; this run's own checkpoint, when there is one, still wins (it is later).
    ``evaluate``: called with the model every ``eval_every`` steps (and after the last); its dict is
    recorded as ``row["eval"]`` (plus ``tokens``). ``should_stop``: called with every eval so far;
    a string ends the run after that step (recorded as ``row["stopped"]``, checkpointed).
    ``flops_per_token``: the step's arithmetic per token (teacher forward + student forward and
    backward, ``arch.counts.forward_flops_per_token``), counted for this rank's rows in ``utils.work``
    (the stage's FLOP bound in ``record.json``).

    Writes ``<out_dir>/checkpoints``, ``<out_dir>/tensorboard`` and (rank 0)
    ``<out_dir>/distill_summary.json``. Returns: steps, tokens, tokens_this_run,
    resumed_from_step, first_loss, final_loss, history (per step: step, loss, the objective's
    metrics, lr, grad_norm, tokens so far, step_s wall seconds), tokens_per_s, wall_s, optimizer,
    checkpoint, tensorboard. The student ends in eval mode with the final weights.
    """
    say = log or _log.info
    out = Path(out_dir)
    par = Parallel.detect()
    if par.pp_size > 1:
        raise ValueError(
            "distill runs without pipeline parallelism (forward_logits needs every layer on one "
            "rank); set cluster.pp=1 (or cluster.stage_layouts.distill.pp=1)"
        )
    if par.is_rank0:
        out.mkdir(parents=True, exist_ok=True)
    steps = num_steps(cfg)
    lm = objective.kind == "lm"
    torch.manual_seed(seed)
    student.train()
    if init_from:
        # before the optimizer: Megatron's keeps its own (fp32 main) copies of the parameters
        from autocompress_nemo.models.dist_checkpoint import load_checkpoint

        it = load_checkpoint(student, init_from)
        say(f"{name}: student weights from the Megatron checkpoint {init_from} (iteration {it})")
    opt = build_optimizer(optimizer, student, cfg, steps, par)
    fp = _fingerprint(cfg, steps, seed, opt.name, lm)
    if objective.kind not in ("kd", "lm"):  # (kd / lm: the keys of checkpoints written before the objective)
        fp.update(loss=objective.kind, **objective.fingerprint)
    store = CheckpointStore(
        out / "checkpoints",
        par,
        fp,
        keep=int(opt_field(cfg, "keep_checkpoints", 2)),
        dist=DistState(student, opt, par) if dist_supports(student, opt) else None,
    )

    start, history = 0, []
    state = store.load(log=say)  # torch_dist: model, optimizer and RNG already set
    if state is not None:
        if "model" in state:
            student.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
        start, history = int(state["step"]), list(state["history"])
        say(f"{name}: resumed from step {start}/{steps} ({store.root})")

    stopped = next((r["stopped"] for r in history if r.get("stopped")), None)
    if stopped:
        say(f"{name}: stopped at step {start} in an earlier run ({stopped})")
    mon = Monitor(out, cfg, steps, start, enabled=par.is_rank0, name=name)
    if objective.setup is not None:
        objective.setup()
    t0 = time.perf_counter()
    tokens_run = 0
    last_ckpt: Path | None = None
    every = int(opt_field(cfg, "checkpoint_every", 0))
    try:
        for step in range(start, start if stopped else steps):
            t_step = time.perf_counter()
            x_BT = batch_at(step)
            rows_BT = _local_rows(x_BT, par, int(cfg.batch_size))
            mb = micro_batch_size or rows_BT.shape[0]
            opt.zero_grad()
            sums: dict[str, float] = {}
            loss_sum = 0.0
            for i in range(0, rows_BT.shape[0], mb):
                x = rows_BT[i : i + mb]
                frac = x.shape[0] / rows_BT.shape[0]
                loss, metrics = objective.loss(x)
                (loss * frac).backward()
                loss_sum += float(loss.detach()) * frac
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * frac
            grad_norm = opt.step(step)
            loss_mean = par.mean_over_dp(loss_sum)
            if not math.isfinite(loss_mean):
                raise FloatingPointError(f"{name} step {step}: loss is {loss_mean}; lower distill.lr")
            n_tok = int(x_BT.numel())
            tokens_run += n_tok
            work.add(flops_per_token * n_tok / par.dp_size)
            row = {
                "step": step,
                "loss": loss_mean,
                **{k: par.mean_over_dp(v) for k, v in sums.items()},
                "lr": opt.lr,
                "grad_norm": grad_norm,
                "tokens": (history[-1]["tokens"] if history else 0) + n_tok,
                "step_s": time.perf_counter() - t_step,
            }
            done = step + 1
            if evaluate is not None and (done == steps or (eval_every > 0 and done % eval_every == 0)):
                row["eval"] = {**evaluate(student), "tokens": row["tokens"]}
                student.train()
                say(f"{name}: step {done}/{steps}, {row['tokens']:,} tokens: " + _fmt(row["eval"]))
                if should_stop is not None:
                    why = should_stop([r["eval"] for r in [*history, row] if "eval" in r])
                    if why:
                        row["stopped"] = why
            history.append(row)
            mon.update(row, n_tok)
            if done == steps or row.get("stopped") or (every > 0 and done % every == 0):
                full = store.dist is None  # torch_dist: model, optimizer, RNG from store.dist
                with ctrl_c_deferred():  # a Ctrl-C lands after the checkpoint is whole
                    last_ckpt = store.save(
                        done,
                        {
                            "model": student.state_dict() if full else None,
                            "optimizer": opt.state_dict() if full else None,
                            "rng": rng_state() if full else None,
                            "step": done,
                            "history": history,
                        },
                    )
            if row.get("stopped"):
                stopped = row["stopped"]
                say(f"{name}: stopping after step {done}/{steps}: {stopped}")
                break
    finally:
        mon.close()
        if objective.teardown is not None:
            objective.teardown()
    wall = time.perf_counter() - t0
    student.eval()
    if last_ckpt is None:
        meta = store.latest()
        last_ckpt = store.root / meta["dir"] if meta else None
    result = {
        "steps": steps,
        "tokens": history[-1]["tokens"] if history else 0,
        "tokens_this_run": tokens_run,
        "resumed_from_step": start,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "steps_done": len(history),
        "stopped": stopped,
        "loss_kind": objective.kind,
        "history": history,
        "tokens_per_s": tokens_run / wall if wall > 0 and tokens_run else 0.0,
        "wall_s": wall,
        "optimizer": opt.name,
        "world": par.layout,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "tensorboard": str(out / "tensorboard"),
    }
    if par.is_rank0:
        write_json_atomic(out / "distill_summary.json", {k: v for k, v in result.items() if k != "history"})
    say(
        f"{name}: {len(history)}/{steps} steps, {result['tokens']} tokens, loss {result['first_loss']} -> {result['final_loss']}, "
        f"{result['tokens_per_s']:.0f} tok/s this run"
    )
    return result

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


def _local_rows(x_BT: torch.Tensor, par: Parallel, batch_size: int, name: str = "distill") -> torch.Tensor:
    if x_BT.dim() != 2:
        raise ValueError(f"batch_at(step) must return token ids [B, T], got shape {tuple(x_BT.shape)}")
    if x_BT.shape[0] != batch_size:
        raise ValueError(
            f"batch_at(step) returned {x_BT.shape[0]} sequences but {name}.batch_size={batch_size}: "
            "the token budget assumes one global batch per step"
        )
    if batch_size % par.dp_size:
        raise ValueError(
            f"{name}.batch_size={batch_size} is not divisible by the data-parallel size "
            f"{par.dp_size}; choose a multiple of it"
        )
    n = batch_size // par.dp_size
    return x_BT[par.dp_rank * n : (par.dp_rank + 1) * n]


@dataclass
class Objective:
    """What one training run optimizes (the trainer's plug-in; torchtitan / Megatron-Bridge style):
    ``loss(x_BT) -> (loss, metrics)`` on one micro-batch of this rank's rows; ``metrics`` are floats
    averaged over micro-batches and data-parallel ranks into the step's history row. ``kind`` names
    it in the checkpoint fingerprint and the record (``kd``, ``lm``, ``local``, ``router``...);
    ``fingerprint`` adds the settings a resumed run must share. Hooks: ``setup`` / ``teardown`` run
    around the loop; ``begin_step(step)`` before a step's first micro-batch (the router's
    temperature and Gumbel sample); ``extras()`` after the optimizer step, merged into the step's
    row; ``stop(history)`` after every step: a string ends the run there (recorded as
    ``row["stopped"]`` and checkpointed, so a resumed run stops at the same step)."""

    kind: str
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    begin_step: Callable[[int], None] | None = None
    extras: Callable[[], dict[str, Any]] | None = None
    stop: Callable[[list[dict[str, Any]]], str | None] | None = None


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
    optimizer: Any = "auto",
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

    ``cfg``: ``config.schema.DistillConfig`` or any object with its fields. ``optimizer``: ``auto`` (Megatron's on CUDA for
    Megatron models, else ``torch.optim.AdamW``), ``torch``, ``megatron``, or an object of their face
    (``search.autocompress.RouterOptimizer``; ``skips_nonfinite``: a non-finite loss is recorded, not
    raised). ``micro_batch_size``: gradient accumulation over this rank's rows. ``init_from``: a
    Megatron-LM distributed checkpoint the student starts from (this run's own checkpoint wins).
    ``evaluate`` every ``eval_every`` steps and after the last, into ``row["eval"]``;
    ``should_stop(evals)``: a string ends the run there (``row["stopped"]``, checkpointed).
    ``flops_per_token``: the step's arithmetic per token, counted in ``utils.work`` (the stage's
    FLOP bound in ``record.json``).

    Writes ``<out_dir>/checkpoints``, ``<out_dir>/tensorboard`` and (rank 0)
    ``<out_dir>/<name>_summary.json``. Returns: steps, tokens, tokens_this_run, resumed_from_step,
    first_loss, final_loss, history (per step: step, loss, the objective's metrics, lr, grad_norm,
    tokens so far, step_s), tokens_per_s, wall_s, optimizer, checkpoint, tensorboard; the student
    in eval mode."""
    say = log or _log.info
    out = Path(out_dir)
    par = Parallel.detect()
    if par.pp_size > 1:
        raise ValueError(
            f"{name} runs without pipeline parallelism (forward_logits needs every layer on one "
            f"rank); set cluster.pp=1 (or cluster.stage_layouts.{name}.pp=1)"
        )
    if par.is_rank0:
        out.mkdir(parents=True, exist_ok=True)
    steps = num_steps(cfg)
    torch.manual_seed(seed)
    student.train()
    if init_from:
        # before the optimizer: Megatron's keeps its own (fp32 main) copies of the parameters
        from autocompress_nemo.models.dist_checkpoint import load_checkpoint

        it = load_checkpoint(student, init_from)
        say(f"{name}: student weights from the Megatron checkpoint {init_from} (iteration {it})")
    opt = build_optimizer(optimizer, student, cfg, steps, par) if isinstance(optimizer, str) else optimizer
    store = _store(student, opt, objective, cfg, out, par, steps, seed, name)
    start, history = _resume(student, opt, store, steps, name, say)
    stopped = next((r["stopped"] for r in history if r.get("stopped")), None)
    if stopped:
        say(f"{name}: stopped at step {start} in an earlier run ({stopped})")
    run = _Run(student, objective, opt, store, par, cfg, steps, name, say, history, micro_batch_size, flops_per_token)
    run.evaluate, run.eval_every, run.should_stop = evaluate, eval_every, should_stop
    mon = run.mon = Monitor(out, cfg, steps, start, enabled=par.is_rank0, name=name)
    if objective.setup is not None:
        objective.setup()
    t0 = time.perf_counter()
    try:
        for step in range(start, start if stopped else steps):
            stopped = run.step(step, batch_at(step))
            if stopped:
                say(f"{name}: stopping after step {step + 1}/{steps}: {stopped}")
                break
    finally:
        mon.close()
        if objective.teardown is not None:
            objective.teardown()
    student.eval()
    return _result(out, run, start, stopped, time.perf_counter() - t0)


@dataclass
class _Run:
    """What the steps of one ``train`` call share, and one step of it."""

    student: torch.nn.Module
    objective: Objective
    opt: Any
    store: CheckpointStore
    par: Parallel
    cfg: Any
    steps: int
    name: str
    say: Callable[[str], None]
    history: list[dict[str, Any]]
    micro_batch_size: int | None = None
    flops_per_token: float = 0.0
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None
    eval_every: int = 0
    should_stop: Callable[[list[dict[str, Any]]], str | None] | None = None
    mon: Any = None
    tokens_run: int = 0
    last_ckpt: Path | None = None

    def step(self, step: int, x_BT: torch.Tensor) -> str | None:
        """Train on the step's global batch, record its row, checkpoint when due; why the run stops here, if it does."""
        t_step = time.perf_counter()
        rows_BT = _local_rows(x_BT, self.par, int(self.cfg.batch_size), self.name)
        row = _step(self.student, self.objective, self.opt, rows_BT, step, self.name, self.micro_batch_size, self.par)
        n_tok = int(x_BT.numel())
        self.tokens_run += n_tok
        work.add(self.flops_per_token * n_tok / self.par.dp_size)
        row.update(
            tokens=(self.history[-1]["tokens"] if self.history else 0) + n_tok, step_s=time.perf_counter() - t_step
        )
        done = step + 1
        why = self._evaluate(row, done)
        if why is None and self.objective.stop is not None and done < self.steps:
            why = self.objective.stop([*self.history, row])
        if why:
            row["stopped"] = why
        self.history.append(row)
        self.mon.update(row, n_tok)
        every = int(opt_field(self.cfg, "checkpoint_every", 0))
        if done == self.steps or why or (every > 0 and done % every == 0):
            self.last_ckpt = _save(self.store, self.student, self.opt, done, self.history)
        return why or None

    def _evaluate(self, row: dict[str, Any], done: int) -> str | None:
        """The held-out evaluation when due (recorded in ``row["eval"]``) and ``should_stop``'s verdict on it."""
        if self.evaluate is None or not (done == self.steps or (self.eval_every > 0 and done % self.eval_every == 0)):
            return None
        row["eval"] = {**self.evaluate(self.student), "tokens": row["tokens"]}
        self.student.train()
        self.say(f"{self.name}: step {done}/{self.steps}, {row['tokens']:,} tokens: " + _fmt(row["eval"]))
        if self.should_stop is None:
            return None
        return self.should_stop([r["eval"] for r in [*self.history, row] if "eval" in r])


def _store(
    student: torch.nn.Module,
    opt: Any,
    objective: Objective,
    cfg: Any,
    out: Path,
    par: Parallel,
    steps: int,
    seed: int,
    name: str,
) -> CheckpointStore:
    """The run's checkpoints, keyed by everything a resumed run must share."""
    fp = _fingerprint(cfg, steps, seed, opt.name, objective.kind == "lm")
    if objective.kind not in ("kd", "lm"):  # (kd / lm: the keys of checkpoints written before the objective)
        fp.update(loss=objective.kind, **objective.fingerprint)
    return CheckpointStore(
        out / "checkpoints",
        par,
        fp,
        keep=int(opt_field(cfg, "keep_checkpoints", 2)),
        dist=DistState(student, opt, par) if dist_supports(student, opt) else None,
        name=name,
    )


def _resume(
    student: torch.nn.Module, opt: Any, store: CheckpointStore, steps: int, name: str, say: Callable[[str], None]
) -> tuple[int, list[dict[str, Any]]]:
    """``(start step, history)`` from the latest checkpoint; ``(0, [])`` without one, or when its
    weights are not finite (a run that went NaN: resuming it would only repeat that)."""
    state = store.load(log=say)  # torch_dist: model, optimizer and RNG already set
    if state is None:
        return 0, []
    if "model" in state:
        bad = [
            k
            for k, v in state["model"].items()
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
        ]
        if bad:
            say(f"{name}: checkpoint {store.root} holds non-finite weights ({bad[0]}); starting from step 0")
            return 0, []
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
    start = int(state["step"])
    say(f"{name}: resumed from step {start}/{steps} ({store.root})")
    return start, list(state["history"])


def _step(
    student: torch.nn.Module,
    objective: Objective,
    opt: Any,
    rows_BT: torch.Tensor,
    step: int,
    name: str,
    micro_batch_size: int | None,
    par: Parallel,
) -> dict[str, Any]:
    """One optimizer step over this rank's rows in micro-batches; its history row (without tokens)."""
    if objective.begin_step is not None:
        objective.begin_step(step)
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
    if not math.isfinite(loss_mean) and not getattr(opt, "skips_nonfinite", False):
        raise FloatingPointError(f"{name} step {step}: loss is {loss_mean}; lower distill.lr")
    row = {
        "step": step,
        "loss": loss_mean,
        **{k: par.mean_over_dp(v) for k, v in sums.items()},
        "lr": opt.lr,
        "grad_norm": grad_norm,
    }
    if objective.extras is not None:
        row.update(objective.extras())
    return row


def _save(store: CheckpointStore, student: torch.nn.Module, opt: Any, done: int, history: list[dict[str, Any]]) -> Path:
    full = store.dist is None  # torch_dist: model, optimizer, RNG from store.dist
    with ctrl_c_deferred():  # a Ctrl-C lands after the checkpoint is whole
        return store.save(
            done,
            {
                "model": student.state_dict() if full else None,
                "optimizer": opt.state_dict() if full else None,
                "rng": rng_state() if full else None,
                "step": done,
                "history": history,
            },
        )


def _result(out: Path, run: _Run, start: int, stopped: str | None, wall: float) -> dict[str, Any]:
    store, par, history, steps, tokens_run, last_ckpt = (
        run.store,
        run.par,
        run.history,
        run.steps,
        run.tokens_run,
        run.last_ckpt,
    )
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
        "loss_kind": run.objective.kind,
        "history": history,
        "tokens_per_s": tokens_run / wall if wall > 0 and tokens_run else 0.0,
        "wall_s": wall,
        "optimizer": run.opt.name,
        "world": par.layout,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "tensorboard": str(out / "tensorboard"),
    }
    if par.is_rank0:
        write_json_atomic(out / f"{run.name}_summary.json", {k: v for k, v in result.items() if k != "history"})
    run.say(
        f"{run.name}: {len(history)}/{steps} steps, {result['tokens']} tokens, loss {result['first_loss']} -> {result['final_loss']}, "
        f"{result['tokens_per_s']:.0f} tok/s this run"
    )
    return result

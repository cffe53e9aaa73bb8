"""Optimizers of recovery distillation, behind one small interface.

- ``TorchAdamW`` (CPU, or any ``torch.nn.Module``): ``torch.optim.AdamW``; the schedule of
  ``schedule.lr_at`` is written into the param groups before each step. Under
  torch.distributed the gradients are reduced as Megatron's DDP reduces them
  (``reduce_gradients``, with ``dp`` the data-parallel size):

  * replicated (dense) parameters: ``g <- all_reduce_DP(g) / dp``;
  * routed-expert parameters under expert parallelism (Megatron marks them
    ``allreduce=False``): each EP rank holds other experts, which already received the tokens
    of every rank of their EP group through the token dispatcher, so
    ``g <- all_reduce_EDP(g) / dp`` over the *expert*-data-parallel group (size
    ``dp / ep`` at TP=1), never summed with another rank's experts;
  * parameters marked ``sequence_parallel`` (Transformer Engine norms) are first summed over
    the tensor-parallel group, as Megatron's ``finalize_model_grads`` does.

  Clipping uses the global norm ``sqrt(sum_dense g^2 + sum_expert g^2)`` (``global_grad_norm``):
  dense TP shards summed over TP (replicated parameters counted once), expert shards summed over
  the expert tensor-and-model-parallel group (each expert counted once).
- ``MegatronAdam`` (GPU, Megatron model): Megatron's ``DistributedDataParallel`` wrapper,
  ``get_megatron_optimizer`` (Adam, decoupled weight decay, clipping, fp16/bf16 master
  weights) and ``OptimizerParamScheduler``; ``finalize_model_grads`` does the DP
  all-reduce. Megatron's DDP and optimizer allocate CUDA tensors, so this path needs CUDA.

Both expose ``zero_grad()``, ``step(step) -> grad_norm``, ``lr``, ``state_dict()`` and
``load_state_dict()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autocompress_nemo.distill.schedule import lr_at, megatron_scheduler


def opt_field(cfg: Any, key: str, default: Any) -> Any:
    """``cfg.key`` or ``default`` (fields beyond ``DistillConfig``'s own are optional)."""
    try:
        v = getattr(cfg, key)
    except (AttributeError, KeyError):
        return default
    return default if v is None else v


@dataclass
class Parallel:
    """Where this process sits: data-, tensor-, pipeline- and expert-parallel ranks and groups.

    ``dp_*``: the dense data-parallel group (world / (TP x PP)); ``ep_*``: the expert-model-parallel
    group (ranks holding different routed experts); ``edp_*``: the expert-data-parallel group (ranks
    holding the same experts, world / (ETP x EP x PP)); ``etp_*``: expert tensor parallelism;
    ``expert_mp_group``: ETP x EP (every expert shard once). Without EP the expert groups equal the
    dense ones."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    edp_rank: int = 0
    edp_size: int = 1
    edp_group: Any = None
    etp_rank: int = 0
    etp_size: int = 1
    expert_mp_group: Any = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def writes_checkpoint(self) -> bool:
        """One copy of each model-parallel shard: the (expert-)data-parallel rank 0 of every
        TP/EP/PP group. Under EP the shard is ``(tp, ep, pp)``: rank ``ep`` holds its own experts,
        so the expert-data-parallel rank decides (the dense parameters are the same on all)."""
        return self.dp_rank == 0 if self.ep_size == 1 else self.edp_rank == 0

    @property
    def shard_name(self) -> str:
        """``mp_tp{tp}_pp{pp}``; under EP ``mp_tp{tp}_ep{ep}_pp{pp}`` (one file per expert shard)."""
        ep = f"_ep{self.ep_rank:02d}" if self.ep_size > 1 else ""
        return f"mp_tp{self.tp_rank:02d}{ep}_pp{self.pp_rank:03d}"

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp_size, "tp": self.tp_size, "pp": self.pp_size, "ep": self.ep_size}

    @classmethod
    def detect(cls) -> Parallel:
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        p = cls(rank=dist.get_rank(), world=dist.get_world_size())
        try:
            from megatron.core import parallel_state as ps

            megatron_up = ps.model_parallel_is_initialized()
        except Exception:  # noqa: BLE001 - megatron absent or broken: plain data parallel
            megatron_up = False
        if megatron_up:
            p.dp_rank, p.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            p.dp_group = ps.get_data_parallel_group()
            p.tp_rank, p.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            p.tp_group = ps.get_tensor_model_parallel_group()
            p.pp_rank, p.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
            p.ep_rank, p.ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
            p.ep_group = ps.get_expert_model_parallel_group()
            p.edp_group = ps.get_expert_data_parallel_group(with_gtp_remat=False)
            p.edp_rank, p.edp_size = p.edp_group.rank(), p.edp_group.size()
            p.etp_rank, p.etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            p.expert_mp_group = ps.get_expert_tensor_and_model_parallel_group()
        else:  # every process is a data-parallel replica
            p.dp_rank, p.dp_size = p.rank, p.world
            p.edp_rank, p.edp_size = p.rank, p.world
        return p

    def mean_over_dp(self, value: float) -> float:
        if self.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return float(t[0]) / self.dp_size

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def _is_tp_shard(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def is_expert_parallel(p: torch.nn.Parameter) -> bool:
    """A routed-expert parameter sharded over EP: Megatron's ``allreduce=False`` marking (set when
    ``expert_model_parallel_size > 1`` or expert TP differs from TP)."""
    return not getattr(p, "allreduce", True)


def reduce_gradients(params: list[torch.nn.Parameter], par: Parallel) -> None:
    """Megatron DDP's gradient reduction (module docstring): sequence-parallel parameters summed over
    TP; dense ``all_reduce_DP(g) / dp``; EP-sharded experts ``all_reduce_EDP(g) / dp``. A missing
    gradient becomes zeros (every rank must join every collective)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if par.tp_size > 1 and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=par.tp_group)
        if par.dp_size == 1:
            continue
        if is_expert_parallel(p):
            if par.edp_size > 1:
                dist.all_reduce(p.grad, group=par.edp_group)
        else:
            dist.all_reduce(p.grad, group=par.dp_group)
        p.grad.div_(par.dp_size)


def global_grad_norm(params: list[torch.nn.Parameter], par: Parallel) -> float:
    """L2 norm of the full (unsharded) gradient, ``sqrt(sum_dense g^2 + sum_expert g^2)``: dense TP
    shards summed over TP, replicated parameters counted once (TP rank 0); EP-sharded experts summed
    over ETP x EP, expert-TP-replicated ones counted once (ETP rank 0)."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if is_expert_parallel(p):
            if par.etp_size == 1 or _is_tp_shard(p) or par.etp_rank == 0:
                expert += sq
        elif par.tp_size == 1 or _is_tp_shard(p) or par.tp_rank == 0:
            dense += sq
    if par.tp_size > 1:
        dist.all_reduce(dense, group=par.tp_group)
    if par.ep_size * par.etp_size > 1 and par.expert_mp_group is not None:
        dist.all_reduce(expert, group=par.expert_mp_group)
    return math.sqrt(float(dense + expert))


class TorchAdamW:
    """Plain PyTorch AdamW with the warm-up + cosine schedule and DP/TP/EP gradient handling."""

    name = "torch.optim.AdamW"

    def __init__(self, model: torch.nn.Module, cfg: Any, total_steps: int, par: Parallel) -> None:
        self.model, self.par, self.total_steps = model, par, total_steps
        self.lr_peak, self.min_lr = float(cfg.lr), float(cfg.min_lr)
        self.warmup = int(cfg.warmup_steps)
        self.clip = float(opt_field(cfg, "grad_clip", 1.0))
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("distill: the student has no trainable parameters (all requires_grad=False)")
        wd = float(opt_field(cfg, "weight_decay", 0.0))
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # norms and biases: no weight decay
        groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
        betas = (float(opt_field(cfg, "adam_beta1", 0.9)), float(opt_field(cfg, "adam_beta2", 0.95)))
        self.opt = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=self.lr_peak,
            betas=betas,
            eps=float(opt_field(cfg, "adam_eps", 1e-8)),
        )
        self.lr = 0.0

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _reduce_grads(self) -> None:
        reduce_gradients(self.params, self.par)

    def grad_norm(self) -> float:
        """``global_grad_norm``: the norm of the full gradient, every shard counted once."""
        return global_grad_norm(self.params, self.par)

    def step(self, step: int) -> float:
        self._reduce_grads()
        norm = self.grad_norm()
        if self.clip > 0 and norm > self.clip:
            coef = self.clip / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.lr = lr_at(
            step, lr=self.lr_peak, min_lr=self.min_lr, warmup_steps=self.warmup, total_steps=self.total_steps
        )
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        self.opt.step()
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.name:
            raise ValueError(
                f"checkpoint optimizer is {sd.get('kind')!r}, this run uses {self.name!r}; "
                "resume with the same optimizer (distill optimizer='torch' or 'megatron')"
            )
        self.opt.load_state_dict(sd["optimizer"])


class MegatronAdam:
    """Megatron's DDP + ``get_megatron_optimizer`` + ``OptimizerParamScheduler`` (needs CUDA)."""

    name = "megatron.core.optimizer"

    def __init__(self, model: torch.nn.Module, cfg: Any, total_steps: int, par: Parallel) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the Megatron optimizer path needs CUDA (Megatron's DDP allocates CUDA buffers); "
                "use optimizer='torch' on this machine"
            )
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        mcfg: Any = model.config
        wd = float(opt_field(cfg, "weight_decay", 0.0))
        self.par = par
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.ddp = DistributedDataParallel(config=mcfg, ddp_config=ddp_cfg, module=model)
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=float(cfg.lr),
            min_lr=float(cfg.min_lr),
            weight_decay=wd,
            adam_beta1=float(opt_field(cfg, "adam_beta1", 0.9)),
            adam_beta2=float(opt_field(cfg, "adam_beta2", 0.95)),
            adam_eps=float(opt_field(cfg, "adam_eps", 1e-8)),
            clip_grad=float(opt_field(cfg, "grad_clip", 1.0)),
            bf16=bool(mcfg.bf16),
            fp16=bool(mcfg.fp16),
            params_dtype=mcfg.params_dtype,
            use_distributed_optimizer=False,
        )
        self.opt = get_megatron_optimizer(ocfg, [self.ddp])
        self.sched = megatron_scheduler(
            self.opt,
            lr=float(cfg.lr),
            min_lr=float(cfg.min_lr),
            warmup_steps=int(cfg.warmup_steps),
            total_steps=total_steps,
            weight_decay=wd,
        )
        self.lr = 0.0

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, step: int) -> float:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])  # DP all-reduce (+ sequence-parallel / embedding grads)
        self.sched.num_steps = step  # idempotent on resume: the scheduler then holds lr_at(step)
        self.sched.step(increment=1)
        self.lr = float(self.opt.param_groups[0]["lr"])
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise FloatingPointError(
                f"distill step {step}: Megatron optimizer skipped the update "
                "(inf/nan gradients); lower distill.lr or use bf16 instead of fp16"
            )
        return float(grad_norm or 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.name:
            raise ValueError(
                f"checkpoint optimizer is {sd.get('kind')!r}, this run uses {self.name!r}; "
                "resume with the same optimizer (distill optimizer='torch' or 'megatron')"
            )
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])


def build_optimizer(kind: str, model: torch.nn.Module, cfg: Any, total_steps: int, par: Parallel) -> Any:
    """``kind``: ``torch``, ``megatron`` or ``auto`` (Megatron's when CUDA is present and the
    student is a Megatron module, else torch's)."""
    if kind == "auto":
        is_megatron = hasattr(model, "config") and type(model).__module__.startswith("megatron")
        kind = "megatron" if torch.cuda.is_available() and is_megatron else "torch"
    if kind == "torch":
        return TorchAdamW(model, cfg, total_steps, par)
    if kind == "megatron":
        return MegatronAdam(model, cfg, total_steps, par)
    raise ValueError(f"distill optimizer {kind!r}: use 'auto', 'torch' or 'megatron'")

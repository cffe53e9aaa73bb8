"""The distillation's resumable checkpoint as a Megatron-LM distributed checkpoint (torch_dist).

Under ``<out_dir>/checkpoints`` (``CheckpointStore``), Megatron-LM's layout::

    latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint ("4")
    iter_0000004/                       metadata.json, .metadata (+ common state), __<rank>_0.distcp
    latest.json                         this project's record: step, dir, layout, config fingerprint

One ``dist_checkpointing.save`` of::

    model            model.sharded_state_dict() (the Transformer Engine keys, TP sharding described)
    optimizer        torch.optim.AdamW's state sharded like the parameters it belongs to
                     (megatron.core.dist_checkpointing.optimizer: get_param_id_to_sharded_param_map +
                     optim_state_to_sharding_state, keys optimizer.state.exp_avg.<param key> ...); its
                     per-parameter step as one common_step (as Megatron's FP32Optimizer stores it);
                     the param groups (lr, betas, weight decay) in the common state
    rng_state        ShardedObject (world,), one entry per rank: Python, NumPy, torch, CUDA and
                     Megatron's tensor-parallel tracker states (distill.checkpoint.rng_state)
    opt_param_scheduler  {"num_steps": step, ...}: the schedule is a function of the step
                     (distill.schedule.lr_at), so the step is its whole state
    iteration, checkpoint_version, args   what Megatron-LM's load_checkpoint reads first
    distill          {"step", "history"}: this project's run state (common: rank 0's)

Loading builds the same sharded dict from fresh tensors, so nothing of the live model or optimizer
changes until every tensor was read (a damaged checkpoint leaves the run as it was: it starts over).
Megatron models (``sharded_state_dict``) with ``optim.TorchAdamW`` only (``supports``); Megatron's own
optimizer (GPU) and plain ``torch.nn.Module`` students keep the ``torch.save`` shards of
``distill.checkpoint``.
"""

from __future__ import annotations

import argparse
import dataclasses
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.distill.checkpoint import rng_state, set_rng_state
from autocompress_nemo.distill.optim import Parallel, TorchAdamW
from autocompress_nemo.models.dist_checkpoint import CHECKPOINT_VERSION, unwrap

FORMAT = "torch_dist"


def supports(student: torch.nn.Module, opt: Any) -> bool:
    """A Megatron model (``sharded_state_dict``) trained by ``TorchAdamW``."""
    return callable(getattr(unwrap(student), "sharded_state_dict", None)) and isinstance(opt, TorchAdamW)


class DistState:
    """Save / load model + optimizer + RNG + step of a distillation as one torch_dist checkpoint."""

    def __init__(self, student: torch.nn.Module, opt: TorchAdamW, par: Parallel) -> None:
        self.model = unwrap(student)
        self.opt = opt
        self.par = par

    # -- the sharded state dict ---------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return list(chain.from_iterable(g["params"] for g in self.opt.opt.param_groups))

    def _optimizer_state(self, model_sd: dict, fresh: bool) -> dict[str, Any]:
        """AdamW's state dict with its tensors as ShardedTensors of ``optimizer.state.<name>.<param key>``.
        ``fresh``: a template of new tensors (loading), the live state untouched."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        params = self._params()
        osd = self.opt.opt.state_dict()
        if fresh:
            osd = {
                "state": {
                    i: {"step": torch.zeros(()), "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
                    for i, p in enumerate(params)
                },
                "param_groups": osd["param_groups"],
            }
        steps = {float(s["step"]) for s in osd["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"distill: AdamW's step differs per parameter ({sorted(steps)}); cannot checkpoint it")
        missing = [i for i in range(len(params)) if i not in osd["state"]]
        if missing:
            raise ValueError(
                f"distill: {len(missing)} parameters have no AdamW state (no gradient yet); "
                "a checkpoint is written after an optimizer step"
            )
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        if len(id_map) != len(params):
            raise ValueError(
                f"distill: {len(params) - len(id_map)} of the optimizer's {len(params)} parameters are not in "
                "the model's sharded_state_dict; the optimizer state cannot be sharded like the model"
            )
        step = next(iter(osd["state"].values()))["step"]
        optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
        osd["state"]["common_step"] = step.clone() if torch.is_tensor(step) else step
        return osd

    def _rng(self, fresh: bool) -> Any:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        state = None if fresh else rng_state()
        return ShardedObject("rng_state", state, (self.par.world,), (self.par.rank,), replica_id=0)

    def sharded_state_dict(self, fresh: bool) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        model_sd = self.model.sharded_state_dict()
        osd = self._optimizer_state(model_sd, fresh)  # before the model tensors are swapped: by identity
        if fresh:

            def new_tensor(x: Any) -> Any:
                if isinstance(x, ShardedBase) and torch.is_tensor(getattr(x, "data", None)):
                    return dataclasses.replace(x, data=torch.empty_like(x.data))
                return x

            dict_list_map_inplace(new_tensor, model_sd)
        return {"model": model_sd, "optimizer": osd, "rng_state": self._rng(fresh)}

    # -- save / load ----------------------------------------------------------------------------
    def save(self, ckpt: Path, step: int, history: list[dict[str, Any]]) -> None:
        """Collective: every rank writes its shards of step ``step`` into ``ckpt`` (an ``iter_*``
        directory, emptied first: a previous attempt may have been killed half-way)."""
        import shutil

        from autocompress_nemo.models import compat_cpu

        compat_cpu.apply()
        from megatron.core import dist_checkpointing

        if self.par.is_rank0:
            if ckpt.exists():
                shutil.rmtree(ckpt)
            ckpt.mkdir(parents=True)
        self.par.barrier()
        if self.par.world > 1:  # the common state is rank 0's: the same history on every rank (wall times differ)
            box = [history]
            torch.distributed.broadcast_object_list(box, src=0)
            history = box[0]
        state = self.sharded_state_dict(fresh=False)
        state.update(
            iteration=step,
            checkpoint_version=CHECKPOINT_VERSION,
            args=self._args(),
            opt_param_scheduler=self._scheduler(step),
            distill={"step": step, "history": history},
        )
        dist_checkpointing.save(state, str(ckpt))

    def read(self, ckpt: Path, rng: bool = True) -> dict[str, Any]:
        """Collective: read ``ckpt`` into new tensors (nothing live changes). ``rng=False``: leave
        the RNG states out (a checkpoint of another world size holds another rank count). Raises
        when the checkpoint cannot be read."""
        from autocompress_nemo.models import compat_cpu

        compat_cpu.apply()
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        if not (ckpt / "metadata.json").is_file():
            raise FileNotFoundError(f"{ckpt / 'metadata.json'} missing")
        request = self.sharded_state_dict(fresh=True)
        if not rng:
            del request["rng_state"]
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return dist_checkpointing.load(request, str(ckpt), strict=StrictHandling.RAISE_UNEXPECTED)
        except CheckpointException as e:  # a BaseException: named as the Exception it wraps
            failed = {r: f[0] if isinstance(f, tuple) else f for r, f in e.failures.items()}
            said = "; ".join(f"rank {r}: {type(x).__name__} {str(x)[:80]}".rstrip() for r, x in sorted(failed.items()))
            raise OSError(f"torch_dist read failed ({said})") from None

    def apply(self, got: dict[str, Any]) -> dict[str, Any]:
        """Set the model's weights, AdamW's state and (when read) this rank's RNG states from ``read``'s
        result; returns ``{"step", "history"}``."""
        osd = got["optimizer"]
        step = osd["state"].pop("common_step")
        for s in osd["state"].values():
            s["step"] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
        self.model.load_state_dict(got["model"], strict=False)  # _extra_state entries: TE modules only
        self.opt.opt.load_state_dict(osd)
        if "rng_state" in got:
            set_rng_state(got["rng_state"])
        run = got["distill"]
        return {"step": int(run["step"]), "history": list(run["history"])}

    def _args(self) -> argparse.Namespace:
        """The ``args`` Megatron-LM's ``load_checkpoint`` reads from a torch_dist checkpoint."""
        return argparse.Namespace(
            tensor_model_parallel_size=self.par.tp_size,
            pipeline_model_parallel_size=self.par.pp_size,
            expert_model_parallel_size=self.par.ep_size,
            ckpt_format=FORMAT,
            use_dist_ckpt=True,
            no_save_optim=False,
            no_save_rng=False,
            optimizer="adam",
        )

    def _scheduler(self, step: int) -> dict[str, Any]:
        o = self.opt
        return {
            "num_steps": step,
            "max_lr": o.lr_peak,
            "min_lr": o.min_lr,
            "lr_warmup_steps": o.warmup,
            "lr_decay_steps": o.total_steps,
            "lr_decay_style": "cosine",
        }

"""Resumable distillation checkpoints, written atomically.

Megatron students trained by ``optim.TorchAdamW``: a Megatron-LM distributed checkpoint
(``distill.dist_state``: model, sharded AdamW state, RNG states, step) under
``<out_dir>/checkpoints``::

    latest_checkpointed_iteration.txt   Megatron-LM's tracker: the newest complete iteration ("50")
    iter_0000050/                       torch_dist: metadata.json, .metadata, __<rank>_0.distcp
    latest.json                         {"step": 50, "dir": "iter_0000050", "format": "torch_dist", "tp": 1, ...}

Any other student / optimizer (Megatron's optimizer on GPU, a plain ``torch.nn.Module``):
``torch.save`` shards::

    step_000050/mp_tp00_pp000.pt   model + optimizer (+ scheduler) + RNG states + history, one
                                   file per model-parallel shard, written by DP rank 0 of each
    step_000050/mp_tp00_ep01_pp000.pt  under expert parallelism: one file per (TP, EP, PP) shard,
                                   written by expert-DP rank 0 of each (EP rank e holds its own experts)
    latest.json                    {"step": 50, "dir": "step_000050", "tp": 1, "pp": 1, "ep": 1, "fingerprint": ...}

Every file is written to a temporary name and renamed into place (the torch_dist directory is
written whole before anything names it); ``latest.json`` (and the tracker) are written by rank 0
only after every shard of that step exists (a barrier), so a job killed at any moment leaves
either the previous complete checkpoint or the new one, never a half one. Older step
directories are removed after ``latest.json`` moves on.

RNG states saved: Python ``random``, NumPy, torch CPU, CUDA (all devices, when present) and
Megatron's tensor-parallel RNG tracker (when Megatron's parallel state is up).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autocompress_nemo.distill.optim import Parallel
from autocompress_nemo.utils.artifacts import set_aside, write_json_atomic, write_text_atomic


def rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None:
        st["megatron_tracker"] = tracker.get_states()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    tracker = _megatron_tracker()
    if tracker is not None and "megatron_tracker" in st:
        tracker.set_states(st["megatron_tracker"])


def _megatron_tracker() -> Any:
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if not ps.model_parallel_is_initialized():
            return None
        return get_cuda_rng_tracker()
    except Exception:  # noqa: BLE001 - no megatron: nothing to save
        return None


def save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # never a half checkpoint left behind
        from autocompress_nemo.rundir import disk_error

        if isinstance(e, RuntimeError) and disk_error(e):  # torch reports a full disk as RuntimeError
            raise OSError(disk_error(e), os.strerror(disk_error(e)), str(path)) from None
        raise


class CheckpointStore:
    """Save / find / load the latest distillation checkpoint of this run."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        par: Parallel,
        fingerprint: dict[str, Any],
        keep: int = 2,
        dist: Any = None,
        name: str = "distill",
    ):
        """``dist``: a ``distill.dist_state.DistState`` (the torch_dist format), else ``torch.save``
        shards. ``name``: the stage the messages name."""
        self.root = Path(root)
        self.par = par
        self.fingerprint = fingerprint
        self.keep = max(1, keep)
        self.dist = dist
        self.name = name

    @property
    def format(self) -> str:
        return "torch_dist" if self.dist is not None else "torch"

    @property
    def shard_name(self) -> str:
        return f"{self.par.shard_name}.pt"

    def latest(self) -> dict[str, Any] | None:
        p = self.root / "latest.json"
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write this rank's shard of step ``step`` and (rank 0) move ``latest.json`` to it.
        torch_dist: ``state`` needs only ``history`` (model, optimizer and RNG come from ``dist``)."""
        if self.dist is not None:
            from autocompress_nemo.models.dist_checkpoint import iteration_dir

            step_dir = self.root / iteration_dir(step)
            self.dist.save(step_dir, step, state["history"])
        else:
            step_dir = self.root / f"step_{step:06d}"
            if self.par.writes_checkpoint:
                save_atomic(state, step_dir / self.shard_name)
        self.par.barrier()
        if self.par.is_rank0:
            if self.dist is not None:  # Megatron-LM's tracker, once the iteration is whole
                from autocompress_nemo.models.dist_checkpoint import TRACKER

                write_text_atomic(self.root / TRACKER, str(step))
            write_json_atomic(
                self.root / "latest.json",
                {
                    "step": step,
                    "dir": step_dir.name,
                    "format": self.format,
                    "tp": self.par.tp_size,
                    "pp": self.par.pp_size,
                    "ep": self.par.ep_size,
                    "dp": self.par.dp_size,
                    "fingerprint": self.fingerprint,
                },
            )
            old = sorted(
                (d for d in [*self.root.glob("step_*"), *self.root.glob("iter_*")] if d.is_dir() and d != step_dir),
                key=lambda d: int(d.name.split("_")[1]),
            )
            for d in old[: max(0, len(old) - (self.keep - 1))]:
                shutil.rmtree(d, ignore_errors=True)
        self.par.barrier()
        return step_dir

    def load(self, log: Any = print) -> dict[str, Any] | None:
        """This rank's shard of the latest checkpoint, or ``None`` (nothing to resume from).
        torch_dist: the model, optimizer and RNG states are set in place and ``{"step", "history"}``
        returned.

        A checkpoint of another configuration (different steps, batch, learning rate...) is
        not resumed: the run starts over and says why. A torch_dist checkpoint of another TP / EP
        size is resharded to this run's (every shard is described by its global offsets); one of
        another PP size, or a ``torch.save`` one of another layout, is an error that names the fix. A checkpoint that cannot be read (an unreadable
        ``latest.json``, a truncated or corrupted shard on any rank) is reported by path and set
        aside (``checkpoints.corrupt``): the run starts over.
        """
        meta = self.latest()
        if meta is None:
            latest = self.root / "latest.json"
            if latest.exists():
                self._set_aside(log, latest, "not readable JSON", sync=False)  # every rank reads the same file
            return None
        if meta.get("fingerprint") != self.fingerprint:
            log(
                f"{self.name}: checkpoint {self.root} was written for another configuration "
                f"({meta.get('fingerprint')} != {self.fingerprint}); starting from step 0"
            )
            return None
        here = (self.par.tp_size, self.par.pp_size, self.par.ep_size)
        there = (meta.get("tp"), meta.get("pp"), meta.get("ep", 1))
        reshard = self.dist is not None and meta.get("format") == self.format and there[1] == here[1]
        if there != here and reshard:  # torch_dist describes every shard: read it at this run's TP / EP
            log(
                f"{self.name}: checkpoint {self.root} was written with TP={there[0]} EP={there[2]}; resharding it "
                f"to TP={here[0]} EP={here[2]} (the RNG states of the other layout are not restored)"
            )
        elif there != here:
            raise ValueError(
                f"{self.name} checkpoint {self.root} was written with TP={meta.get('tp')} PP={meta.get('pp')} "
                f"EP={meta.get('ep', 1)}, this run has TP={self.par.tp_size} PP={self.par.pp_size} "
                f"EP={self.par.ep_size}: resume with the same cluster.tp/cluster.pp/cluster.ep, "
                f"or delete {self.root} to start over"
            )
        if meta.get("format", "torch") != self.format:
            log(
                f"{self.name}: checkpoint {self.root} is in the {meta.get('format', 'torch')} format, this run "
                f"writes {self.format}; starting from step 0"
            )
            return None
        if self.dist is not None:
            same = there == here and meta.get("dp") == self.par.dp_size
            return self._load_dist(log, self.root / str(meta.get("dir")), rng=same)
        path = self.root / str(meta.get("dir")) / self.shard_name
        state: dict[str, Any] | None = None
        why = ""
        if not path.is_file():
            why = "missing"
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
                lacking = [k for k in ("model", "optimizer", "rng", "step", "history") if k not in (state or {})]
                if lacking:
                    why, state = f"not a distillation checkpoint (no {', '.join(lacking)})", None
            except Exception as e:  # noqa: BLE001 - truncated / corrupted: start over, never crash on it
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        if not self._all_ranks(state is not None):  # every rank resumes, or none does
            self._set_aside(log, path, why or "a shard of another rank cannot be read")
            return None
        return state

    def _load_dist(self, log: Any, path: Path, rng: bool) -> dict[str, Any] | None:
        """Read on every rank, then set the states only when every rank could (else set aside)."""
        state: dict[str, Any] | None = None
        why = ""
        try:
            state = self.dist.read(path, rng=rng)
        except Exception as e:  # noqa: BLE001 - truncated / corrupted: start over, never crash on it
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        if not self._all_ranks(state is not None):  # nothing was set unless every tensor was read
            self._set_aside(log, path, why or "a shard of another rank cannot be read")
            return None
        return self.dist.apply(state)

    def _all_ranks(self, ok: bool) -> bool:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.par.world == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _set_aside(self, log: Any, path: Path, why: str, sync: bool = True) -> None:
        where = self.root.with_name(f"{self.root.name}.corrupt")
        if self.par.is_rank0 and self.root.exists():
            where = set_aside(self.root, "corrupt")
        if sync:
            self.par.barrier()
        log(f"{self.name}: checkpoint {path} cannot be read ({why}); set aside as {where}; starting from step 0")

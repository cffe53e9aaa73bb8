"""Initialize and tear down torch.distributed and Megatron's parallel state."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch

_OWNS_PROCESS_GROUP = False


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed backend {backend!r}: use 'gloo', 'nccl' or 'auto'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("distributed backend 'nccl' needs CUDA; this machine has none: use backend='gloo'")
    return backend


def is_initialized() -> bool:
    from megatron.core import parallel_state

    return torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    backend: str = "auto",
    seed: int = 1234,
    timeout_minutes: int = 10,
) -> None:
    """Initialize torch.distributed (if needed), Megatron's parallel state and RNG seeds.

    - torch.distributed: left alone if already initialized (torchrun, ``spawn``);
      otherwise from ``RANK``/``WORLD_SIZE``/``MASTER_*`` if set, else a world of one
      process on a free localhost port.
    - Megatron parallel state: TP x PP x EP over the world (re-initialized if it was
      initialized with other sizes). DP = world / (TP x PP).
    - seeds: ``torch.manual_seed(seed)`` and Megatron's ``model_parallel_cuda_manual_seed``
      (the tensor-parallel RNG tracker; on CPU the tracker of ``compat_cpu``).
    On CPU the compatibility patches (``models.compat_cpu.apply()``) are installed first.
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from autocompress_nemo.models import compat_cpu

    compat_cpu.apply()
    be = _resolve_backend(backend)
    if not torch.distributed.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if be == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend=be, timeout=timedelta(minutes=timeout_minutes))
        else:
            store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
            torch.distributed.init_process_group(
                backend=be, store=store, rank=0, world_size=1, timeout=timedelta(minutes=timeout_minutes)
            )
        _OWNS_PROCESS_GROUP = True
    ws = torch.distributed.get_world_size()
    if ws % (tp * pp) or tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"world size {ws} is not divisible by tp={tp} x pp={pp}: change cluster.tp / cluster.pp")
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
            and parallel_state.get_expert_model_parallel_world_size() == ep
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=(be == "gloo"),
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def teardown() -> None:
    """Destroy Megatron's parallel state, and the process group if ``init_distributed`` made it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWNS_PROCESS_GROUP = False


def tensor_parallel() -> tuple[Any, int, int]:
    """``(TP process group, TP rank, TP world size)``; ``(None, 0, 1)`` when Megatron's parallel
    state is not initialized (one process without ``init_distributed``)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 0, 1
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )

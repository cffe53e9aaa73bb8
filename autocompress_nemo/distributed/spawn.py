"""Run a function on N gloo processes (CPU) and collect what each rank returns.

Used by the ``distributed`` tests (TP=2 / EP=2 parity against one process)::

    results = spawn(fn, 2, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on each rank

Each rank has torch.distributed initialized (gloo, a free localhost port) before ``fn``
runs and torn down after. Return values must be picklable (tensors are fine); an
exception on any rank is raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from autocompress_nemo.distributed.state import free_port


def _dumps(obj: Any) -> bytes:
    # Plain bytes through the queue: torch's multiprocessing would share tensor storage
    # through file descriptors, which vanish when the child exits before the parent reads.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(b: bytes) -> Any:
    return torch.load(io.BytesIO(b), weights_only=False)


class SpawnError(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _worker(
    rank: int, world_size: int, port: int, threads: int, fn: Callable[..., Any], args: tuple, queue: Any
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
        queue.put((rank, "ok", _dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, timeout_s: float = 600) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be importable (a module-level function), as the processes are spawned.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, threads, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            r, status, payload = queue.get()
            if status == "ok":
                results[r] = _loads(payload)
            else:
                errors.append(f"--- rank {r} ---\n{payload}")
                break
        elif time.monotonic() > deadline:
            errors.append(f"timed out after {timeout_s}s")
            break
        elif any(p.exitcode not in (None, 0) for p in procs):
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            # a rank may have died without reporting (killed, segfault); give the queue a moment
            time.sleep(0.5)
            if queue.empty():
                errors.append(f"rank(s) exited without a result: {dead}")
                break
        else:
            time.sleep(0.05)
    if errors:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join(timeout=30)
    if errors:
        raise SpawnError("spawned rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]

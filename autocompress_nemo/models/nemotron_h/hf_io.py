"""Nemotron-H Hugging Face directories: import and export (uniform and Puzzle heterogeneous).

The state dict is Nemotron-H-named (``models/hybrid/names.py``: ``backbone.layers.{i}.mixer.*``,
one tensor per routed expert), the layout of the published checkpoints, which transformers
(``NemotronHForCausalLM``), vLLM and TensorRT-LLM load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, MoeBlock
from autocompress_nemo.models.hf_dir import read_hf_dir, write_hf_dir
from autocompress_nemo.models.hybrid.names import NEMOTRON_H
from autocompress_nemo.models.hybrid.state_dict import block_roles, megatron_to_hf
from autocompress_nemo.models.nemotron_h.config import export_spec, hf_config_from_spec, spec_from_hf_config


def compact_state_dict(spec: ArchSpec, sd: dict[str, torch.Tensor]) -> tuple[ArchSpec, dict[str, torch.Tensor]]:
    """Drop removed blocks and turn routed-expert-free MoE blocks into MLP blocks (``export_spec``),
    renaming the tensors of the blocks that move."""
    new_spec, index = export_spec(spec)
    n = NEMOTRON_H
    out = {k: sd[k] for k in (n.embed, n.final_norm, n.lm_head) if k in sd}
    for i, b in enumerate(spec.blocks):
        j = index[i]
        if j is None:
            continue
        as_mlp = isinstance(b, MoeBlock) and not (b.num_experts and b.expert_ffn)
        for role, e, _shape in block_roles(spec, b):
            new_role = role.removeprefix("shared_") if as_mlp else role
            out[n.key(j, new_role, e)] = sd[n.key(i, role, e)]
    return new_spec, out


def export_hf(
    spec: ArchSpec,
    model_or_sd: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
    engine: Any = "",
) -> Path | None:
    """Write ``spec`` (uniform: ``NemotronHForCausalLM``; heterogeneous: Puzzle format, with its
    ``auto_map`` configuration code) to ``out_dir``, written the way ``engine``'s loader reads it.

    ``model_or_sd`` is a Megatron model (collective over TP/EP: call on every rank; rank 0 writes)
    or a Nemotron-H-named state dict. Removed blocks are dropped (see ``config.py``); the written
    ``arch.json`` is the compacted spec. Returns the directory on the writing rank, else ``None``.
    """
    sd = dict(model_or_sd) if isinstance(model_or_sd, dict) else megatron_to_hf(spec, model_or_sd)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    new_spec, sd = compact_state_dict(spec, sd)
    if new_spec.tied_embeddings:
        # transformers' NemotronH never ties (``_tied_weights_keys = {}``, 5.24): a tied model's file
        # carries the LM head as a copy of the embedding (``load_hf`` drops it again)
        sd[NEMOTRON_H.lm_head] = sd[NEMOTRON_H.embed].clone()
    return write_hf_dir(out_dir, hf_config_from_spec(new_spec, engine), sd, new_spec, tokenizer, dtype)


def load_hf(path: str | os.PathLike[str], tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
    """``(ArchSpec, float32 Nemotron-H-named state dict, tokenizer or None)`` of a directory.

    Multi-token-prediction tensors (``mtp.*``) are not part of the spec and are dropped.
    """
    cfg, sd, tok = read_hf_dir(path, tokenizer)
    spec = spec_from_hf_config(cfg, name=Path(path).name)
    sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    if "model.embeddings.weight" in sd and NEMOTRON_H.embed not in sd:  # saved by transformers 5 (model. prefix)
        sd = {("backbone." + k.removeprefix("model.")) if k.startswith("model.") else k: v for k, v in sd.items()}
    n = NEMOTRON_H
    if spec.tied_embeddings and n.lm_head in sd and n.embed in sd and torch.equal(sd[n.lm_head], sd[n.embed]):
        del sd[n.lm_head]  # the copy export_hf writes for transformers
    return spec, sd, tok


import_hf = load_hf

"""Hugging Face safetensors directories: import (Llama / SmolLM2 / Qwen2 / Qwen3 / DeciLM) and export.

Export writes a uniform model as its family's own config (``LlamaConfig`` ...) and a
heterogeneous one DeciLM-style with ``block_configs`` (see ``arch/convert.py`` for the
format and its per-layer query-heads extension). ``load_hf`` reads both back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.convert import hf_config_from_spec, spec_from_hf_config
from autocompress_nemo.arch.spec import ArchSpec

SHARD_BYTES = 4 * 1024**3


def load_hf(path: str | os.PathLike[str], tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
    """``(ArchSpec, float32 HF state dict, tokenizer or None)`` of a HF model directory."""
    from safetensors.torch import load_file

    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {d}: not a Hugging Face model directory")
    cfg = json.loads(cfg_path.read_text())
    spec = spec_from_hf_config(cfg)
    if not spec.name:
        spec = spec.replace(name=d.name)
    index = d / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else sorted(p.name for p in d.glob("*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d} (PyTorch .bin checkpoints are not supported)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k: v.float() for k, v in load_file(str(d / f)).items()})
    tok = None
    if tokenizer and any((d / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
    return spec, sd, tok


import_hf = load_hf


def export_hf(
    spec: ArchSpec,
    model_or_sd: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path | None:
    """Write ``config.json`` + safetensors (+ tokenizer) for ``spec`` into ``out_dir``.

    ``model_or_sd`` is a Megatron model (then this is collective over the TP group: call
    it on every rank; rank 0 writes) or a HF Llama-named state dict. Returns the
    directory on the writing rank, ``None`` on the others. Tied embeddings: no ``lm_head``.
    """
    from safetensors.torch import save_file

    from autocompress_nemo.models.llama.state_dict_adapter import megatron_to_hf

    sd = dict(model_or_sd) if isinstance(model_or_sd, dict) else megatron_to_hf(spec, model_or_sd)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    if spec.tied_embeddings:
        sd.pop("lm_head.weight", None)
    cfg = hf_config_from_spec(spec)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(sd):
        t = sd[k].to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for j, shard in enumerate(shards):
            name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    (out / "arch.json").write_text(spec.to_json())
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out

"""A parent's shape read from its own files ("bring your own parent": ``model=hf`` / ``model=gguf``).

- a Hugging Face directory: ``config.json``, by ``model_type`` (:data:`HF_MODEL_TYPES`);
- a GGUF file: its metadata, read with the ``gguf`` package's ``GGUFReader``
  (:data:`GGUF_ARCHITECTURES`).

The shape comes back as an ``ArchSpec`` (the same readers the loaders use, so the config and the
loaded weights cannot disagree) and as the ``cfg.model`` fields that describe it
(:func:`model_fields`). A heterogeneous checkpoint (DeciLM ``block_configs``, a Puzzle Nemotron-H, a
``deci`` GGUF with per-layer widths, removed blocks) keeps its blocks in ``model.blocks`` (one dict
per block); the per-kind fields then hold the widest block of each kind.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import PATTERN_CHAR, ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock

HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "nemotron_h": "nemotron_h",
    "nemotron-nas": "llama",
    "nemotron_h_puzzle": "nemotron_h",
}
"""``config.json`` ``model_type`` -> the family whose importer and state-dict adapter read it
(``nemotron-nas``: DeciLM ``block_configs``, per-layer heads / KV groups / ffn and no-op blocks;
``nemotron_h_puzzle``: a Nemotron-H with per-block sizes)."""
GGUF_ARCHITECTURES = ("llama", "deci")
"""``general.architecture`` values the GGUF importer reads (``deci``: per-layer heads / KV heads / ffn)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_GGUF_FILE_TYPES = {0: "f32", 1: "f16", 32: "bf16"}


class ModelFileError(ValueError):
    """A parent whose shape or tokenizer cannot be read from its own files; says why and the fix."""


def _supported_hf() -> str:
    return ", ".join(sorted(HF_MODEL_TYPES))


def hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a Hugging Face directory as a dict."""
    d = Path(directory)
    f = d / "config.json"
    if not f.is_file():
        raise ModelFileError(
            f"{d} has no config.json: not a Hugging Face model directory; give model.source.path=<the directory "
            "that save_pretrained wrote>"
        )
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{f} is not readable JSON ({e}); download or save the model again") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{f} holds a {type(cfg).__name__}, not a JSON object; download the model again")
    return cfg


def hf_spec(directory: str | os.PathLike[str]) -> ArchSpec:
    """ArchSpec of a Hugging Face directory, from its ``config.json``."""
    d = Path(directory)
    cfg = hf_config(d)
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ModelFileError(
            f"{d / 'config.json'}: model_type {mt!r} is not supported; supported model_type values: "
            f"{_supported_hf()}; give a model of one of those families, or write its model YAML by hand"
        )
    try:
        if mt == "qwen3_moe":
            from autocompress_nemo.models.qwen3_moe.hf_io import spec_from_hf_config as read_moe

            spec = read_moe(cfg, name=d.name)
        elif mt in ("nemotron_h", "nemotron_h_puzzle"):
            from autocompress_nemo.models.nemotron_h.config import spec_from_hf_config as read_nh

            spec = read_nh(cfg, name=d.name)
        else:
            from autocompress_nemo.arch.convert import spec_from_hf_config

            spec = spec_from_hf_config(cfg)
    except KeyError as e:
        raise ModelFileError(f"{d / 'config.json'} ({mt}) lacks the field {e}; download the model again") from None
    except (ValueError, TypeError) as e:
        raise ModelFileError(f"{d / 'config.json'} ({mt}) cannot be read: {e}") from None
    return spec.replace(name=d.name)


def hf_dtype(directory: str | os.PathLike[str]) -> str:
    """The parameter dtype ``config.json`` records (``torch_dtype`` / ``dtype``), ``bf16`` if none."""
    cfg = hf_config(directory)
    return _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), "bf16")


def _gguf_reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelFileError(f"{path} is not a file; model.source.path must be the .gguf file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - GGUFReader raises ValueError, struct.error, IndexError ...
        raise ModelFileError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); give a complete .gguf file, "
            "or download it again"
        ) from None


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_spec(path: str | os.PathLike[str]) -> ArchSpec:
    """ArchSpec of a GGUF file, from its metadata (``general.architecture`` and its keys)."""
    from autocompress_nemo.models.llama.gguf_import import read_gguf_spec

    p = Path(path)
    reader = _gguf_reader(p)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            f"{p}: GGUF general.architecture {arch!r} is not supported; supported general.architecture "
            f"values: {', '.join(GGUF_ARCHITECTURES)}; convert the model to one of them, or give its Hugging Face "
            f"directory with model=hf (model_type: {_supported_hf()})"
        )
    try:
        spec = read_gguf_spec(reader, p)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{p}: GGUF metadata ({arch}) cannot be read: {e}") from None
    # GGUF stores these as float32: 1e-5 comes back as 9.9999997e-06; keep the number that was written
    return spec.replace(name=p.stem, norm_eps=_f32(spec.norm_eps), rope_theta=_f32(spec.rope_theta))


def _f32(x: float) -> float:
    import numpy as np

    return float(str(np.float32(x)))


def gguf_dtype(path: str | os.PathLike[str]) -> str:
    """``general.file_type`` as a model dtype (F32, F16, BF16); ``bf16`` for quantized files."""
    ft = _field(_gguf_reader(Path(path)), "general.file_type")
    return _GGUF_FILE_TYPES.get(int(ft) if ft is not None else -1, "bf16")


def tokenizer_problem(kind: str, path: Path) -> str | None:
    """Why the parent's tokenizer cannot come from ``path`` (``None`` when it can)."""
    if kind == "hf":
        if any((path / n).exists() for n in TOKENIZER_FILES):
            return None
        return (
            f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): the parent's tokenizer is read from its "
            "own directory; save it there with tokenizer.save_pretrained(<directory>)"
        )
    if _field(_gguf_reader(path), "tokenizer.ggml.tokens") is None:
        return (
            f"{path} holds no tokenizer (no tokenizer.ggml.tokens metadata): the parent's tokenizer is read "
            "from the GGUF itself; convert the model again with its tokenizer"
        )
    return None


def model_fields(spec: ArchSpec) -> dict[str, Any]:
    """The ``cfg.model`` shape fields of a parent.

    A uniform parent (every block of a kind alike, none removed) is described by the per-kind fields
    alone (``blocks`` empty). A heterogeneous one also gets ``blocks``, its blocks in ``ArchSpec``'s
    dict form, and the per-kind fields hold the widest block of each kind (what validation and the
    planner read); ``config/from_config.spec_from_model_config`` builds the parent from ``blocks``.
    """

    def widest(cls: type) -> Any:
        alive = [b for b in spec.blocks if isinstance(b, cls) and not b.removed]
        if not alive:
            return next((b for b in spec.blocks if isinstance(b, cls)), None)
        return max(alive, key=lambda b: tuple(v for v in dataclasses.astuple(b) if isinstance(v, int)))

    att, mlp, moe, mamba = widest(AttentionBlock), widest(MlpBlock), widest(MoeBlock), widest(MambaBlock)
    dense = spec.is_dense_layered() and spec.family in ("llama", "qwen2", "qwen3")
    out: dict[str, Any] = {
        "family": spec.family,
        "hidden": spec.hidden,
        "vocab": spec.vocab,
        "num_layers": spec.num_layers if dense else 0,
        "pattern": "" if dense else "".join(PATTERN_CHAR[b.kind] for b in spec.blocks),
        "heads": att.num_heads if att else 0,
        "kv_groups": att.num_kv_groups if att else 0,
        "head_dim": att.head_dim if att else 0,
        "ffn": mlp.ffn if mlp else 0,
        "activation": (mlp or moe).activation if (mlp or moe) else "swiglu",
        "num_experts": moe.num_experts if moe else 0,
        "expert_ffn": moe.expert_ffn if moe else 0,
        "top_k": moe.top_k if moe else 0,
        "shared_ffn": moe.shared_ffn if moe else 0,
        "latent": moe.latent if moe else 0,
        "mamba_heads": mamba.num_heads if mamba else 0,
        "mamba_head_dim": mamba.head_dim if mamba else 0,
        "mamba_state": mamba.state_size if mamba else 0,
        "mamba_groups": mamba.num_groups if mamba else 0,
        "mamba_conv_kernel": mamba.conv_kernel if mamba else 4,
        "tied_embeddings": spec.tied_embeddings,
        "norm_eps": float(spec.norm_eps),
        "rope_theta": float(spec.rope_theta),
        "max_position": spec.max_position,
        "blocks": [] if spec.is_uniform() else spec.to_dict()["blocks"],
    }
    return out


def read_model_fields(kind: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``cfg.model`` fields (shape and ``dtype``) of the parent at ``path`` (``kind``: hf or gguf)."""
    p = Path(path)
    if kind == "hf":
        if not p.is_dir():
            raise ModelFileError(
                f"{p} is not a directory; with model=hf, model.source.path is a Hugging Face directory"
            )
        return {**model_fields(hf_spec(p)), "dtype": hf_dtype(p)}
    return {**model_fields(gguf_spec(p)), "dtype": gguf_dtype(p)}

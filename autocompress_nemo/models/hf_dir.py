"""Read / write a Hugging Face model directory (config.json + safetensors + arch.json) for any family."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec

SHARD_BYTES = 4 * 1024**3
HF_CODE_PACKAGE = "autocompress_nemo.export.hf_code"
"""Where the configuration / modeling files named by a config's ``auto_map`` live (package data)."""


def code_files(cfg: dict[str, Any]) -> list[str]:
    """The ``*.py`` files ``cfg["auto_map"]`` names (``"configuration_decilm.DeciLMConfig"`` ->
    ``configuration_decilm.py``), in a stable order."""
    mods = {str(v).split("--")[-1].rsplit(".", 1)[0] for v in (cfg.get("auto_map") or {}).values()}
    return sorted(f"{m}.py" for m in mods)


def write_hf_config(out_dir: str | os.PathLike[str], cfg: dict[str, Any], dtype: str = "float32") -> Path:
    """Write ``config.json`` (``torch_dtype`` = ``dtype``, a torch dtype name) and the remote-code files
    its ``auto_map`` names (copied from ``export/hf_code/``) into ``out_dir``; no weights."""
    from importlib import resources

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype=dtype)
    src = resources.files(HF_CODE_PACKAGE)
    for name in code_files(cfg):
        if not src.joinpath(name).is_file():
            raise FileNotFoundError(f"config auto_map names {name}, which {HF_CODE_PACKAGE} does not have")
        (out / name).write_text(src.joinpath(name).read_text())
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return out


def write_hf_dir(
    out_dir: str | os.PathLike[str],
    cfg: dict[str, Any],
    sd: dict[str, torch.Tensor],
    spec: ArchSpec,
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config.json`` (and the remote code its ``auto_map`` names, ``write_hf_config``),
    ``model.safetensors`` (sharded above 4 GiB, with an index), ``arch.json`` (the spec), the
    tokenizer (its files from ``save_pretrained``) and ``generation_config.json`` into ``out_dir``:
    a directory that transformers' ``pipeline("text-generation", model=out_dir)`` and ``vllm serve``
    start from alone."""
    from safetensors.torch import save_file

    out = write_hf_config(out_dir, cfg, str(dtype).removeprefix("torch."))
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
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "arch.json").write_text(spec.to_json())
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    write_generation_config(out, cfg, tokenizer)
    return out


def hf_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as something with ``save_pretrained`` (a transformers tokenizer as it is, the
    project's ``ByteTokenizer`` through its ``to_hf``), or None where it has no Hugging Face form."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    to_hf = getattr(tokenizer, "to_hf", None)
    return to_hf() if callable(to_hf) else None


def write_generation_config(out_dir: str | os.PathLike[str], cfg: dict[str, Any], tokenizer: Any = None) -> Path:
    """``generation_config.json``: the BOS / EOS / pad ids (from the tokenizer, else the config) that
    ``generate``, a text-generation pipeline and ``vllm serve`` read from the directory; greedy by default
    (the student is compared greedily here; a sampling setting is the user's)."""
    gen: dict[str, Any] = {"_from_model_config": False, "do_sample": False}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is None:
            value = cfg.get(name)
        if value is not None:
            gen[name] = value
    if "pad_token_id" not in gen and "eos_token_id" in gen:
        gen["pad_token_id"] = gen["eos_token_id"]
    path = Path(out_dir) / "generation_config.json"
    path.write_text(json.dumps(gen, indent=1, sort_keys=True))
    return path


def read_hf_dir(
    path: str | os.PathLike[str], tokenizer: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    """``(config dict, float32 state dict, tokenizer or None)`` of a Hugging Face directory."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {d}: not a Hugging Face model directory")
    cfg = json.loads((d / "config.json").read_text())
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
    return cfg, sd, tok

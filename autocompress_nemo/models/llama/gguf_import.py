"""GGUF (llama.cpp) files of the ``llama`` and ``deci`` architectures -> ArchSpec + HF state dict.

Tensors are dequantized to float32 with the ``gguf`` package (``gguf.quants.dequantize``).
llama.cpp stores ``attn_q`` / ``attn_k`` with their rows permuted for its interleaved
RoPE (convert_hf_to_gguf.py: ``w.reshape(n_head, 2, d/2, H).swapaxes(1, 2)``); that
permutation is undone here so the result is in Hugging Face's (rotate-half) layout.
``deci`` files carry per-layer head counts and ffn widths (arrays); 0 means a removed block.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

_TENSOR_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (inverse of ``reshape(n,2,d/2,..).swapaxes(1,2)``)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _per_layer(v: Any, n: int) -> list[int]:
    if isinstance(v, list | tuple):
        if len(v) != n:
            raise ValueError(f"GGUF per-layer array has {len(v)} entries for {n} layers")
        return [int(x) for x in v]
    return [int(v)] * n


def read_gguf_spec(reader: Any, path: str | os.PathLike[str] = "") -> ArchSpec:
    """ArchSpec from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "deci"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, deci)")
    a = arch
    n = int(_field(reader, f"{a}.block_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    heads = _per_layer(_field(reader, f"{a}.attention.head_count"), n)
    kv = _per_layer(_field(reader, f"{a}.attention.head_count_kv", heads), n)
    ffn = _per_layer(_field(reader, f"{a}.feed_forward_length"), n)
    h0 = max(heads)
    head_dim = int(
        _field(reader, f"{a}.attention.key_length", 0) or _field(reader, f"{a}.rope.dimension_count", 0) or hidden // h0
    )
    vocab = _field(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    blocks: list[Any] = []
    for i in range(n):
        blocks.append(AttentionBlock(heads[i], kv[i] if heads[i] else 0, head_dim))
        blocks.append(MlpBlock(ffn[i]))
    return ArchSpec(
        hidden=hidden,
        vocab=int(vocab),
        blocks=tuple(blocks),
        family="llama",
        name=str(_field(reader, "general.name", Path(path).stem)),
        tied_embeddings="output.weight" not in names,
        norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        max_position=int(_field(reader, f"{a}.context_length", 4096)),
    )


def _dequantize(t: Any) -> torch.Tensor:
    from gguf import quants

    arr = quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))


def load_gguf(path: str | os.PathLike[str], tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
    """``(ArchSpec, HF Llama-named float32 state dict, tokenizer or None)`` of a GGUF file.

    The tokenizer is built by ``transformers`` from the same file
    (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``); pass ``tokenizer=False`` to skip it.
    """
    import gguf

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p} (check cfg.model.source.path / file)")
    reader = gguf.GGUFReader(str(p))
    spec = read_gguf_spec(reader, p)
    layers = spec.layers()
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = t.name
        if name == "token_embd.weight":
            sd["model.embed_tokens.weight"] = _dequantize(t)
        elif name == "output_norm.weight":
            sd["model.norm.weight"] = _dequantize(t)
        elif name == "output.weight":
            sd["lm_head.weight"] = _dequantize(t)
        elif name.startswith("blk."):
            _, i_s, kind, suffix = name.split(".", 3)
            i = int(i_s)
            if kind not in _TENSOR_MAP:
                raise ValueError(f"{p}: unexpected tensor {name} for a llama-architecture model")
            w = _dequantize(t)
            att = layers[i][0]
            if kind == "attn_q":
                w = unpermute_rope_rows(w, att.num_heads)
            elif kind == "attn_k":
                w = unpermute_rope_rows(w, att.num_kv_groups)
            sd[f"model.layers.{i}.{_TENSOR_MAP[kind]}.{suffix}"] = w
        elif name in ("rope_freqs.weight",):
            raise ValueError(f"{p}: RoPE frequency factors (Llama 3.1 rope scaling) are not supported yet")
        else:
            raise ValueError(f"{p}: unexpected tensor {name}")
    tok = load_gguf_tokenizer(p) if tokenizer else None
    return spec, sd, tok


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The Hugging Face tokenizer stored in a GGUF file.

    ``AutoTokenizer`` reads the file's model config first and refuses an architecture transformers
    has no config for (``deci``: "GGUF model with architecture deci is not supported yet",
    transformers 5.24); the tokenizer itself is only the ``tokenizer.ggml.*`` metadata, which
    ``PreTrainedTokenizerFast`` reads for any architecture (the same ids as ``AutoTokenizer`` on a
    ``llama`` file with the same vocabulary: ``tests/test_own_model_e2e.py``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except ValueError as e:
        if "architecture" not in str(e) and "Unrecognized model" not in str(e):
            raise
        return PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name)

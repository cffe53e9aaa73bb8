"""Tiny parents as another tool writes them, for the bring-your-own-model tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SMOLLM2_VOCAB = 49152
TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=192,
    vocab_size=SMOLLM2_VOCAB,
    max_position_embeddings=131072,
)
"""tiny_llama's shape with SmolLM2's vocabulary, in transformers' config names."""


def save_pretrained(family: str, out: Path, tokenizer: Any, seed: int = 0, **fields: Any) -> Path:
    """A random ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (``family``) of :data:`TINY_SHAPE`
    (``fields`` override it) written by transformers' own ``save_pretrained``, with ``tokenizer``."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model_cls(config_cls(**{**TINY_SHAPE, **fields})).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out

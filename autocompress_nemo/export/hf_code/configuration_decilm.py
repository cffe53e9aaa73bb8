"""DeciLM (``model_type: nemotron-nas``) configuration, written by autocompress-nemo.

A heterogeneous Llama: ``block_configs`` holds one entry per layer,

    {"attention": {"no_op": bool, "replace_with_linear": bool, "n_heads_in_group": int | None},
     "ffn": {"no_op": bool, "replace_with_linear": bool, "intermediate_size": int, "ffn_mult": float}}

read as attributes (``config.block_configs[i].attention.n_heads_in_group``), the way vLLM's
``nemotron_nas.py`` and TensorRT-LLM read them. A key absent from ``config.json`` is absent as an
attribute too (vLLM takes ``ffn.ffn_mult`` when ``hasattr`` says it is there, else
``ffn.intermediate_size``). Layer ``i`` has ``num_attention_heads // n_heads_in_group`` KV heads
and, unless ``attention.num_attention_heads`` is given (an extension no GPU engine reads),
``num_attention_heads`` query heads; its ffn width is ``intermediate_size`` if given, else
``ffn_mult`` rounded the DeciLM way (``int(2 * ffn_mult * hidden / 3)`` up to a multiple of 256).

This file imports only ``transformers``: it is loaded as remote code (``trust_remote_code=True``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from transformers import LlamaConfig


def _namespace(d: Any) -> SimpleNamespace:
    if isinstance(d, SimpleNamespace):
        return d
    return SimpleNamespace(**dict(d or {}))


def _block(b: Any) -> SimpleNamespace:
    if isinstance(b, SimpleNamespace):
        return b
    return SimpleNamespace(attention=_namespace(b.get("attention")), ffn=_namespace(b.get("ffn")))


def _plain(b: SimpleNamespace) -> dict[str, Any]:
    return {"attention": dict(vars(b.attention)), "ffn": dict(vars(b.ffn))}


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's width of ``ffn_mult``: ``int(2 * ffn_mult * hidden / 3)`` rounded up to 256."""
    n = int(2 * ffn_mult * hidden_size / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs: list[Any] | None = None, **kwargs: Any) -> None:
        heads = kwargs.get("num_attention_heads")
        hidden = kwargs.get("hidden_size")
        if heads and hidden and hidden % heads:
            # LlamaConfig's validator wants hidden_size % num_attention_heads == 0; with an explicit
            # head_dim (a pruned hidden size) it need not be: validate with one head, then set it
            kwargs.setdefault("num_key_value_heads", heads)
            if kwargs.get("head_dim") is None:
                raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads and head_dim is not set")
            super().__init__(**dict(kwargs, num_attention_heads=1))
            self.num_attention_heads = heads
        else:
            super().__init__(**kwargs)
        self.block_configs = [_block(b) for b in (block_configs or [])]

    def validate(self) -> None:
        """LlamaConfig's checks, with ``hidden_size % num_attention_heads`` waived (see ``__init__``)."""
        heads = self.num_attention_heads
        # huggingface_hub's @strict adds ``validate`` to LlamaConfig at run time; its types do not show it
        if not (heads and self.hidden_size % heads):
            return super().validate()  # type: ignore[misc]
        self.num_attention_heads = 1
        try:
            super().validate()  # type: ignore[misc]
        finally:
            self.num_attention_heads = heads

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["block_configs"] = [_plain(_block(b)) for b in getattr(self, "block_configs", [])]
        return out

    def layer_shape(self, layer_idx: int) -> dict[str, int]:
        """``{"num_attention_heads", "num_key_value_heads", "intermediate_size"}`` of one layer
        (0 for a no-op attention / ffn)."""
        b = self.block_configs[layer_idx]
        a, f = b.attention, b.ffn
        if getattr(a, "no_op", False):
            q = kv = 0
        else:
            q = int(getattr(a, "num_attention_heads", None) or self.num_attention_heads)
            kv = q // int(a.n_heads_in_group or 1)
        if getattr(f, "no_op", False):
            ffn = 0
        elif getattr(f, "intermediate_size", None):
            ffn = int(f.intermediate_size)
        else:
            ffn = ffn_mult_to_intermediate_size(f.ffn_mult, self.hidden_size)
        return {"num_attention_heads": q, "num_key_value_heads": kv, "intermediate_size": ffn}

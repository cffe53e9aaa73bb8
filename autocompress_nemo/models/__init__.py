"""Megatron-core model engine: builder, CPU compatibility, checkpoint adapters.

build_model(spec, ...) -> GPTModel        models.builder
forward_logits(model, input_ids_BT)       models.builder
load_parent(cfg.model) -> (spec, hf_sd, tokenizer)   models.parent
hf_to_megatron / megatron_to_hf / load_gguf / load_hf / export_hf   models.llama
"""

from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.parent import load_parent

__all__ = ["build_model", "forward_logits", "load_parent"]

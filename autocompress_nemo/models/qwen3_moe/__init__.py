"""Qwen3-MoE (``Qwen3MoeForCausalLM``) checkpoint adapters.

A Qwen3-MoE model is, as an ArchSpec, a pattern ``*E*E...``: decoder layer ``l`` is attention
block ``2l`` (RoPE, q/k RMSNorm, GQA) and feed-forward block ``2l+1`` (SwiGLU routed experts, softmax
top-k router, no shared expert; a dense SwiGLU MLP for ``mlp_only_layers``). The Megatron model
is built by ``models.hybrid`` (``build_model`` dispatches there).
"""

from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, megatron_to_hf, random_hf_state_dict
from autocompress_nemo.models.qwen3_moe.hf_io import export_hf, hf_config_from_spec, load_hf, spec_from_hf_config

import_hf = load_hf

__all__ = [
    "export_hf",
    "hf_config_from_spec",
    "hf_to_megatron",
    "import_hf",
    "load_hf",
    "megatron_to_hf",
    "random_hf_state_dict",
    "spec_from_hf_config",
]

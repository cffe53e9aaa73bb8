"""Hybrid (Mamba-2 / attention / MLP / MoE) and MoE models on Megatron's ``HybridModel``.

``build_hybrid_model(spec)`` builds the model (``builder.build_model`` dispatches here for any
spec with MoE or Mamba blocks, or of family ``nemotron_h`` / ``qwen3_moe``);
``hf_to_megatron`` / ``megatron_to_hf`` load / read the family's Hugging Face-named state
dict (``names.py``), with TP / EP sharding.
"""

from autocompress_nemo.models.hybrid.builder import MAMBA_INSTALL, build_hybrid_model, is_hybrid
from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, megatron_to_hf

__all__ = ["MAMBA_INSTALL", "build_hybrid_model", "hf_to_megatron", "is_hybrid", "megatron_to_hf"]

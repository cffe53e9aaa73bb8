"""Llama-family (Llama, SmolLM2, Qwen2/3 dense, DeciLM heterogeneous) checkpoint adapters."""

from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, megatron_to_hf
from autocompress_nemo.models.llama.gguf_import import load_gguf, load_gguf_tokenizer
from autocompress_nemo.models.llama.hf_io import export_hf, import_hf, load_hf

__all__ = ["export_hf", "hf_to_megatron", "import_hf", "load_gguf", "load_gguf_tokenizer", "load_hf", "megatron_to_hf"]

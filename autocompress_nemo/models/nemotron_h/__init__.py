"""Nemotron-H (Nemotron-H, Nemotron 3 Nano / Super) checkpoint adapters.

The Megatron model is built by ``models.hybrid`` (``build_model`` dispatches there); this
package maps Hugging Face configs (``NemotronHForCausalLM`` and the heterogeneous Puzzle
format) and Nemotron-H-named weights to and from it.
"""

from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, megatron_to_hf, random_hf_state_dict
from autocompress_nemo.models.nemotron_h.config import export_spec, hf_config_from_spec, spec_from_hf_config
from autocompress_nemo.models.nemotron_h.hf_io import export_hf, import_hf, load_hf

__all__ = [
    "export_hf",
    "export_spec",
    "hf_config_from_spec",
    "hf_to_megatron",
    "import_hf",
    "load_hf",
    "megatron_to_hf",
    "random_hf_state_dict",
    "spec_from_hf_config",
]

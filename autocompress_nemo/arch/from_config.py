"""ArchSpec from a model config section (``cfg.model``): the parent's shape."""

from __future__ import annotations

from typing import Any, TypedDict

from autocompress_nemo.arch.spec import (
    ArchSpec,
    AttentionBlock,
    Block,
    MambaBlock,
    MlpBlock,
    MoeBlock,
    block_from_dict,
)

SHAPE_FIELDS = (
    "family",
    "hidden",
    "vocab",
    "num_layers",
    "pattern",
    "heads",
    "kv_groups",
    "head_dim",
    "ffn",
    "activation",
    "num_experts",
    "expert_ffn",
    "top_k",
    "shared_ffn",
    "latent",
    "mamba_heads",
    "mamba_head_dim",
    "mamba_state",
    "mamba_groups",
    "mamba_conv_kernel",
    "tied_embeddings",
    "norm_eps",
    "rope_theta",
    "max_position",
    "dtype",
)
"""The ``cfg.model`` fields that set a model's shape (``spec_from_model_config`` reads them)."""


def _get(m: Any, key: str, default: Any = 0) -> Any:
    return m.get(key, default) if isinstance(m, dict) else getattr(m, key, default)


def _plain(b: Any) -> dict[str, Any]:
    """A block entry of ``model.blocks`` as a plain dict (a DictConfig from the config, or a dict)."""
    from omegaconf import DictConfig, OmegaConf

    d = OmegaConf.to_container(b, resolve=True) if isinstance(b, DictConfig) else b
    if not isinstance(d, dict):
        raise ValueError(f"model.blocks entry {b!r} is not a block (a mapping with kind and its sizes)")
    return dict(d)


class _CommonFields(TypedDict):
    """The ArchSpec fields ``cfg.model`` gives alike for every shape (``spec_from_model_config``)."""

    family: str
    name: str
    tied_embeddings: bool
    norm_eps: float
    rope_theta: float
    max_position: int


def spec_from_model_config(m: Any) -> ArchSpec:
    """Build the parent's ArchSpec from ``cfg.model`` (a DictConfig, dataclass or dict).

    Llama-style models give ``num_layers``; hybrids give ``pattern``; a heterogeneous parent gives
    ``blocks`` (one dict per block, read from its own files), which then decides every block.
    """
    hidden, heads = int(_get(m, "hidden")), int(_get(m, "heads"))
    head_dim = int(_get(m, "head_dim")) or (hidden // heads if heads else 0)
    common: _CommonFields = dict(
        family=str(_get(m, "family", "llama")),
        name=str(_get(m, "name", "")),
        tied_embeddings=bool(_get(m, "tied_embeddings", False)),
        norm_eps=float(_get(m, "norm_eps", 1e-5)),
        rope_theta=float(_get(m, "rope_theta", 10000.0)),
        max_position=int(_get(m, "max_position", 4096)),
    )
    blocks = _get(m, "blocks", None) or []
    if len(blocks):  # a heterogeneous parent: its own blocks (models/shape.model_fields)
        return ArchSpec(
            hidden=hidden,
            vocab=int(_get(m, "vocab")),
            blocks=tuple(block_from_dict(_plain(b)) for b in blocks),
            **common,
        )
    pattern = str(_get(m, "pattern", "") or "")
    act = str(_get(m, "activation", "swiglu"))
    if not pattern:
        return (
            ArchSpec.llama(
                hidden=hidden,
                vocab=int(_get(m, "vocab")),
                layers=int(_get(m, "num_layers")),
                heads=heads,
                kv_groups=int(_get(m, "kv_groups")),
                ffn=int(_get(m, "ffn")),
                head_dim=head_dim,
                **common,
            )
            if act == "swiglu"
            else _llama_with_activation(m, hidden, heads, head_dim, act, common)
        )
    attention = AttentionBlock(heads, int(_get(m, "kv_groups")), head_dim) if heads else None
    mlp = MlpBlock(int(_get(m, "ffn")), act) if int(_get(m, "ffn")) else None
    moe = (
        MoeBlock(
            num_experts=int(_get(m, "num_experts")),
            expert_ffn=int(_get(m, "expert_ffn")),
            top_k=int(_get(m, "top_k")),
            shared_ffn=int(_get(m, "shared_ffn")),
            latent=int(_get(m, "latent")),
            activation=act,
        )
        if int(_get(m, "num_experts"))
        else None
    )
    mamba = (
        MambaBlock(
            num_heads=int(_get(m, "mamba_heads")),
            head_dim=int(_get(m, "mamba_head_dim")),
            state_size=int(_get(m, "mamba_state")),
            num_groups=int(_get(m, "mamba_groups")),
            conv_kernel=int(_get(m, "mamba_conv_kernel", 4)),
        )
        if int(_get(m, "mamba_heads"))
        else None
    )
    return ArchSpec.from_pattern(
        pattern,
        hidden=hidden,
        vocab=int(_get(m, "vocab")),
        attention=attention,
        mlp=mlp,
        moe=moe,
        mamba=mamba,
        **common,
    )


def _llama_with_activation(m: Any, hidden: int, heads: int, head_dim: int, act: str, common: _CommonFields) -> ArchSpec:
    blocks: list[Block] = []
    for _ in range(int(_get(m, "num_layers"))):
        blocks += [AttentionBlock(heads, int(_get(m, "kv_groups")), head_dim), MlpBlock(int(_get(m, "ffn")), act)]
    return ArchSpec(hidden=hidden, vocab=int(_get(m, "vocab")), blocks=tuple(blocks), **common)

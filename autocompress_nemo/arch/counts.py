"""Derived counts of an ArchSpec: small pure functions, each docstring giving its formula.

Legend: h = hidden size, V = vocab, H = query heads, G = KV groups, d = head dim,
F = ffn width, E = routed experts, k = top-k, S = shared-expert ffn, L = latent size,
Hm/Pm/N/Gm/K = Mamba heads, head dim, state size, groups, conv kernel.
"""

from __future__ import annotations

from autocompress_nemo.arch.spec import (
    ArchSpec,
    AttentionBlock,
    Block,
    MambaBlock,
    MlpBlock,
    MoeBlock,
)


def attention_params(b: AttentionBlock, hidden: int) -> int:
    """Q, K, V, O projections and the input norm; no biases (Llama/Nemotron style).

    ``h*H*d (Q) + 2*h*G*d (K, V) + H*d*h (O) + h (norm)``; 0 when removed.
    """
    if b.removed:
        return 0
    return hidden * b.num_heads * b.head_dim * 2 + 2 * hidden * b.num_kv_groups * b.head_dim + hidden


def ffn_params(hidden: int, ffn: int, gated: bool) -> int:
    """One feed-forward network without norm: ``(3 if gated else 2) * h * F``."""
    return (3 if gated else 2) * hidden * ffn


def mlp_params(b: MlpBlock, hidden: int) -> int:
    """A dense MLP block: ``ffn_params(h, F) + h`` (input norm); 0 when removed."""
    if b.removed:
        return 0
    return ffn_params(hidden, b.ffn, b.gated) + hidden


def moe_params(b: MoeBlock, hidden: int, active: bool = False) -> int:
    """A MoE block.

    ``h*E (router) + E' * ffn_params(L or h, F_e) + [2*h*L (latent down/up)] +
    ffn_params(h, S) + h (norm)``, with ``E' = k`` for active parameters and ``E``
    for total. 0 when removed.
    """
    if b.removed:
        return 0
    inner = b.latent or hidden
    experts = b.top_k if active else b.num_experts
    n = hidden * b.num_experts  # router
    n += experts * ffn_params(inner, b.expert_ffn, b.gated) if b.num_experts else 0
    n += 2 * hidden * b.latent if b.latent else 0
    n += ffn_params(hidden, b.shared_ffn, b.gated) if b.shared_ffn else 0
    return n + hidden


def mamba_conv_dim(b: MambaBlock) -> int:
    """Channels through the causal conv: ``Hm*Pm + 2*Gm*N`` (x, B, C)."""
    return b.d_inner + 2 * b.num_groups * b.state_size


def mamba_params(b: MambaBlock, hidden: int) -> int:
    """A Mamba-2 block as in Megatron / Nemotron-H.

    in_proj ``h*(2*Hm*Pm + 2*Gm*N + Hm)`` (z, x, B, C, dt) + conv ``conv_dim*(K+1)``
    (weights + bias) + ``3*Hm`` (dt_bias, A_log, D) + ``Hm*Pm`` (gated norm) +
    out_proj ``Hm*Pm*h`` + ``h`` (input norm). 0 when removed.
    """
    if b.removed:
        return 0
    d_in_proj = 2 * b.d_inner + 2 * b.num_groups * b.state_size + b.num_heads
    return (
        hidden * d_in_proj
        + mamba_conv_dim(b) * (b.conv_kernel + 1)
        + 3 * b.num_heads
        + b.d_inner
        + b.d_inner * hidden
        + hidden
    )


def block_params(b: Block, hidden: int, active: bool = False) -> int:
    """Parameters of one block (dispatch on kind)."""
    if isinstance(b, AttentionBlock):
        return attention_params(b, hidden)
    if isinstance(b, MlpBlock):
        return mlp_params(b, hidden)
    if isinstance(b, MoeBlock):
        return moe_params(b, hidden, active)
    if isinstance(b, MambaBlock):
        return mamba_params(b, hidden)
    raise TypeError(f"unknown block {b!r}")


def embedding_params(spec: ArchSpec) -> int:
    """``V*h`` (embedding) + ``h`` (final norm) + ``V*h`` more when the LM head is untied."""
    return spec.vocab * spec.hidden * (1 if spec.tied_embeddings else 2) + spec.hidden


def param_count(spec: ArchSpec) -> int:
    """Total parameters: ``embedding_params + sum(block_params)``."""
    return embedding_params(spec) + sum(block_params(b, spec.hidden) for b in spec.blocks)


def active_param_count(spec: ArchSpec) -> int:
    """Parameters touched per token: as ``param_count`` with MoE blocks counting top-k experts."""
    return embedding_params(spec) + sum(block_params(b, spec.hidden, active=True) for b in spec.blocks)


def kv_bytes_per_token(spec: ArchSpec, dtype_bytes: float) -> float:
    """KV cache per token of context: ``sum over attention blocks of 2*G*d*bytes`` (K and V)."""
    return sum(
        2 * b.num_kv_groups * b.head_dim * dtype_bytes
        for b in spec.blocks
        if isinstance(b, AttentionBlock) and not b.removed
    )


def ssm_state_bytes_per_sequence(spec: ArchSpec, dtype_bytes: float) -> float:
    """Mamba state per sequence, constant in context length.

    ``sum over mamba blocks of (Hm*Pm*N (SSM state) + conv_dim*(K-1) (conv state)) * bytes``.
    """
    return sum(
        (b.num_heads * b.head_dim * b.state_size + mamba_conv_dim(b) * (b.conv_kernel - 1)) * dtype_bytes
        for b in spec.blocks
        if isinstance(b, MambaBlock) and not b.removed
    )

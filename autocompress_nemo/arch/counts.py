"""Derived counts of an ArchSpec: sums over its blocks of what each block's kind counts
(``blocks/<kind>.params`` and friends, whose docstrings give the formulas).

Legend: h = hidden size, V = vocab, H = query heads, G = KV groups, d = head dim,
F = ffn width, E = routed experts, k = top-k, S = shared-expert ffn, L = latent size,
Hm/Pm/N/Gm/K = Mamba heads, head dim, state size, groups, conv kernel.
"""

from __future__ import annotations

from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.blocks import kind_of


def block_params(b: Block, hidden: int, active: bool = False) -> int:
    """Parameters of one block, its input norm included (``active``: MoE blocks count top-k experts); 0 when removed."""
    return 0 if b.removed else kind_of(b).params(b, hidden, active)


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
    return sum(kind_of(b).kv_bytes_per_token(b, dtype_bytes) for b in spec.blocks if not b.removed)


def state_elements(spec: ArchSpec, conv_extra: int = 0) -> int:
    """Recurrent state per sequence: ``sum over mamba blocks of Hm*Pm*N + conv_dim*(K-1+e)``."""
    return sum(kind_of(b).state_elements(b, conv_extra) for b in spec.blocks if not b.removed)


def ssm_state_bytes_per_sequence(spec: ArchSpec, dtype_bytes: float) -> float:
    """Mamba state per sequence, constant in context length: ``state_elements(spec) * bytes``."""
    return state_elements(spec) * dtype_bytes


def forward_flops_per_token(spec: ArchSpec, seq: int, head: bool = True, layers: bool = True) -> float:
    """FLOPs (2 x multiply-adds) per token of one forward at sequence length ``seq``: every weight a
    token touches once (MoE: its top-k experts; the embedding lookup never) plus each kind's mixing
    (``Kind.mixing_flops``): the attention scores and values over ``seq`` positions (the full square,
    as the unfused CPU attention computes it), a Mamba block's scan (constant in ``seq``).
    ``head``: the LM head's ``h x V``; ``layers``: the decoder blocks'. A backward costs about twice
    its forward (``3x`` for forward + backward with weight gradients)."""
    blocks = sum(block_params(b, spec.hidden, active=True) for b in spec.blocks) if layers else 0
    mixing = (
        sum(kind_of(b).mixing_flops(b, seq, full_square=True) for b in spec.blocks if not b.removed) if layers else 0
    )
    return mixing + 2.0 * float(blocks + (spec.vocab * spec.hidden if head else 0))

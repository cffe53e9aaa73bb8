"""ArchSpec: the one description of an architecture that every stage speaks.

A model is: embedding (vocab x hidden), an ordered list of blocks, a final norm and
an LM head. Block kinds:

- ``attention``: query heads, KV groups, head dim (GQA). Removed when ``num_heads == 0``.
- ``mlp``: ffn width. Removed when ``ffn == 0``.
- ``moe``: routed experts kept, expert ffn width, top-k, shared-expert width, latent
  size (0 = no latent projection, as in all models but LatentMoE). Removed when it has
  neither routed experts nor a shared expert.
- ``mamba``: Mamba-2 heads, head dim, state size, groups, conv kernel. Removed when
  ``num_heads == 0``.

A removed block is a no-op: it adds nothing to the residual stream. "Removed" is a
width of zero, so the search treats presence as one more width option.

A Llama layer is an attention block followed by an mlp block. A Nemotron-H pattern maps
one character to one block: ``M`` mamba, ``*`` attention, ``-`` mlp, ``E`` moe.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

BlockKind = Literal["attention", "mlp", "moe", "mamba"]
PATTERN_CHAR: dict[str, str] = {"attention": "*", "mlp": "-", "moe": "E", "mamba": "M"}
CHAR_KIND: dict[str, str] = {v: k for k, v in PATTERN_CHAR.items()}


@dataclass(frozen=True)
class AttentionBlock:
    num_heads: int
    num_kv_groups: int
    head_dim: int
    kind: Literal["attention"] = "attention"

    def __post_init__(self) -> None:
        if self.num_heads < 0 or self.num_kv_groups < 0 or self.head_dim <= 0:
            raise ValueError(f"attention block: negative or zero size in {self}")
        if self.num_heads == 0 and self.num_kv_groups != 0:
            raise ValueError("attention block: a removed block (num_heads=0) must have num_kv_groups=0")
        if self.num_heads and (self.num_kv_groups == 0 or self.num_heads % self.num_kv_groups):
            raise ValueError(
                f"attention block: num_heads={self.num_heads} is not a multiple of num_kv_groups={self.num_kv_groups}"
            )

    @property
    def removed(self) -> bool:
        return self.num_heads == 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_groups if self.num_kv_groups else 0


@dataclass(frozen=True)
class MlpBlock:
    ffn: int
    activation: str = "swiglu"  # "swiglu" (gated, Llama) or "relu2" (Nemotron-H, not gated)
    kind: Literal["mlp"] = "mlp"

    def __post_init__(self) -> None:
        if self.ffn < 0:
            raise ValueError(f"mlp block: negative ffn {self.ffn}")
        if self.activation not in ("swiglu", "relu2", "gelu"):
            raise ValueError(f"mlp block: unknown activation {self.activation!r} (swiglu, relu2, gelu)")

    @property
    def removed(self) -> bool:
        return self.ffn == 0

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


@dataclass(frozen=True)
class MoeBlock:
    num_experts: int
    expert_ffn: int
    top_k: int
    shared_ffn: int = 0
    latent: int = 0
    activation: str = "swiglu"
    kind: Literal["moe"] = "moe"

    def __post_init__(self) -> None:
        if min(self.num_experts, self.expert_ffn, self.top_k, self.shared_ffn, self.latent) < 0:
            raise ValueError(f"moe block: negative size in {self}")
        if self.num_experts and not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"moe block: top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    @property
    def removed(self) -> bool:
        return (self.num_experts == 0 or self.expert_ffn == 0) and self.shared_ffn == 0

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


@dataclass(frozen=True)
class MambaBlock:
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int = 4
    kind: Literal["mamba"] = "mamba"

    def __post_init__(self) -> None:
        if self.num_heads < 0 or self.head_dim <= 0 or self.state_size <= 0 or self.num_groups <= 0:
            raise ValueError(f"mamba block: bad size in {self}")
        if self.num_heads and self.num_heads % self.num_groups:
            raise ValueError(f"mamba block: num_heads={self.num_heads} not a multiple of num_groups={self.num_groups}")

    @property
    def removed(self) -> bool:
        return self.num_heads == 0

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim


Block = AttentionBlock | MlpBlock | MoeBlock | MambaBlock
_BLOCK_TYPES: dict[str, type] = {
    "attention": AttentionBlock,
    "mlp": MlpBlock,
    "moe": MoeBlock,
    "mamba": MambaBlock,
}


def block_from_dict(d: dict[str, Any]) -> Block:
    kind = d.get("kind")
    if kind not in _BLOCK_TYPES:
        raise ValueError(f"unknown block kind {kind!r}; known: {sorted(_BLOCK_TYPES)}")
    return _BLOCK_TYPES[kind](**d)


@dataclass(frozen=True)
class ArchSpec:
    """A whole model. ``family`` names the checkpoint adapters (llama, nemotron_h, qwen3_moe)."""

    hidden: int
    vocab: int
    blocks: tuple[Block, ...]
    family: str = "llama"
    name: str = ""
    tied_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.hidden <= 0 or self.vocab <= 0:
            raise ValueError(f"ArchSpec {self.name!r}: hidden and vocab must be positive")
        object.__setattr__(self, "blocks", tuple(self.blocks))

    # -- construction helpers -------------------------------------------------
    @classmethod
    def llama(
        cls,
        *,
        hidden: int,
        vocab: int,
        layers: int,
        heads: int,
        kv_groups: int,
        ffn: int,
        head_dim: int | None = None,
        **kw: Any,
    ) -> ArchSpec:
        """A uniform Llama-style model: ``layers`` x (attention, mlp)."""
        hd = head_dim or hidden // heads
        blocks: list[Block] = []
        for _ in range(layers):
            blocks += [AttentionBlock(heads, kv_groups, hd), MlpBlock(ffn)]
        return cls(hidden=hidden, vocab=vocab, blocks=tuple(blocks), family=kw.pop("family", "llama"), **kw)

    @classmethod
    def from_pattern(
        cls,
        pattern: str,
        *,
        hidden: int,
        vocab: int,
        attention: AttentionBlock | None,
        mlp: MlpBlock | None = None,
        moe: MoeBlock | None = None,
        mamba: MambaBlock | None = None,
        **kw: Any,
    ) -> ArchSpec:
        """A hybrid from a Nemotron-H pattern, one character per block (``M * - E``)."""
        by_kind: dict[str, Block | None] = {"attention": attention, "mlp": mlp, "moe": moe, "mamba": mamba}
        blocks = []
        for i, ch in enumerate(pattern):
            if ch not in CHAR_KIND:
                raise ValueError(f"pattern {pattern!r}: unknown character {ch!r} at {i}; known: M * - E")
            b = by_kind[CHAR_KIND[ch]]
            if b is None:
                raise ValueError(f"pattern {pattern!r} has {ch!r} but no {CHAR_KIND[ch]} block was given")
            blocks.append(b)
        return cls(hidden=hidden, vocab=vocab, blocks=tuple(blocks), family=kw.pop("family", "nemotron_h"), **kw)

    # -- views ----------------------------------------------------------------
    @property
    def pattern(self) -> str:
        """Nemotron-H style pattern; a removed block is shown as ``.``."""
        return "".join("." if b.removed else PATTERN_CHAR[b.kind] for b in self.blocks)

    def kinds(self) -> set[str]:
        return {b.kind for b in self.blocks}

    def is_dense_layered(self) -> bool:
        """True if blocks pair up as (attention, mlp) layers, as Llama-style models do."""
        if len(self.blocks) % 2:
            return False
        return all(
            self.blocks[i].kind == "attention" and self.blocks[i + 1].kind == "mlp"
            for i in range(0, len(self.blocks), 2)
        )

    def layers(self) -> list[tuple[AttentionBlock, MlpBlock]]:
        """(attention, mlp) pairs of a Llama-style model."""
        if not self.is_dense_layered():
            raise ValueError(f"ArchSpec {self.name!r} is not a sequence of (attention, mlp) layers: {self.pattern}")
        return [(self.blocks[i], self.blocks[i + 1]) for i in range(0, len(self.blocks), 2)]  # type: ignore[misc]

    @property
    def qk_norm(self) -> bool:
        """Per-head q / k RMSNorms (Qwen3 dense and MoE; never Nemotron-H)."""
        if self.family == "nemotron_h":
            return False
        return bool(self.extra.get("qk_layernorm", self.family in ("qwen3", "qwen3_moe")))

    @property
    def qkv_bias(self) -> bool:
        """Biases on q / k / v (Qwen2)."""
        return bool(self.extra.get("qkv_bias", self.family == "qwen2"))

    @property
    def num_layers(self) -> int:
        return len(self.blocks) // 2 if self.is_dense_layered() else len(self.blocks)

    def is_uniform(self) -> bool:
        """Every block of a kind has the same shape and none is removed."""
        seen: dict[str, Block] = {}
        for b in self.blocks:
            if b.removed:
                return False
            if seen.setdefault(b.kind, b) != b:
                return False
        return True

    def replace_block(self, index: int, block: Block) -> ArchSpec:
        blocks = list(self.blocks)
        blocks[index] = block
        return dataclasses.replace(self, blocks=tuple(blocks))

    def replace(self, **kw: Any) -> ArchSpec:
        return dataclasses.replace(self, **kw)

    # -- serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchSpec:
        d = dict(d)
        d["blocks"] = tuple(block_from_dict(b) for b in d["blocks"])
        return cls(**d)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> ArchSpec:
        return cls.from_dict(json.loads(s))

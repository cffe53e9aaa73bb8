"""Permutations that sort every scored dimension, most important first (each block's kind decides
its own: ``blocks/<kind>.orders``), and their application to the Hugging Face-named state dict of
``models/hybrid/names.py`` (every family: Llama, Nemotron-H, Qwen3-MoE). The function computed is
unchanged (a change of basis, ``rank/permute.py``); the hidden channels move in every tensor that
reads or writes the residual stream (by role, below), the embeddings and every norm weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.models.hybrid.names import hf_names
from autocompress_nemo.models.hybrid.state_dict import block_roles
from autocompress_nemo.rank.importance import Importance
from autocompress_nemo.rank.permute import argsort_desc, permute_hidden

READS = {"q", "k", "v", "up", "gate", "in_proj", "router", "shared_up", "shared_gate", "latent_down"}
"""Roles whose columns read the residual stream (routed experts' ``expert_up`` / ``expert_gate`` too,
unless a LatentMoE's experts work in its latent space)."""
WRITES = {"o", "down", "out_proj", "shared_down", "latent_up"}
"""Roles whose rows write the residual stream (and ``expert_down`` unless latent)."""


@dataclass
class Permutations:
    """``blocks[i]``: block ``i``'s ``{name: new -> old order}``; ``hidden``: None keeps the channels."""

    blocks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    hidden: torch.Tensor | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hidden": None if self.hidden is None else self.hidden.tolist(),
            "blocks": [{n: v.tolist() for n, v in b.items()} for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Permutations:
        return cls(
            blocks=[{n: torch.tensor(v, dtype=torch.long) for n, v in b.items()} for b in d["blocks"]],
            hidden=None if d.get("hidden") is None else torch.tensor(d["hidden"], dtype=torch.long),
        )


def permutations_from_scores(spec: ArchSpec, imp: Importance, sort_hidden: bool = True) -> Permutations:
    """Most-important-first orders of every scored dimension (hidden channels only if ``sort_hidden``)."""
    blocks = [{} if b.removed else kind_of(b).orders(b, s) for b, s in zip(spec.blocks, imp.blocks, strict=True)]
    hidden = argsort_desc(imp.hidden) if sort_hidden and imp.hidden is not None else None
    return Permutations(blocks=blocks, hidden=hidden)


def _hidden_roles(spec: ArchSpec) -> tuple[list[str], list[str], list[str]]:
    names = hf_names(spec)
    reads, writes, vectors = [names.embed, names.lm_head], [], [names.final_norm]
    for i, b in enumerate(spec.blocks):
        latent = bool(getattr(b, "latent", 0))
        for role, e, _ in block_roles(spec, b):
            key = names.key(i, role, e)
            if role == "norm":
                vectors.append(key)
            elif role in READS or (role in ("expert_up", "expert_gate") and not latent):
                reads.append(key)
            elif role in WRITES or (role == "expert_down" and not latent):
                writes.append(key)
    return reads, writes, vectors


def apply_permutations(spec: ArchSpec, sd: dict[str, torch.Tensor], p: Permutations) -> dict[str, torch.Tensor]:
    """A new state dict with every dimension of ``p`` reordered; the function computed is unchanged."""
    out, names = dict(sd), hf_names(spec)

    def key_of(i: int) -> Callable[..., str]:
        def key(role: str, expert: int | None = None) -> str:
            try:
                return names.key(i, role, expert)
            except KeyError:  # a role this family does not have (no tensor of that name in ``sd``)
                return f"<block {i} has no {role}>"

        return key

    for i, (b, orders) in enumerate(zip(spec.blocks, p.blocks, strict=True)):
        if orders and not b.removed:
            kind_of(b).permute(out, key_of(i), b, orders)
    if p.hidden is not None:
        reads, writes, vectors = _hidden_roles(spec)
        permute_hidden(out, p.hidden, [k for k in reads if k in out], writes, vectors)
    return out


def sorted_importance(spec: ArchSpec, imp: Importance, p: Permutations) -> Importance:
    """The scores in the sorted order (descending along every dimension; heads per group, groups by their sum)."""
    blocks = [
        s if b.removed else kind_of(b).sort_scores(s, o)
        for b, s, o in zip(spec.blocks, imp.blocks, p.blocks, strict=True)
    ]
    hidden = imp.hidden if imp.hidden is None or p.hidden is None else imp.hidden[p.hidden]
    return Importance(blocks=blocks, hidden=hidden, tokens=imp.tokens)

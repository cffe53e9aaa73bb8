"""Permutations that sort every scored dimension of a hybrid / MoE model (``moe_mamba.py``), most
important first, and their application to the Hugging Face-named state dict of
``models/hybrid/names.py`` (Nemotron-H, Qwen3-MoE). Permutations are ``new -> old`` index vectors.
The function computed is unchanged (a change of basis):

- experts: router rows (and the selection bias) move with the expert tensors, so every token picks
  the same experts with the same weights;
- expert / shared-expert / dense-MLP neurons: up (gate) rows and down columns move together;
- Mamba heads: groups are sorted by summed score and heads within each group by their own score
  (B / C belong to a group; the gated RMSNorm normalizes over the heads of one group, a set that
  stays together). Rows of ``z``, ``x``, ``dt`` in ``in_proj``, the ``x`` channels of the conv,
  ``dt_bias``, ``A_log``, ``D``, the gated-norm weight and the ``out_proj`` columns move with their
  head; ``B``/``C`` rows (in ``in_proj`` and the conv) with their group;
- attention: KV groups by the summed score of their query heads, query heads within each group by
  their own (``reorder.grouped_order``, as for dense models); ``q`` rows and ``o`` columns move with
  their head, ``k`` / ``v`` rows with their group. Whole heads move, so RoPE and Qwen3's per-head
  q / k norms are untouched;
- hidden channels: the embedding and LM head columns, every block's norm weight and the final norm,
  the columns of every matrix that reads the residual stream (``q``, ``k``, ``v``, Mamba
  ``in_proj``, router, shared / dense ``up`` (``gate``), routed-expert ``up`` (``gate``) — or the
  LatentMoE ``latent_down`` when the experts work in a latent space), the rows of every matrix that
  writes it (``o``, Mamba ``out_proj``, shared / dense ``down``, expert ``down`` or ``latent_up``).
  RMSNorm is permutation-equivariant; the Mamba gated norm and the q / k norms act inside a group /
  head, not along ``h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MoeBlock
from autocompress_nemo.models.hybrid.names import hf_names
from autocompress_nemo.models.hybrid.state_dict import block_roles
from autocompress_nemo.rank.reorder import (
    _argsort_desc,
    _cols,
    _rows,
    grouped_order,
    permute_heads,
    permute_hidden,
    permute_neurons,
)

if TYPE_CHECKING:
    from autocompress_nemo.rank.moe_mamba import MoeMambaImportance

__all__ = [
    "MoeMambaPermutations",
    "apply_attention_permutation",
    "apply_expert_permutation",
    "apply_ffn_permutation",
    "apply_hidden_permutation",
    "apply_mamba_head_permutation",
    "apply_moe_mamba_permutations",
    "permutations_from_scores",
    "sorted_scores",
]

_READS = {
    "q",
    "k",
    "v",
    "up",
    "gate",
    "in_proj",
    "router",
    "shared_up",
    "shared_gate",
    "latent_down",
    "expert_up",
    "expert_gate",
}
_WRITES = {"o", "down", "out_proj", "shared_down", "latent_up", "expert_down"}


@dataclass
class MoeMambaPermutations:
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [E] new -> old expert
    expert_ffn: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [E, F], row = NEW expert
    shared_ffn: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [Fs]
    mamba_groups: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [G]
    mamba_heads: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [H] new -> old head
    groups: dict[int, torch.Tensor] = field(default_factory=dict)  # attention block -> [G] new -> old KV group
    heads: dict[int, torch.Tensor] = field(default_factory=dict)  # attention block -> [H] new -> old query head
    ffn: dict[int, torch.Tensor] = field(default_factory=dict)  # dense MLP block -> [F]
    hidden: torch.Tensor | None = None  # [h] new -> old channel; None: channels keep their order

    BLOCK_FIELDS = ("experts", "expert_ffn", "shared_ffn", "mamba_groups", "mamba_heads", "groups", "heads", "ffn")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: {str(g): t.tolist() for g, t in getattr(self, k).items()} for k in self.BLOCK_FIELDS}
        d["hidden"] = None if self.hidden is None else self.hidden.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoeMambaPermutations:
        """Inverse of ``to_dict``; fields missing in older files read as empty / ``None``."""
        per_block: dict[str, Any] = {
            k: {int(g): torch.tensor(t, dtype=torch.long) for g, t in d.get(k, {}).items()} for k in cls.BLOCK_FIELDS
        }
        out = cls(**per_block)
        out.hidden = None if d.get("hidden") is None else torch.tensor(d["hidden"], dtype=torch.long)
        return out


def permutations_from_scores(spec: ArchSpec, imp: MoeMambaImportance, sort_hidden: bool = True) -> MoeMambaPermutations:
    """Most-important-first orders of every scored dimension (hidden channels only if ``sort_hidden``)."""
    p = MoeMambaPermutations()
    for g, (b, s) in enumerate(zip(spec.blocks, imp.blocks, strict=True)):
        if s.experts is not None:
            order = _argsort_desc(s.experts)
            p.experts[g] = order
            if s.expert_ffn is not None:
                p.expert_ffn[g] = torch.stack([_argsort_desc(s.expert_ffn[e]) for e in order.tolist()])
        if s.shared_ffn is not None:
            p.shared_ffn[g] = _argsort_desc(s.shared_ffn)
        if s.mamba_heads is not None and isinstance(b, MambaBlock):
            p.mamba_groups[g], p.mamba_heads[g] = grouped_order(s.mamba_heads, b.num_groups)
        if s.heads is not None and isinstance(b, AttentionBlock):
            p.groups[g], p.heads[g] = grouped_order(s.heads, b.num_kv_groups)
        if s.ffn is not None:
            p.ffn[g] = _argsort_desc(s.ffn)
    if sort_hidden and imp.hidden is not None:
        p.hidden = _argsort_desc(imp.hidden)
    return p


def _check_grouped(g: int, what: str, heads: torch.Tensor, groups: torch.Tensor, n_groups: int) -> None:
    hpg = len(heads) // n_groups
    if not torch.equal(heads.view(n_groups, hpg) // hpg, groups.view(-1, 1).expand(-1, hpg)):
        raise ValueError(f"block {g}: the {what} order does not keep the heads of a group together in group order")


def apply_expert_permutation(
    spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, experts: torch.Tensor, expert_ffn: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Block ``g``'s routed experts in order ``experts`` (new -> old), each expert's neurons in
    order ``expert_ffn[new expert]``; router rows / selection bias move with their expert."""
    b, names, out = spec.blocks[g], hf_names(spec), dict(sd)
    assert isinstance(b, MoeBlock)
    for role in ("router", "router_bias") if spec.family == "nemotron_h" else ("router",):
        k = names.key(g, role)
        if k in out:
            out[k] = sd[k].index_select(0, experts)
    for new, old in enumerate(experts.tolist()):
        for role in ("expert_up", "expert_gate", "expert_down"):
            src = names.key(g, role, old)
            if src not in sd:
                continue
            t = sd[src]
            if expert_ffn is not None:
                t = _cols(t, expert_ffn[new]) if role == "expert_down" else t.index_select(0, expert_ffn[new])
            out[names.key(g, role, new)] = t
    return out


def apply_ffn_permutation(
    spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, order: torch.Tensor, prefix: str = "shared_"
) -> dict[str, torch.Tensor]:
    """Neurons of block ``g``'s shared expert (``prefix='shared_'``) or dense MLP (``prefix=''``)."""
    names, out = hf_names(spec), dict(sd)
    ups = [k for k in (names.key(g, prefix + "up"), names.key(g, prefix + "gate")) if k in out]
    permute_neurons(out, ups, names.key(g, prefix + "down"), order)
    return out


def apply_mamba_head_permutation(
    spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, heads: torch.Tensor, groups: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Block ``g``'s Mamba heads in order ``heads`` (new -> old); ``groups`` (new -> old) must be the
    group order ``heads`` follows (head i of new group k comes from old group ``groups[k]``)."""
    b, names, out = spec.blocks[g], hf_names(spec), dict(sd)
    assert isinstance(b, MambaBlock)
    _check_grouped(g, "Mamba head", heads, groups, b.num_groups)
    P, N, di, gn = b.head_dim, b.state_size, b.d_inner, b.num_groups * b.state_size
    k = lambda role: names.key(g, role)  # noqa: E731
    z, x, B, C, dt = sd[k("in_proj")].split([di, di, gn, gn, b.num_heads])
    out[k("in_proj")] = torch.cat(
        [_rows(z, heads, P), _rows(x, heads, P), _rows(B, groups, N), _rows(C, groups, N), dt.index_select(0, heads)]
    )
    for role in ("conv_w", "conv_b"):
        cx, cB, cC = sd[k(role)].split([di, gn, gn])
        out[k(role)] = torch.cat([_rows(cx, heads, P), _rows(cB, groups, N), _rows(cC, groups, N)])
    for role in ("dt_bias", "A_log", "D"):
        out[k(role)] = sd[k(role)].index_select(0, heads)
    out[k("mnorm")] = _rows(sd[k("mnorm")], heads, P)
    out[k("out_proj")] = _cols(sd[k("out_proj")], heads, P)
    return out


def apply_attention_permutation(
    spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, heads: torch.Tensor, groups: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Block ``g``'s query heads in order ``heads`` and KV groups in order ``groups`` (new -> old;
    ``heads`` must follow ``groups``, keeping each group's query heads together)."""
    b, names, out = spec.blocks[g], hf_names(spec), dict(sd)
    assert isinstance(b, AttentionBlock)
    _check_grouped(g, "attention head", heads, groups, b.num_kv_groups)
    q, k, v, o = (names.key(g, r) for r in "qkvo")
    permute_heads(out, q, k, v, o, heads, groups, b.head_dim)
    return out


def apply_hidden_permutation(
    spec: ArchSpec, sd: dict[str, torch.Tensor], order: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Hidden channels in ``order`` (new -> old) everywhere they appear (module docstring)."""
    names, out = hf_names(spec), dict(sd)
    reads = [k for k in (names.embed, names.lm_head) if k in out]
    writes: list[str] = []
    vectors = [names.final_norm]
    for g, b in enumerate(spec.blocks):
        latent = isinstance(b, MoeBlock) and bool(b.latent)
        for role, e, _ in block_roles(spec, b):
            if latent and role.startswith("expert_"):
                continue  # the experts read / write the latent space
            key = names.key(g, role, e)
            if role == "norm":
                vectors.append(key)
            elif role in _READS:
                reads.append(key)
            elif role in _WRITES:
                writes.append(key)
    permute_hidden(out, order, reads, writes, vectors)
    return out


def apply_moe_mamba_permutations(
    spec: ArchSpec, sd: dict[str, torch.Tensor], p: MoeMambaPermutations
) -> dict[str, torch.Tensor]:
    """Apply every permutation of ``p``; the function computed is unchanged."""
    out = dict(sd)
    for g, order in p.experts.items():
        out = apply_expert_permutation(spec, out, g, order, p.expert_ffn.get(g))
    for g, order in p.shared_ffn.items():
        out = apply_ffn_permutation(spec, out, g, order, "shared_")
    for g, order in p.ffn.items():
        out = apply_ffn_permutation(spec, out, g, order, "")
    for g, heads in p.mamba_heads.items():
        out = apply_mamba_head_permutation(spec, out, g, heads, p.mamba_groups[g])
    for g, heads in p.heads.items():
        out = apply_attention_permutation(spec, out, g, heads, p.groups[g])
    if p.hidden is not None:
        out = apply_hidden_permutation(spec, out, p.hidden)
    return out


def sorted_scores(imp: MoeMambaImportance, p: MoeMambaPermutations) -> MoeMambaImportance:
    """The scores in the reordered order (descending along every dimension; Mamba / attention heads
    per group, groups by their sum)."""
    from autocompress_nemo.rank.moe_mamba import BlockScores, MoeMambaImportance

    def by(x: torch.Tensor | None, order: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None or order is None else x[order]

    blocks = []
    for g, s in enumerate(imp.blocks):
        e = p.experts.get(g)
        blocks.append(
            BlockScores(
                experts=by(s.experts, e),
                expert_ffn=None
                if s.expert_ffn is None or e is None
                else torch.stack([s.expert_ffn[old][p.expert_ffn[g][new]] for new, old in enumerate(e.tolist())]),
                shared_ffn=by(s.shared_ffn, p.shared_ffn.get(g)),
                mamba_heads=by(s.mamba_heads, p.mamba_heads.get(g)),
                heads=by(s.heads, p.heads.get(g)),
                ffn=by(s.ffn, p.ffn.get(g)),
            )
        )
    hidden = imp.hidden if imp.hidden is None or p.hidden is None else imp.hidden[p.hidden]
    return MoeMambaImportance(blocks=blocks, tokens=imp.tokens, hidden=hidden)

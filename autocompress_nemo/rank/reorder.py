"""Permutations that sort every prunable dimension, most important first, and their
application to a Hugging Face Llama-named state dict (the interchange format).

Shapes in the HF state dict: ``q_proj [H*d, h]``, ``k_proj``/``v_proj [G*d, h]``,
``o_proj [h, H*d]``, ``gate_proj``/``up_proj [F, h]``, ``down_proj [h, F]``, norms ``[h]``,
``embed_tokens``/``lm_head [V, h]``. Query head ``i`` reads KV group ``i // (H/G)``.

Reordering is a change of basis that leaves the function unchanged:
- heads: KV groups are sorted by the summed score of their query heads, and the query
  heads inside each group by their own score; Q rows and O columns move with their head,
  K/V rows with their group (whole heads move, so RoPE's per-head layout is untouched);
- ffn: gate/up rows and down columns move together;
- hidden: every column of a matrix that reads the residual stream, every row of one that
  writes it, the norms' weights and the embeddings move together (RMSNorm is
  permutation-equivariant).

``grouped_order``, ``permute_heads``, ``permute_neurons`` and ``permute_hidden`` are shared with
the hybrid / MoE reordering (``reorder_hybrid.py``), which names tensors by ``models/hybrid/names.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.rank.importance import Importance


@dataclass
class Permutations:
    hidden: torch.Tensor  # [h] new -> old
    groups: list[torch.Tensor | None] = field(default_factory=list)  # per layer [G]
    heads: list[torch.Tensor | None] = field(default_factory=list)  # per layer [H] new -> old query head
    ffn: list[torch.Tensor | None] = field(default_factory=list)  # per layer [F]

    def to_dict(self) -> dict:
        def lst(x: torch.Tensor | None) -> list | None:
            return None if x is None else x.tolist()

        return {
            "hidden": self.hidden.tolist(),
            "groups": [lst(x) for x in self.groups],
            "heads": [lst(x) for x in self.heads],
            "ffn": [lst(x) for x in self.ffn],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Permutations:
        def t(x: list | None) -> torch.Tensor | None:
            return None if x is None else torch.tensor(x, dtype=torch.long)

        return cls(
            hidden=torch.tensor(d["hidden"], dtype=torch.long),
            groups=[t(x) for x in d["groups"]],
            heads=[t(x) for x in d["heads"]],
            ffn=[t(x) for x in d["ffn"]],
        )


def _argsort_desc(x: torch.Tensor) -> torch.Tensor:
    """Stable descending order (ties keep their original order: determinism)."""
    return torch.argsort(-x.double(), stable=True)


def grouped_order(scores: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group order [G], unit order [G*u])`` (new -> old) of ``scores [G*u]``, units ``g*u .. g*u+u-1``
    belonging to group ``g``: groups by their summed score, the units inside each group by their
    own score, so a group's units stay together (attention query heads of a KV group, Mamba heads
    of a group)."""
    per_group = scores.view(n_groups, -1)
    u = per_group.shape[1]
    groups = _argsort_desc(per_group.sum(dim=1))
    return groups, torch.cat([g * u + _argsort_desc(per_group[g]) for g in groups.tolist()])


def permutations_from_scores(spec: ArchSpec, imp: Importance, sort_hidden: bool = True) -> Permutations:
    layers = spec.layers()
    hidden = _argsort_desc(imp.hidden) if sort_hidden else torch.arange(spec.hidden)
    perms = Permutations(hidden=hidden)
    for (attn, _mlp), s in zip(layers, imp.layers, strict=True):
        g_order, head_order = (
            (None, None) if attn.removed or s.heads is None else grouped_order(s.heads, attn.num_kv_groups)
        )
        perms.groups.append(g_order)
        perms.heads.append(head_order)
        perms.ffn.append(None if s.ffn is None else _argsort_desc(s.ffn))
    return perms


def _rows(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """Select row blocks of size ``unit`` (one head = ``d`` rows) in order ``idx``."""
    return w.view(-1, unit, *w.shape[1:]).index_select(0, idx).reshape(w.shape)


def _cols(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    return _rows(w.transpose(0, 1), idx, unit).transpose(0, 1).contiguous()


def permute_heads(
    sd: dict[str, torch.Tensor],
    q: str,
    k: str,
    v: str,
    o: str,
    heads: torch.Tensor,
    groups: torch.Tensor,
    head_dim: int,
) -> None:
    """In place: query heads of ``q`` (rows) and ``o`` (columns) in order ``heads``, KV groups of ``k``
    / ``v`` (rows) in order ``groups``, ``head_dim`` rows / columns per head; biases move along."""
    for name, idx in ((q, heads), (k, groups), (v, groups)):
        sd[name] = _rows(sd[name], idx, head_dim)
        bias = name.removesuffix(".weight") + ".bias"
        if bias in sd:
            sd[bias] = _rows(sd[bias], idx, head_dim)
    sd[o] = _cols(sd[o], heads, head_dim)


def permute_hidden(
    sd: dict[str, torch.Tensor],
    order: torch.Tensor,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    vectors: Iterable[str] = (),
) -> None:
    """In place: hidden channels in ``order`` — columns of the matrices that read the residual
    stream, rows of those that write it (and their biases), entries of the norm weights."""
    for name in reads:
        sd[name] = _cols(sd[name], order)
    for name in writes:
        sd[name] = _rows(sd[name], order)
        bias = name.removesuffix(".weight") + ".bias"
        if bias in sd:
            sd[bias] = sd[bias][order]
    for name in vectors:
        sd[name] = sd[name][order]


def apply_permutations(spec: ArchSpec, sd: dict[str, torch.Tensor], p: Permutations) -> dict[str, torch.Tensor]:
    """A new state dict with every dimension reordered; the function computed is unchanged."""
    out = dict(sd)
    reads: list[str] = [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in out]
    writes: list[str] = []
    vectors = ["model.norm.weight"]
    for li, (attn, mlp) in enumerate(spec.layers()):
        pre = f"model.layers.{li}."
        if not attn.removed:
            q, k, v, o = (pre + f"self_attn.{n}_proj.weight" for n in "qkvo")
            if p.heads[li] is not None:
                permute_heads(out, q, k, v, o, p.heads[li], p.groups[li], attn.head_dim)  # type: ignore[arg-type]
            reads += [q, k, v]
            writes.append(o)
            vectors.append(pre + "input_layernorm.weight")
        if not mlp.removed:
            g, u, dn = (pre + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
            if p.ffn[li] is not None:
                permute_neurons(out, [n for n in (g, u) if n in out], dn, p.ffn[li])  # type: ignore[arg-type]
            reads += [n for n in (g, u) if n in out]
            writes.append(dn)
            vectors.append(pre + "post_attention_layernorm.weight")
    permute_hidden(out, p.hidden, reads, writes, vectors)
    return out


def permute_neurons(sd: dict[str, torch.Tensor], ups: Iterable[str], down: str, order: torch.Tensor) -> None:
    """In place: ffn neurons in ``order`` — rows of the up (gate) matrices, columns of ``down``."""
    for name in ups:
        sd[name] = sd[name].index_select(0, order)
    sd[down] = _cols(sd[down], order)


def sorted_importance(imp: Importance, p: Permutations) -> Importance:
    """The scores in the sorted order (descending along every dimension)."""
    from autocompress_nemo.rank.importance import LayerScores

    layers = []
    for li, s in enumerate(imp.layers):
        layers.append(
            LayerScores(
                heads=None if s.heads is None else s.heads[p.heads[li]],
                ffn=None if s.ffn is None else s.ffn[p.ffn[li]],
                attn_block=s.attn_block,
                mlp_block=s.mlp_block,
            )
        )
    return Importance(hidden=imp.hidden[p.hidden], layers=layers, tokens=imp.tokens)

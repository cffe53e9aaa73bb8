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
"""

from __future__ import annotations

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


def permutations_from_scores(spec: ArchSpec, imp: Importance, sort_hidden: bool = True) -> Permutations:
    layers = spec.layers()
    hidden = _argsort_desc(imp.hidden) if sort_hidden else torch.arange(spec.hidden)
    perms = Permutations(hidden=hidden)
    for (attn, _mlp), s in zip(layers, imp.layers, strict=True):
        if attn.removed or s.heads is None:
            perms.groups.append(None)
            perms.heads.append(None)
        else:
            hpg = attn.heads_per_group
            per_group = s.heads.view(attn.num_kv_groups, hpg)
            g_order = _argsort_desc(per_group.sum(dim=1))
            head_order = torch.cat([g * hpg + _argsort_desc(per_group[g]) for g in g_order.tolist()])
            perms.groups.append(g_order)
            perms.heads.append(head_order)
        perms.ffn.append(None if s.ffn is None else _argsort_desc(s.ffn))
    return perms


def _rows(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """Select row blocks of size ``unit`` (one head = ``d`` rows) in order ``idx``."""
    if unit == 1:
        return w.index_select(0, idx)
    blocks = w.view(-1, unit, *w.shape[1:])
    return blocks.index_select(0, idx).reshape(-1, *w.shape[1:])


def _cols(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    return _rows(w.t(), idx, unit).t().contiguous()


def apply_permutations(spec: ArchSpec, sd: dict[str, torch.Tensor], p: Permutations) -> dict[str, torch.Tensor]:
    """A new state dict with every dimension reordered; the function computed is unchanged."""
    out = dict(sd)
    P = p.hidden
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = _cols(out[name], P)
    out["model.norm.weight"] = out["model.norm.weight"][P]
    for li, (attn, mlp) in enumerate(spec.layers()):
        pre = f"model.layers.{li}."
        if not attn.removed:
            d = attn.head_dim
            q, k, v, o = (pre + f"self_attn.{n}_proj.weight" for n in "qkvo")
            heads, groups = p.heads[li], p.groups[li]
            if heads is not None:
                out[q] = _rows(out[q], heads, d)
                out[k] = _rows(out[k], groups, d)
                out[v] = _rows(out[v], groups, d)
                out[o] = _cols(out[o], heads, d)
                for bias, idx in ((q, heads), (k, groups), (v, groups)):
                    b = bias.replace(".weight", ".bias")
                    if b in out:
                        out[b] = _rows(out[b], idx, d)
            for n in (q, k, v):
                out[n] = _cols(out[n], P)
            out[o] = _rows(out[o], P)
            out[pre + "input_layernorm.weight"] = out[pre + "input_layernorm.weight"][P]
        if not mlp.removed:
            g, u, dn = (pre + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
            f = p.ffn[li]
            if f is not None:
                out[u] = _rows(out[u], f)
                out[dn] = _cols(out[dn], f)
                if g in out:
                    out[g] = _rows(out[g], f)
            for n in (g, u):
                if n in out:
                    out[n] = _cols(out[n], P)
            out[dn] = _rows(out[dn], P)
            out[pre + "post_attention_layernorm.weight"] = out[pre + "post_attention_layernorm.weight"][P]
    return out


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

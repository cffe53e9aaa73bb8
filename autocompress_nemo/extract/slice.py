"""Slice a child architecture out of the importance-sorted parent's Hugging Face-named state dict,
for every model family (names by role: ``models/hybrid/names.py``; tensors of a block by role and
shape: ``models/hybrid/state_dict.block_roles``).

Every child dimension is a prefix of the sorted parent's (``rank/`` sorts them):

- attention: the first ``G'`` KV groups and the first ``H'/G'`` query heads of each (``kept_heads``);
  q/k/v biases (Qwen2) with their rows;
- mlp / shared expert: the first ``F'`` / ``S'`` neurons (up, gate rows; down columns);
- routed experts: experts ``0..E'-1`` (router rows and the selection bias with them), each
  expert's first ``F'`` neurons;
- Mamba: the first ``G'`` groups, i.e. heads ``0..H'-1`` (``H' = G' * H/G``): rows of ``z``,
  ``x``, ``B``, ``C``, ``dt`` in ``in_proj``, conv channels ``x``/``B``/``C``, ``dt_bias``,
  ``A_log``, ``D``, the gated-norm weight, ``out_proj`` columns.

Hidden size is kept (the search space does not vary it). A removed block has no tensors.
"""

from __future__ import annotations

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.blocks.attention import kept_heads

__all__ = ["check_child", "kept_heads", "slice_state_dict"]


def check_child(parent: ArchSpec, child: ArchSpec) -> None:
    """Raise one ``ValueError`` naming every block of ``child`` that is not a prefix of the parent's."""
    problems = []
    if len(parent.blocks) != len(child.blocks) or parent.hidden != child.hidden or parent.family != child.family:
        problems.append(
            f"block count ({len(child.blocks)} vs {len(parent.blocks)}), hidden size ({child.hidden} vs "
            f"{parent.hidden}) and family ({child.family} vs {parent.family}) must equal the parent's"
        )
    for i, (p, c) in enumerate(zip(parent.blocks, child.blocks, strict=False)):
        if c.removed:
            continue
        if p.kind != c.kind:
            problems.append(f"block {i}: kind {c.kind} != parent's {p.kind}")
        elif why := kind_of(c).prefix_problem(p, c):
            problems.append(f"block {i}: {why}")
    if problems:
        raise ValueError("child architecture is not a sub-network of the parent: " + "; ".join(problems))


def slice_state_dict(parent: ArchSpec, sorted_sd: dict[str, torch.Tensor], child: ArchSpec) -> dict[str, torch.Tensor]:
    """The child's Hugging Face-named state dict: prefixes of the sorted parent (contiguous copies)."""
    from autocompress_nemo.models.hybrid.names import hf_names
    from autocompress_nemo.models.hybrid.state_dict import block_roles

    check_child(parent, child)
    names = hf_names(parent)
    out: dict[str, torch.Tensor] = {}
    for k in (names.embed, names.final_norm, names.lm_head):
        if k in sorted_sd and (k != names.lm_head or not child.tied_embeddings):
            out[k] = sorted_sd[k].clone()
    for i, c in enumerate(child.blocks):
        for role, expert, shape in block_roles(child, c):
            key = names.key(i, role, expert)
            if key not in sorted_sd:
                raise KeyError(f"sorted parent state dict has no {key!r} (block {i}, role {role}); is it the parent's?")
            t = kind_of(c).slice(parent.blocks[i], c, role, sorted_sd[key], shape)
            if tuple(t.shape) != shape:
                raise ValueError(f"{key}: sliced shape {tuple(t.shape)} != child shape {shape}")
            out[key] = t.contiguous().clone()
    return out

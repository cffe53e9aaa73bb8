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

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock


def kept_heads(parent_hpg: int, groups: int, heads_per_group: int) -> torch.Tensor:
    """Indices of the parent's query heads a child (G', H'/G') keeps: the first ``heads_per_group``
    of each of the first ``groups`` KV groups (the one rule; the supernet masks and the importance
    of an attention option use it too)."""
    return torch.tensor([g * parent_hpg + r for g in range(groups) for r in range(heads_per_group)], dtype=torch.long)


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
        elif isinstance(c, AttentionBlock) and isinstance(p, AttentionBlock):
            if c.num_kv_groups > p.num_kv_groups or c.heads_per_group > p.heads_per_group or c.head_dim != p.head_dim:
                problems.append(f"block {i}: attention {c} is not a prefix of the parent's {p}")
        elif isinstance(c, MlpBlock) and isinstance(p, MlpBlock) and c.ffn > p.ffn:
            problems.append(f"block {i}: ffn {c.ffn} > parent's {p.ffn}")
        elif (
            isinstance(c, MoeBlock)
            and isinstance(p, MoeBlock)
            and (
                c.num_experts > p.num_experts
                or c.expert_ffn > p.expert_ffn
                or c.shared_ffn > p.shared_ffn
                or (c.num_experts and c.latent != p.latent)
                or c.activation != p.activation
            )
        ):
            problems.append(f"block {i}: MoE {c} is not a prefix of {p}")
        elif isinstance(c, MambaBlock) and isinstance(p, MambaBlock):
            hpg = p.num_heads // p.num_groups
            if (
                (c.head_dim, c.state_size, c.conv_kernel) != (p.head_dim, p.state_size, p.conv_kernel)
                or c.num_heads > p.num_heads
                or c.num_heads != c.num_groups * hpg
            ):
                problems.append(f"block {i}: Mamba {c} must keep whole groups of {hpg} heads of {p}")
    if problems:
        raise ValueError("child architecture is not a sub-network of the parent: " + "; ".join(problems))


def _mamba_rows(p: MambaBlock, c: MambaBlock, conv: bool) -> torch.Tensor:
    """Rows of ``in_proj`` (``[z; x; B; C; dt]``) or the conv (``[x; B; C]``) that the child keeps."""
    di, gn = p.d_inner, p.num_groups * p.state_size
    dk, gk = c.d_inner, c.num_groups * c.state_size
    ar = torch.arange
    if conv:
        return torch.cat([ar(dk), di + ar(gk), di + gn + ar(gk)])
    return torch.cat([ar(dk), di + ar(dk), 2 * di + ar(gk), 2 * di + gn + ar(gk), 2 * di + 2 * gn + ar(c.num_heads)])


def _slice_block(p: object, c: object, role: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(p, AttentionBlock) and isinstance(c, AttentionBlock) and role in ("q", "q_bias", "o"):
        heads = kept_heads(p.heads_per_group, c.num_kv_groups, c.heads_per_group)
        rows = (heads[:, None] * p.head_dim + torch.arange(p.head_dim)).reshape(-1)
        return t[:, rows] if role == "o" else t[rows]
    if isinstance(p, MambaBlock) and isinstance(c, MambaBlock) and role in ("in_proj", "conv_w", "conv_b"):
        return t[_mamba_rows(p, c, conv=role != "in_proj")]
    # every other role is a prefix along each dimension (routed experts by index, kept by the caller)
    return t[tuple(slice(0, n) for n in shape)]


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
            t = _slice_block(parent.blocks[i], c, role, sorted_sd[key], shape)
            if tuple(t.shape) != shape:
                raise ValueError(f"{key}: sliced shape {tuple(t.shape)} != child shape {shape}")
            out[key] = t.contiguous().clone()
    return out

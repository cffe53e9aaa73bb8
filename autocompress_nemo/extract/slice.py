"""Slice a child architecture out of the importance-sorted parent (HF Llama-named state dict).

Every child dimension is a prefix of the sorted parent's: the first ``G'`` KV groups,
the first ``H'/G'`` query heads of each of them, the first ``F'`` ffn neurons, the first
``h'`` hidden channels. A removed block has no tensors.
"""

from __future__ import annotations

import torch

from autocompress_nemo.arch.spec import ArchSpec


def kept_heads(parent_hpg: int, groups: int, heads_per_group: int) -> torch.Tensor:
    """Indices of the parent's query heads a child (G', H'/G') keeps."""
    return torch.tensor([g * parent_hpg + r for g in range(groups) for r in range(heads_per_group)], dtype=torch.long)


def check_child(parent: ArchSpec, child: ArchSpec) -> None:
    problems = []
    if len(parent.blocks) != len(child.blocks):
        problems.append(f"block count {len(child.blocks)} != parent's {len(parent.blocks)}")
    if child.hidden > parent.hidden:
        problems.append(f"hidden {child.hidden} > parent's {parent.hidden}")
    for i, (pb, cb) in enumerate(zip(parent.blocks, child.blocks, strict=False)):
        if pb.kind != cb.kind:
            problems.append(f"block {i}: kind {cb.kind} != parent's {pb.kind}")
        elif pb.kind == "attention" and not cb.removed:
            if (
                cb.num_kv_groups > pb.num_kv_groups
                or cb.heads_per_group > pb.heads_per_group
                or cb.head_dim != pb.head_dim
            ):
                problems.append(f"block {i}: attention {cb} is not a prefix of the parent's {pb}")
        elif pb.kind == "mlp" and cb.ffn > pb.ffn:
            problems.append(f"block {i}: ffn {cb.ffn} > parent's {pb.ffn}")
    if problems:
        raise ValueError("child architecture is not a sub-network of the parent: " + "; ".join(problems))


def slice_state_dict(parent: ArchSpec, sorted_sd: dict[str, torch.Tensor], child: ArchSpec) -> dict[str, torch.Tensor]:
    """The child's state dict: prefixes of every sorted parent dimension (copies, contiguous)."""
    if parent.kinds() & {"moe", "mamba"}:  # MoE / Mamba hybrids: HF-named per family (H7)
        from autocompress_nemo.extract.slice_hybrid import slice_hybrid_state_dict

        return slice_hybrid_state_dict(parent, sorted_sd, child)
    check_child(parent, child)
    hk = child.hidden
    out: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in sorted_sd:
            out[name] = sorted_sd[name][:, :hk].clone()
    out["model.norm.weight"] = sorted_sd["model.norm.weight"][:hk].clone()
    for li, ((pa, _pm), (ca, cm)) in enumerate(zip(parent.layers(), child.layers(), strict=True)):
        pre = f"model.layers.{li}."
        if not ca.removed:
            d = pa.head_dim
            heads = kept_heads(pa.heads_per_group, ca.num_kv_groups, ca.heads_per_group)
            q_rows = (heads[:, None] * d + torch.arange(d)).reshape(-1)
            kv_rows = torch.arange(ca.num_kv_groups * d)
            for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                w = sorted_sd[pre + f"self_attn.{n}_proj.weight"]
                out[pre + f"self_attn.{n}_proj.weight"] = w[rows][:, :hk].clone()
                b = sorted_sd.get(pre + f"self_attn.{n}_proj.bias")
                if b is not None:
                    out[pre + f"self_attn.{n}_proj.bias"] = b[rows].clone()
            out[pre + "self_attn.o_proj.weight"] = sorted_sd[pre + "self_attn.o_proj.weight"][:hk][:, q_rows].clone()
            out[pre + "input_layernorm.weight"] = sorted_sd[pre + "input_layernorm.weight"][:hk].clone()
        if not cm.removed:
            f = cm.ffn
            for n in ("gate", "up"):
                key = pre + f"mlp.{n}_proj.weight"
                if key in sorted_sd:
                    out[key] = sorted_sd[key][:f, :hk].clone()
            out[pre + "mlp.down_proj.weight"] = sorted_sd[pre + "mlp.down_proj.weight"][:hk, :f].clone()
            out[pre + "post_attention_layernorm.weight"] = sorted_sd[pre + "post_attention_layernorm.weight"][
                :hk
            ].clone()
    return out

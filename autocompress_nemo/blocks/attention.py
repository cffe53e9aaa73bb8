"""Attention blocks (GQA): options are (KV groups kept, query heads per group kept); the kept heads
are the first ``heads_per_group`` of each of the first ``kv_groups`` groups (``kept_heads``, the one
rule). Removed when ``num_heads == 0`` where the engine can remove attention."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock
from autocompress_nemo.blocks.base import Decision, Grid, Key, Kind, Role, Scores, must_keep, need
from autocompress_nemo.rank.permute import check_grouped, grouped_order, permute_heads


def kept_heads(parent_hpg: int, groups: int, heads_per_group: int) -> torch.Tensor:
    """Indices of the parent's query heads a child (G', H'/G') keeps."""
    return torch.tensor([g * parent_hpg + r for g in range(groups) for r in range(heads_per_group)], dtype=torch.long)


def attention_options(parent: AttentionBlock, caps: Any, allow_remove: bool) -> list[AttentionBlock]:
    """(groups, heads per group) prefixes the engine can serve, ordered by kept query heads."""
    hpg = parent.heads_per_group
    vary_q = caps.vary_query_heads
    # Dropping KV groups by prefix drops their query heads too, so it needs per-layer query
    # heads. Engines that keep query heads global (TensorRT-LLM / vLLM DeciLM) would need KV
    # heads merged instead of sliced, which this build does not do: there attention is kept
    # whole or removed.
    vary_groups = caps.vary_kv_groups and vary_q
    groups = range(1, parent.num_kv_groups + 1) if vary_groups else [parent.num_kv_groups]
    per_group = range(1, hpg + 1) if vary_q else [hpg]
    opts = {AttentionBlock(g * q, g, parent.head_dim) for g, q in itertools.product(groups, per_group)}
    ordered = sorted(opts, key=lambda b: (b.num_heads, b.num_kv_groups))
    # the parent last: among equal head counts prefer more KV groups (it is the parent's shape)
    ordered.remove(parent)
    ordered.append(parent)
    if allow_remove:
        ordered.insert(0, AttentionBlock(0, 0, parent.head_dim))
    return ordered


def _rows(p: AttentionBlock, c: AttentionBlock) -> torch.Tensor:
    heads = kept_heads(p.heads_per_group, c.num_kv_groups, c.heads_per_group)
    return (heads[:, None] * p.head_dim + torch.arange(p.head_dim)).reshape(-1)


class Attention(Kind):
    name = "attention"
    plot_unit = "query heads"
    block_type = AttentionBlock
    decision_kinds = ("attention",)

    def decisions(self, spec: ArchSpec, i: int, block: AttentionBlock, caps: Any, grid: Grid) -> list[Decision]:
        allow = caps.remove_attention and not (i == 0 and caps.first_block_full) and not must_keep(spec, i, caps)
        opts = attention_options(block, caps, allow)
        return [Decision(i, "attention", tuple(opts))] if len(opts) > 1 else []

    def masks(self, d: Decision[AttentionBlock], parent_block: AttentionBlock) -> dict[str, torch.Tensor]:
        """Per query head, on the ``linear_proj`` input (a dropped KV group has all its query heads
        masked, so its K/V are never read)."""
        rows = []
        for o in d.options:
            row = torch.zeros(parent_block.num_heads)
            row[kept_heads(parent_block.heads_per_group, o.num_kv_groups, o.heads_per_group)] = 1.0
            rows.append(row)
        return {"out": torch.stack(rows)}

    def mask_sites(self, d: Decision[AttentionBlock], layer: Any, pb: AttentionBlock) -> list:
        return [(layer.self_attention.linear_proj, "out", pb.head_dim, pb.num_heads, True)]

    def kept_importance(self, d: Decision[AttentionBlock], option: AttentionBlock, scores: Any) -> float:
        heads = need(scores, "heads", d)
        parent_hpg = len(heads) // d.options[-1].num_kv_groups  # (last = the parent's)
        return float(heads[kept_heads(parent_hpg, option.num_kv_groups, option.heads_per_group)].sum())

    def widths(self, option: AttentionBlock) -> tuple[int, ...]:
        return (option.num_heads, option.num_kv_groups)

    def describe(self, block: AttentionBlock) -> str:
        return f"A{block.num_heads}h{block.num_kv_groups}kv"

    def words(self, block: AttentionBlock) -> str:
        return f"{block.num_heads}h/{block.num_kv_groups}kv"

    def fields(self, block: AttentionBlock) -> str:
        return f"heads={block.num_heads} kv={block.num_kv_groups}"

    def plot_width(self, block: AttentionBlock) -> int:
        return block.num_heads

    def prefix_problem(self, p: AttentionBlock, c: AttentionBlock) -> str | None:
        if c.num_kv_groups > p.num_kv_groups or c.heads_per_group > p.heads_per_group or c.head_dim != p.head_dim:
            return f"attention {c} is not a prefix of the parent's {p}"
        return None

    def slice(
        self, p: AttentionBlock, c: AttentionBlock, role: str, t: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if role in ("q", "q_bias"):
            return t[_rows(p, c)]
        if role == "o":
            return t[:, _rows(p, c)]
        return super().slice(p, c, role, t, shape)  # k, v (+ biases): the first G' groups; norms

    def gguf_matrices(self, b: AttentionBlock, hidden: int) -> list[tuple[str, tuple[int, int]]]:
        q, kv = b.num_heads * b.head_dim, b.num_kv_groups * b.head_dim
        return [
            ("attn_q", (hidden, q)),
            ("attn_k", (hidden, kv)),
            ("attn_v", (hidden, kv)),
            ("attn_output", (q, hidden)),
        ]

    def roles(self, spec: ArchSpec, b: AttentionBlock) -> list[Role]:
        h, d = spec.hidden, b.head_dim
        q, kv = b.num_heads * d, b.num_kv_groups * d
        out: list[Role] = [("q", None, (q, h)), ("k", None, (kv, h)), ("v", None, (kv, h)), ("o", None, (h, q))]
        if spec.qk_norm:
            out += [("q_norm", None, (d,)), ("k_norm", None, (d,))]
        if spec.qkv_bias:  # Qwen2
            out += [("q_bias", None, (q,)), ("k_bias", None, (kv,)), ("v_bias", None, (kv,))]
        return out

    def refit(self, p: AttentionBlock, c: AttentionBlock) -> tuple[str, torch.Tensor] | None:
        """``o``'s columns: the channels of the query heads the child keeps."""
        return ("o", _rows(p, c)) if 0 < c.num_heads < p.num_heads else None

    def refit_site(self, layer: Any) -> Any:
        return layer.self_attention.linear_proj

    def score(self, acc: Any, layer: Any, i: int, b: AttentionBlock) -> None:
        """Query head i: ``mean_t ||W_o[:, i] o_ti||`` (a KV group scores the sum of its heads)."""
        acc.head_norms(layer.self_attention.linear_proj, (i, "heads"), b.head_dim)
        acc.channels(layer.self_attention.linear_qkv)

    def orders(self, b: AttentionBlock, scores: Scores) -> dict[str, torch.Tensor]:
        """KV groups by the summed score of their query heads, query heads within a group by their own."""
        if "heads" not in scores:
            return {}
        groups, heads = grouped_order(scores["heads"], b.num_kv_groups)
        return {"groups": groups, "heads": heads}

    def permute(
        self, sd: dict[str, torch.Tensor], key: Key, b: AttentionBlock, orders: dict[str, torch.Tensor]
    ) -> None:
        if "heads" in orders:
            check_grouped(key("o"), orders["heads"], orders["groups"], b.num_kv_groups)
            permute_heads(sd, key("q"), key("k"), key("v"), key("o"), orders["heads"], orders["groups"], b.head_dim)

    def megatron_config(self, base: Any, b: AttentionBlock) -> Any:
        return dataclasses.replace(
            base, num_attention_heads=b.num_heads, num_query_groups=b.num_kv_groups, kv_channels=b.head_dim
        )

    def megatron_spec(self, b: AttentionBlock, config: Any, m: dict[str, Any], chunk_size: int) -> Any:
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

        qk = m["qk"] if config.qk_layernorm else IdentityOp
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=m["col"], core_attention=m["core"], linear_proj=m["row"], q_layernorm=qk, k_layernorm=qk
            ),
        )
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=m["norm"],
                self_attention=attention,
                self_attn_bda=get_bias_dropout_add,
                # checkpoint keys as with TE (norm fused into linear_qkv): models.builder.te_keys_map
                sharded_state_dict_keys_map={}
                if m["te"]
                else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
            ),
        )

    def shard_problem(self, b: AttentionBlock, tp: int, ep: int, etp: int) -> str | None:
        if b.num_heads % tp or b.num_kv_groups % tp:
            return f"{b.num_heads} heads / {b.num_kv_groups} KV groups vs TP={tp}"
        return None

    def capability_problems(self, i: int, b: AttentionBlock, r: AttentionBlock | None, caps: Any) -> list[str]:
        if b.removed or r is None:
            return super().capability_problems(i, b, r, caps)
        out = []
        if b.num_heads != r.num_heads and not caps.vary_query_heads:
            out.append(
                f"block {i}: {b.num_heads} query heads differ from the parent's {r.num_heads} "
                "(vary_query_heads=False: per-layer query heads are not served)"
            )
        if b.num_kv_groups != r.num_kv_groups and not caps.vary_kv_groups:
            out.append(
                f"block {i}: {b.num_kv_groups} KV groups differ from the parent's {r.num_kv_groups} (vary_kv_groups=False)"
            )
        if b.head_dim != r.head_dim:
            out.append(f"block {i}: head_dim {b.head_dim} differs from {r.head_dim} (one head_dim per model)")
        return out

    def min_block(self, b: AttentionBlock, caps: Any) -> AttentionBlock:
        if caps.remove_attention:
            return AttentionBlock(0, 0, b.head_dim)
        groups = 1 if caps.vary_kv_groups else b.num_kv_groups
        heads = groups if caps.vary_query_heads else b.num_heads  # one query head per group
        return AttentionBlock(heads, groups, b.head_dim)

    def sharded_sizes(self, b: AttentionBlock) -> list[tuple[str, str, int]]:
        return [("tp", "attention num_heads", b.num_heads), ("tp", "attention num_kv_groups", b.num_kv_groups)]

    def mixing_flops(self, b: AttentionBlock, seq_len: int, full_square: bool = False) -> float:
        """QK^T and PV: ``2 * 2 * s * H * d``, halved by the causal mask unless ``full_square``."""
        return (4.0 if full_square else 2.0) * seq_len * b.num_heads * b.head_dim

    def params(self, b: AttentionBlock, hidden: int, active: bool = False) -> int:
        """Q, K, V, O projections and the input norm, no biases: ``2*h*H*d + 2*h*G*d + h``."""
        return hidden * b.num_heads * b.head_dim * 2 + 2 * hidden * b.num_kv_groups * b.head_dim + hidden

    def kv_bytes_per_token(self, b: AttentionBlock, dtype_bytes: float) -> float:
        """K and V: ``2*G*d*bytes``."""
        return 2 * b.num_kv_groups * b.head_dim * dtype_bytes

    def activation_width(self, b: AttentionBlock, hidden: int) -> int:
        return (b.num_heads + 2 * b.num_kv_groups) * b.head_dim

    def size(self, b: AttentionBlock) -> int:
        return b.num_heads * 1000 + b.num_kv_groups

    def interpolate(self, b: AttentionBlock, entries: list[tuple[Any, float]]) -> float | None:
        """``a + c*H + e*G`` by least squares over the profiled options of the same head size (>= 3)."""
        rows = [(1.0, eb.num_heads, eb.num_kv_groups, v) for eb, v in entries if eb.head_dim == b.head_dim]
        if len(rows) < 3:
            return None
        a = np.array([r[:3] for r in rows])
        coef, *_ = np.linalg.lstsq(a, np.array([r[3] for r in rows]), rcond=None)
        return float(coef @ np.array([1.0, b.num_heads, b.num_kv_groups]))

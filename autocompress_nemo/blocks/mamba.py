"""Mamba-2 blocks: heads kept **in whole groups** (``G' * H/G`` heads, ``G' = 1..G``): the gated
RMSNorm normalizes over the channels of one group, so keeping part of a group changes the
normalization of the heads that stay (masking would not equal the extracted child); whole groups
are exact. ``vary_mamba_heads``; ``remove_mamba`` adds ``G' = 0``. The supernet masks per head on
the ``out_proj`` input (after the gated norm)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, MambaBlock
from autocompress_nemo.blocks.base import Decision, Grid, Key, Kind, Role, Scores, must_keep, need, prefix_rows
from autocompress_nemo.rank.permute import check_grouped, cols, grouped_order, rows


def mamba_options(parent: MambaBlock, caps: Any, allow_remove: bool | None = None) -> list[MambaBlock]:
    """Whole groups: ``G' * H/G`` heads for ``G' = 1..G`` (0 when ``allow_remove``, by default
    ``remove_mamba``)."""
    hpg = parent.num_heads // parent.num_groups
    groups = range(1, parent.num_groups + 1) if caps.vary_mamba_heads else [parent.num_groups]
    opts = [dataclasses.replace(parent, num_heads=g * hpg, num_groups=g) for g in groups]
    if caps.remove_mamba if allow_remove is None else allow_remove:
        opts.insert(0, dataclasses.replace(parent, num_heads=0))
    return opts


def _rows(p: MambaBlock, c: MambaBlock, conv: bool) -> torch.Tensor:
    """Rows of ``in_proj`` (``[z; x; B; C; dt]``) or the conv (``[x; B; C]``) that the child keeps."""
    di, gn = p.d_inner, p.num_groups * p.state_size
    dk, gk = c.d_inner, c.num_groups * c.state_size
    ar = torch.arange
    if conv:
        return torch.cat([ar(dk), di + ar(gk), di + gn + ar(gk)])
    return torch.cat([ar(dk), di + ar(dk), 2 * di + ar(gk), 2 * di + gn + ar(gk), 2 * di + 2 * gn + ar(c.num_heads)])


class Mamba(Kind):
    name = "mamba"
    plot_unit = "heads"
    block_type = MambaBlock
    decision_kinds = ("mamba",)

    def decisions(self, spec: ArchSpec, i: int, block: MambaBlock, caps: Any, grid: Grid) -> list[Decision]:
        opts = mamba_options(block, caps, caps.remove_mamba and not must_keep(spec, i, caps))
        return [Decision(i, "mamba", tuple(opts))] if len(opts) > 1 else []

    def masks(self, d: Decision[MambaBlock], parent_block: MambaBlock) -> dict[str, torch.Tensor]:
        return {"out": prefix_rows(parent_block.num_heads, [o.num_heads for o in d.options])}

    def mask_sites(self, d: Decision[MambaBlock], layer: Any, pb: MambaBlock) -> list:
        return [(layer.mixer.out_proj, "out", pb.head_dim, pb.num_heads, True)]

    def kept_importance(self, d: Decision[MambaBlock], option: MambaBlock, scores: Any) -> float:
        return float(need(scores, "mamba_heads", d)[: option.num_heads].sum())

    def widths(self, option: MambaBlock) -> tuple[int, ...]:
        return (option.num_heads,)

    def describe(self, block: MambaBlock) -> str:
        return f"M{block.num_heads}h{block.num_groups}g"

    def words(self, block: MambaBlock) -> str:
        return f"{block.num_heads} heads/{block.num_groups} groups"

    def fields(self, block: MambaBlock) -> str:
        return f"heads={block.num_heads}"

    def plot_width(self, block: MambaBlock) -> int:
        return block.num_heads

    def prefix_problem(self, p: MambaBlock, c: MambaBlock) -> str | None:
        hpg = p.num_heads // p.num_groups
        if (
            (c.head_dim, c.state_size, c.conv_kernel) != (p.head_dim, p.state_size, p.conv_kernel)
            or c.num_heads > p.num_heads
            or c.num_heads != c.num_groups * hpg
        ):
            return f"Mamba {c} must keep whole groups of {hpg} heads of {p}"
        return None

    def slice(self, p: MambaBlock, c: MambaBlock, role: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if role in ("in_proj", "conv_w", "conv_b"):
            return t[_rows(p, c, conv=role != "in_proj")]
        return super().slice(p, c, role, t, shape)

    def roles(self, spec: ArchSpec, b: MambaBlock) -> list[Role]:
        h, gn, di, nh = spec.hidden, b.num_groups * b.state_size, b.d_inner, b.num_heads
        return [
            ("in_proj", None, (2 * di + 2 * gn + nh, h)),
            ("conv_w", None, (di + 2 * gn, 1, b.conv_kernel)),
            ("conv_b", None, (di + 2 * gn,)),
            ("dt_bias", None, (nh,)),
            ("A_log", None, (nh,)),
            ("D", None, (nh,)),
            ("mnorm", None, (di,)),
            ("out_proj", None, (h, di)),
        ]

    def score(self, acc: Any, layer: Any, i: int, b: MambaBlock) -> None:
        """Head i: ``mean_t ||W_out[:, i] y_ti||`` with ``y`` the gated-norm output (a group: its heads' sum)."""
        acc.head_norms(layer.mixer.out_proj, (i, "mamba_heads"), b.head_dim)
        acc.channels(layer.mixer.in_proj)

    def orders(self, b: MambaBlock, scores: Scores) -> dict[str, torch.Tensor]:
        """Groups by summed score, heads within a group by their own (the gated norm acts per group)."""
        if "mamba_heads" not in scores:
            return {}
        groups, heads = grouped_order(scores["mamba_heads"], b.num_groups)
        return {"mamba_groups": groups, "mamba_heads": heads}

    def permute(self, sd: dict[str, torch.Tensor], key: Key, b: MambaBlock, orders: dict[str, torch.Tensor]) -> None:
        """Rows of ``z``, ``x``, ``dt`` (``in_proj``), the conv's ``x`` channels, ``dt_bias``, ``A_log``,
        ``D``, the gated-norm weight and the ``out_proj`` columns move with their head; ``B`` / ``C``
        rows (``in_proj`` and conv) with their group."""
        if "mamba_heads" not in orders:
            return
        heads, groups = orders["mamba_heads"], orders["mamba_groups"]
        check_grouped(key("out_proj"), heads, groups, b.num_groups)
        P, N, di, gn = b.head_dim, b.state_size, b.d_inner, b.num_groups * b.state_size
        z, x, B, C, dt = sd[key("in_proj")].split([di, di, gn, gn, b.num_heads])
        sd[key("in_proj")] = torch.cat(
            [rows(z, heads, P), rows(x, heads, P), rows(B, groups, N), rows(C, groups, N), dt.index_select(0, heads)]
        )
        for role in ("conv_w", "conv_b"):
            cx, cB, cC = sd[key(role)].split([di, gn, gn])
            sd[key(role)] = torch.cat([rows(cx, heads, P), rows(cB, groups, N), rows(cC, groups, N)])
        for role in ("dt_bias", "A_log", "D"):
            sd[key(role)] = sd[key(role)].index_select(0, heads)
        sd[key("mnorm")] = rows(sd[key("mnorm")], heads, P)
        sd[key("out_proj")] = cols(sd[key("out_proj")], heads, P)

    def megatron_config(self, base: Any, b: MambaBlock) -> Any:
        return dataclasses.replace(
            base,
            mamba_num_heads=b.num_heads,
            mamba_head_dim=b.head_dim,
            mamba_state_dim=b.state_size,
            mamba_num_groups=b.num_groups,
        )

    def megatron_spec(self, b: MambaBlock, config: Any, m: dict[str, Any], chunk_size: int) -> Any:
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec

        mixer = ModuleSpec(
            module=MambaMixer,
            params={"d_conv": b.conv_kernel, "chunk_size": chunk_size},
            submodules=MambaMixerSubmodules(in_proj=m["col"], out_proj=m["row"]),
        )
        return ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=m["norm"],
                mixer=mixer,
                mamba_bda=get_bias_dropout_add,
                # checkpoint keys as with TE (norm fused into in_proj): models.builder.te_keys_map
                sharded_state_dict_keys_map={} if m["te"] else {"norm.": "mixer.in_proj.layer_norm_"},
            ),
        )

    def shard_problem(self, b: MambaBlock, tp: int, ep: int, etp: int) -> str | None:
        if b.num_heads % tp or b.num_groups % tp:
            return f"{b.num_heads} Mamba heads / {b.num_groups} groups vs TP={tp}"
        return None

    def min_block(self, b: MambaBlock, caps: Any) -> MambaBlock:
        if caps.remove_mamba:
            return MambaBlock(0, b.head_dim, b.state_size, b.num_groups, b.conv_kernel)
        heads = b.num_groups if caps.vary_mamba_heads else b.num_heads
        return MambaBlock(heads, b.head_dim, b.state_size, b.num_groups, b.conv_kernel)

    def sharded_sizes(self, b: MambaBlock) -> list[tuple[str, str, int]]:
        return [("tp", "mamba num_heads", b.num_heads), ("tp", "mamba num_groups", b.num_groups)]

    def mixing_flops(self, b: MambaBlock, seq_len: int, full_square: bool = False) -> float:
        """The scan: ``6 * di * N`` (state update and read-out)."""
        return 6.0 * b.d_inner * b.state_size

    def params(self, b: MambaBlock, hidden: int, active: bool = False) -> int:
        """in_proj ``h*(2*Hm*Pm + 2*Gm*N + Hm)`` (z, x, B, C, dt) + conv ``conv_dim*(K+1)`` (weights +
        bias) + ``3*Hm`` (dt_bias, A_log, D) + ``Hm*Pm`` (gated norm) + out_proj ``Hm*Pm*h`` + ``h``."""
        d_in_proj = 2 * b.d_inner + 2 * b.num_groups * b.state_size + b.num_heads
        return (
            hidden * d_in_proj + conv_dim(b) * (b.conv_kernel + 1) + 3 * b.num_heads + b.d_inner * (1 + hidden) + hidden
        )

    def small_params(self, b: MambaBlock, hidden: int) -> int:
        """``h + Hm*Pm (gated norm) + 3*Hm (dt_bias, A_log, D) + conv_dim*(K+1) (conv weight and
        bias: llama.cpp's ssm_conv takes an F32 weight only)``."""
        return hidden + b.d_inner + 3 * b.num_heads + conv_dim(b) * (b.conv_kernel + 1)

    def state_elements(self, b: MambaBlock, conv_extra: int = 0) -> int:
        """``Hm*Pm*N`` (SSM state) + ``conv_dim*(K-1+e)`` (conv state)."""
        return b.num_heads * b.head_dim * b.state_size + conv_dim(b) * (b.conv_kernel - 1 + conv_extra)

    def activation_width(self, b: MambaBlock, hidden: int) -> int:
        return 2 * b.d_inner + 2 * b.num_groups * b.state_size


def conv_dim(b: MambaBlock) -> int:
    """Channels through the causal conv: ``Hm*Pm + 2*Gm*N`` (x, B, C)."""
    return b.d_inner + 2 * b.num_groups * b.state_size

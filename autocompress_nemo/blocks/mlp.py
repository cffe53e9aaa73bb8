"""Dense MLP blocks (SwiGLU or squared-ReLU): options are ffn widths on the one grid (``levels``,
``ffn_align``), plus 0 (removed) where the engine can remove an MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from autocompress_nemo.arch.spec import ArchSpec, MlpBlock
from autocompress_nemo.blocks.base import (
    Decision,
    Grid,
    Key,
    Kind,
    Role,
    Scores,
    ffn_params,
    levels,
    must_keep,
    need,
    prefix_rows,
)
from autocompress_nemo.rank.permute import argsort_desc, permute_neurons


def ffn_widths(parent_ffn: int, n_options: int, align: int, allow_zero: bool) -> list[int]:
    """The ffn grid (``levels``: the widths the cost table is profiled at), plus 0 when the block
    may be removed."""
    return ([0] if allow_zero else []) + levels(parent_ffn, n_options, align)


class Mlp(Kind):
    name = "mlp"
    plot_unit = "ffn width"
    block_type = MlpBlock
    decision_kinds = ("mlp",)

    def decisions(self, spec: ArchSpec, i: int, block: MlpBlock, caps: Any, grid: Grid) -> list[Decision]:
        # a kept attention needs its ffn (llama.cpp deci): no MLP removal under attention_needs_ffn
        allow = (
            caps.remove_mlp
            and not (i == len(spec.blocks) - 1 and caps.last_block_full)
            and not caps.attention_needs_ffn
            and not must_keep(spec, i, caps)
        )
        if caps.vary_ffn:
            widths = ffn_widths(block.ffn, grid.ffn_options, caps.ffn_align, allow)
        else:
            widths = ([0] if allow else []) + [block.ffn]
        opts = tuple(MlpBlock(w, block.activation) for w in widths)
        return [Decision(i, "mlp", opts)] if len(opts) > 1 else []

    def masks(self, d: Decision[MlpBlock], parent_block: MlpBlock) -> dict[str, torch.Tensor]:
        """Per neuron, on the ``linear_fc2`` input."""
        return {"out": prefix_rows(parent_block.ffn, [o.ffn for o in d.options])}

    def mask_sites(self, d: Decision[MlpBlock], layer: Any, pb: MlpBlock) -> list:
        return [(layer.mlp.linear_fc2, "out", 1, pb.ffn, True)]

    def kept_importance(self, d: Decision[MlpBlock], option: MlpBlock, scores: Any) -> float:
        return float(need(scores, "ffn", d)[: option.ffn].sum())

    def widths(self, option: MlpBlock) -> tuple[int, ...]:
        return (option.ffn,)

    def describe(self, block: MlpBlock) -> str:
        return f"F{block.ffn}"

    def words(self, block: MlpBlock) -> str:
        return str(block.ffn)

    def fields(self, block: MlpBlock) -> str:
        return f"ffn={block.ffn}"

    def plot_width(self, block: MlpBlock) -> int:
        return block.ffn

    def prefix_problem(self, p: MlpBlock, c: MlpBlock) -> str | None:
        return f"ffn {c.ffn} > parent's {p.ffn}" if c.ffn > p.ffn else None

    def gguf_matrices(self, b: MlpBlock, hidden: int) -> list[tuple[str, tuple[int, int]]]:
        return [("ffn_gate", (hidden, b.ffn)), ("ffn_up", (hidden, b.ffn)), ("ffn_down", (b.ffn, hidden))]

    def roles(self, spec: ArchSpec, b: MlpBlock) -> list[Role]:
        h, f = spec.hidden, b.ffn
        roles: list[Role] = [("up", None, (f, h)), ("down", None, (h, f))]
        return roles + ([("gate", None, (f, h))] if b.gated else [])

    def refit(self, p: MlpBlock, c: MlpBlock) -> tuple[str, torch.Tensor] | None:
        """``down``'s columns: the first ``F'`` neurons of the sorted parent."""
        return ("down", torch.arange(c.ffn)) if 0 < c.ffn < p.ffn else None

    def refit_site(self, layer: Any) -> Any:
        return layer.mlp.linear_fc2

    def score(self, acc: Any, layer: Any, i: int, b: MlpBlock) -> None:
        """Neuron n: ``mean_t |a_tn| * ||W_down[:, n]||`` (SwiGLU or relu² activation ``a``)."""
        acc.neurons(layer.mlp.linear_fc2, (i, "ffn"))
        acc.channels(layer.mlp.linear_fc1)

    def orders(self, b: MlpBlock, scores: Scores) -> dict[str, torch.Tensor]:
        return {"ffn": argsort_desc(scores["ffn"])} if "ffn" in scores else {}

    def permute(self, sd: dict[str, torch.Tensor], key: Key, b: MlpBlock, orders: dict[str, torch.Tensor]) -> None:
        if "ffn" in orders:
            permute_neurons(sd, [key(r) for r in ("up", "gate") if key(r) in sd], key("down"), orders["ffn"])

    def megatron_config(self, base: Any, b: MlpBlock) -> Any:
        return dense_mlp_config(base, b.ffn, b.activation)

    def megatron_spec(self, b: MlpBlock, config: Any, m: dict[str, Any], chunk_size: int) -> Any:
        return dense_mlp_spec(m)

    def shard_problem(self, b: MlpBlock, tp: int, ep: int, etp: int) -> str | None:
        return f"ffn {b.ffn} vs TP={tp}" if b.ffn % tp else None

    def capability_problems(self, i: int, b: MlpBlock, r: MlpBlock | None, caps: Any) -> list[str]:
        if b.removed:
            return super().capability_problems(i, b, r, caps)
        out, align = [], max(1, caps.ffn_align)
        if r is not None and b.ffn != r.ffn and not caps.vary_ffn:
            out.append(f"block {i}: ffn {b.ffn} differs from {r.ffn} (vary_ffn=False)")
        if b.ffn % align and (r is None or b.ffn != r.ffn):
            out.append(f"block {i}: ffn {b.ffn} is not a multiple of ffn_align={align}")
        return out

    def min_block(self, b: MlpBlock, caps: Any) -> MlpBlock:
        if caps.remove_mlp:
            return MlpBlock(0, b.activation)
        return MlpBlock(max(caps.ffn_align, 1), b.activation) if caps.vary_ffn else b

    def sharded_sizes(self, b: MlpBlock) -> list[tuple[str, str, int]]:
        return [("tp", "mlp ffn", b.ffn)]

    def params(self, b: MlpBlock, hidden: int, active: bool = False) -> int:
        """``ffn_params(h, F) + h`` (input norm)."""
        return ffn_params(hidden, b.ffn, b.gated) + hidden

    def activation_width(self, b: MlpBlock, hidden: int) -> int:
        return 2 * b.ffn + hidden

    def size(self, b: MlpBlock) -> int:
        return b.ffn

    def interpolate(self, b: MlpBlock, entries: list[tuple[Any, float]]) -> float | None:
        """Piecewise-linear in ``F`` between profiled widths of the same activation (matmul time is
        linear in F); linear extrapolation from the nearest two outside them."""
        pts = sorted((eb.ffn, v) for eb, v in entries if eb.activation == b.activation)
        if len(pts) < 2:
            return None
        xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
        if b.ffn < xs[0] or b.ffn > xs[-1]:
            i = 0 if b.ffn < xs[0] else len(xs) - 2
            return float(ys[i] + (ys[i + 1] - ys[i]) * (b.ffn - xs[i]) / (xs[i + 1] - xs[i]))
        return float(np.interp(b.ffn, xs, ys))


def dense_mlp_config(base: Any, ffn: int, activation_name: str) -> Any:
    """``base`` with a dense MLP of width ``ffn`` (also an MoE block reduced to its shared expert)."""
    from autocompress_nemo.models.megatron import activation

    act, gated = activation(activation_name)
    return dataclasses.replace(base, ffn_hidden_size=ffn, activation_func=act, gated_linear_unit=gated)


def dense_mlp_spec(m: dict[str, Any]) -> Any:
    """Megatron's ``MLPLayer`` spec (pre-MLP norm, fc1, fc2)."""
    import functools

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    mlp = functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=m["col"], linear_fc2=m["row"]))
    return ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=m["norm"],
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # checkpoint keys as with TE (norm fused into linear_fc1): models.builder.te_keys_map
            sharded_state_dict_keys_map={} if m["te"] else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )

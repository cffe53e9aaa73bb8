"""``PerBlockHybridStack``: Megatron's ``HybridStack`` with one config and one layer spec per block.

Megatron's ``HybridStack`` builds every layer of a ``hybrid_layer_pattern`` from the model's
single config, so all Mamba blocks share one head count, all MoE blocks one expert count.
This subclass keeps its forward (and everything ``HybridModel`` relies on) and replaces only
the construction: block ``i`` is built from ``block_plan[i] = (layer spec, its own config)``
(its kind's ``megatron_config`` / ``megatron_spec``, ``blocks/``), and a removed block is a ``NoOpBlock``.

Layer specs are Megatron's hybrid ones (``MambaLayer``, attention ``TransformerLayer``,
``MLPLayer``, ``MoETransformerLayer`` with ``MoELayer``), with local modules on CPU
(``ColumnParallelLinear`` / ``RowParallelLinear`` / ``DotProductAttention``, the torch norm of
``compat_cpu``, ``SequentialMLP`` experts) or Transformer Engine modules on GPU (norms fused
into ``in_proj`` / ``linear_qkv`` / ``linear_fc1``, grouped-GEMM experts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.models import compat_cpu


class NoOpBlock(nn.Module):
    """A removed block: returns its input (adds nothing to the residual stream)."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        return hidden_states

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        """Nothing to checkpoint: no parameters, no buffers, no extra state (``HybridStack`` asks
        every layer for its sharded state dict)."""
        return {}


def _modules(use_te: bool) -> dict[str, Any]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TEDotProductAttention,
            TELayerNormColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        return dict(
            te=True,
            norm=IdentityOp,
            moe_norm=TENorm,
            qk=TENorm,
            col=TELayerNormColumnParallelLinear,
            row=TERowParallelLinear,
            core=TEDotProductAttention,
            final=TENorm,
        )
    return dict(
        te=False,
        norm=compat_cpu.SequenceParallelTorchNorm,
        moe_norm=compat_cpu.SequenceParallelTorchNorm,
        qk=compat_cpu.qk_norm,
        col=ColumnParallelLinear,
        row=RowParallelLinear,
        core=DotProductAttention,
        final=compat_cpu.SequenceParallelTorchNorm,
    )


def block_plan(spec: ArchSpec, base_config: Any, use_te: bool, chunk_size: int) -> list[tuple[Any, Any]]:
    """``[(layer spec or None, config or None)]`` per block (its kind's ``megatron_spec`` /
    ``megatron_config``); ``(None, None)`` for a removed block."""
    m = _modules(use_te)
    plan: list[tuple[Any, Any]] = []
    for b in spec.blocks:
        if b.removed:
            plan.append((None, None))
            continue
        kind = kind_of(b)
        cfg = kind.megatron_config(base_config, b)
        plan.append((kind.megatron_spec(b, cfg, m, chunk_size), cfg))
    return plan


def _stack_class() -> type:
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    class PerBlockHybridStack(HybridStack):
        """``HybridStack`` whose block ``i`` is built from its own ``(spec, config)`` (see module doc)."""

        def __init__(
            self,
            config: Any,
            submodules: Any = None,
            pre_process: bool = True,
            layer_type_list: Any = None,
            pp_layer_offset: int = 0,
            post_layer_norm: bool = True,
            post_process: bool = True,
            device: Any = None,
            dtype: Any = None,
            pg_collection: Any = None,
            is_mtp_layer: bool = False,
            name: str | None = None,
            *,
            block_plan: list[tuple[Any, Any]],
            final_norm: Any,
        ) -> None:
            MegatronModule.__init__(self, config=config)
            self.pre_process, self.post_layer_norm, self.post_process = pre_process, post_layer_norm, post_process
            self.is_mtp_layer = is_mtp_layer
            if pg_collection is None or layer_type_list is None:
                raise ValueError("PerBlockHybridStack is built by HybridModel (pg_collection, layer_type_list)")
            self.pp_group, self.tp_group, self.pg_collection = pg_collection.pp, pg_collection.tp, pg_collection
            self.input_tensor = None
            self.layer_type_list = layer_type_list
            self.layers = nn.ModuleList()
            for i, symbol in enumerate(layer_type_list):
                g = i + pp_layer_offset
                layer_spec, cfg = block_plan[g]
                kw: dict[str, Any] = dict(config=cfg, layer_number=g + 1, pg_collection=pg_collection)
                if layer_spec is None:
                    layer: nn.Module = NoOpBlock(g + 1)
                elif symbol == Symbols.MAMBA:
                    layer = build_module(layer_spec, pp_layer_offset=pp_layer_offset, **kw)
                elif symbol == Symbols.ATTENTION:
                    layer = build_module(
                        layer_spec,
                        is_mtp_layer=is_mtp_layer,
                        add_layer_offset=False,
                        pp_layer_offset=pp_layer_offset,
                        **kw,
                    )
                elif symbol in (Symbols.MLP, Symbols.MOE):
                    layer = build_module(layer_spec, add_layer_offset=False, **kw)
                else:
                    raise ValueError(f"block {g}: unsupported layer symbol {symbol!r}")
                self.layers.append(layer)
            self.num_layers_per_pipeline_rank = len(self.layers)
            if self.post_process and self.post_layer_norm:
                self.final_norm = final_norm(
                    config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                )

    return PerBlockHybridStack


_STACK: type | None = None


def per_block_stack_class() -> type:
    global _STACK
    if _STACK is None:
        _STACK = _stack_class()
    return _STACK

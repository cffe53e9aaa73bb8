"""The supernet: the sorted parent with masks over prefixes of each dimension.

A candidate keeps a prefix of every reordered dimension, so one set of weights serves
all candidates. Masks act on the inputs of the two row-parallel projections:

- attention: ``linear_proj`` input ``[S, B, H_local*d]`` times a per-query-head mask
  (a dropped KV group has all its query heads masked, so its K/V are never read);
- mlp: ``linear_fc2`` input ``[S, B, F_local]`` times a per-neuron mask.

A block whose mask is all zero writes nothing into the residual stream (no biases), which
is exactly a removed block. With one-hot choices the masked forward therefore equals the
forward of the extracted smaller model (tested). With soft choices the mask is the
expected mask ``sum_k p_k * 1[j kept by option k]``.

Under tensor parallelism each rank multiplies its own shard by its slice of the global mask.
"""

from __future__ import annotations

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.distributed.state import tensor_parallel
from autocompress_nemo.search.space import Decision


def option_masks(decision: Decision, parent_block: AttentionBlock | MlpBlock) -> torch.Tensor:
    """``[K, D]`` keep-indicators of every option over the parent's (sorted) dimension."""
    if decision.kind == "attention":
        assert isinstance(parent_block, AttentionBlock)
        hpg = parent_block.heads_per_group
        g = torch.arange(parent_block.num_heads) // hpg
        r = torch.arange(parent_block.num_heads) % hpg
        rows = [((g < o.num_kv_groups) & (r < o.heads_per_group)).float() for o in decision.options]  # type: ignore[union-attr]
    else:
        assert isinstance(parent_block, MlpBlock)
        j = torch.arange(parent_block.ffn)
        rows = [(j < o.ffn).float() for o in decision.options]  # type: ignore[union-attr]
    return torch.stack(rows)


def _tp() -> tuple[int, int]:
    _, rank, world = tensor_parallel()
    return rank, world


class Supernet:
    """Installs mask hooks on a Megatron GPT model built from the sorted parent."""

    def __new__(cls, model: torch.nn.Module, parent: ArchSpec, decisions: list[Decision]):  # noqa: ANN204
        if cls is Supernet and parent.kinds() & {"moe", "mamba"}:  # hybrids: search/supernet_hybrid.py (H7)
            from autocompress_nemo.search.supernet_hybrid import HybridSupernet

            return super().__new__(HybridSupernet)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, parent: ArchSpec, decisions: list[Decision]):
        self.model = model
        self.parent = parent
        self.decisions = decisions
        self.option_masks = [option_masks(d, parent.blocks[d.block_index]) for d in decisions]  # type: ignore[arg-type]
        self._masks: dict[int, torch.Tensor] = {}  # block index -> [D] mask over parent dim
        self.enabled = True
        self._handles = []
        tp_rank, tp_world = _tp()
        layers = model.decoder.layers
        for d in decisions:
            layer = layers[d.block_index // 2]
            pb = parent.blocks[d.block_index]
            if d.kind == "attention":
                mod = layer.self_attention.linear_proj
                unit, size = pb.head_dim, pb.num_heads  # type: ignore[union-attr]
            else:
                mod = layer.mlp.linear_fc2
                unit, size = 1, pb.ffn  # type: ignore[union-attr]
            local = size // tp_world
            self._handles.append(
                mod.register_forward_pre_hook(self._make_hook(d.block_index, unit, local * tp_rank, local))
            )

    def _make_hook(self, block_index: int, unit: int, start: int, length: int):
        def hook(mod, args):
            if not self.enabled or block_index not in self._masks:
                return None
            m = self._masks[block_index][start : start + length]
            if unit > 1:
                m = m.repeat_interleave(unit)
            x = args[0]
            return (x * m.to(x.dtype),) + tuple(args[1:])

        return hook

    def set_choice_weights(self, weights: list[torch.Tensor]) -> None:
        """Set masks from per-decision option weights (one-hot, probabilities or Gumbel samples)."""
        for d, om, w in zip(self.decisions, self.option_masks, weights, strict=True):
            self._masks[d.block_index] = w.to(om.dtype) @ om

    def set_choices(self, choices: list[int]) -> None:
        """Set one-hot masks: option ``choices[i]`` for decision ``i``."""
        self.set_choice_weights(
            [
                torch.nn.functional.one_hot(torch.tensor(k), len(d.options)).float()
                for d, k in zip(self.decisions, choices, strict=True)
            ]
        )

    def clear(self) -> None:
        self._masks.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

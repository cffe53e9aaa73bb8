"""Helpers shared by the method tests: tiny Megatron models and an exact cost function."""

from __future__ import annotations

import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.models.builder import build_model
from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron
from autocompress_nemo.models.llama.reference import random_hf_state_dict

TINY = ArchSpec.llama(hidden=32, vocab=96, layers=3, heads=4, kv_groups=2, ffn=64, name="tiny")
CAPS = {
    "vary_query_heads": True,
    "vary_kv_groups": True,
    "vary_ffn": True,
    "remove_attention": True,
    "remove_mlp": True,
    "ffn_align": 8,
    "first_block_full": True,
    "last_block_full": True,
    "attention_needs_ffn": True,
}


def megatron_from_hf(spec: ArchSpec, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model


def tiny_parent(seed: int = 0) -> tuple[ArchSpec, dict[str, torch.Tensor]]:
    return TINY, random_hf_state_dict(TINY, seed=seed, std=0.2)


class ParamCost:
    """A cost model whose only metric is the parameter count: exact and differentiable faces."""

    metric = "params"

    def predict(self, spec: ArchSpec) -> dict[str, float]:
        return {"params": float(param_count(spec))}

    def expected(
        self, options: list[list[Block]], probs: list[torch.Tensor], spec: ArchSpec
    ) -> dict[str, torch.Tensor]:
        from autocompress_nemo.arch.counts import block_params

        total = torch.zeros(())
        for opts, p in zip(options, probs, strict=True):
            costs = torch.tensor([float(block_params(o, spec.hidden)) for o in opts])
            total = total + (p * costs).sum()
        # blocks outside the decisions and the embeddings are constant
        return {"params": total + self._constant(options, spec)}

    @staticmethod
    def _constant(options: list[list[Block]], spec: ArchSpec) -> float:
        from autocompress_nemo.arch.counts import block_params

        in_decisions = sum(block_params(opts[-1], spec.hidden) for opts in options)
        return float(param_count(spec) - in_decisions)

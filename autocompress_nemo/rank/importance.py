"""Activation-based importance from a calibration pass (Minitron-style), on a Megatron GPT model.

Legend: B batch, T tokens, S sequence (Megatron's [S, B, *] layout), h hidden, H query
heads, d head dim, F ffn width; ``_local`` = this tensor-parallel rank's shard.

Scores (all are mean magnitudes over calibration tokens, so they add up across layers
and kinds on one scale — "how much this unit writes into / reads from the residual"):

- ffn neuron j of layer l: ``mean_t |a_tj| * ||W_down[:, j]||`` where ``a`` is the input
  of ``linear_fc2`` (the activation that neuron writes through ``W_down``).
- query head i: ``mean_t ||W_o[:, i] o_ti||`` — the norm of that head's contribution to
  the attention output; a KV group scores the sum of its query heads.
- hidden channel c: ``mean_t |x_tc|`` summed over the normalized inputs of every block
  (inputs of ``linear_qkv`` and ``linear_fc1``).
- block: ``mean_t ||f(n_t)|| / ||n_t||`` with ``n`` the block's normalized input and ``f``
  its output — how much the block writes into the residual stream relative to its input.

Under tensor parallelism each rank scores its own heads / neurons; the shards are
gathered over the TP group so every rank holds the same global vectors, hence one
global order. With sequence parallelism the sums over the residual stream (hidden channels,
block ratios: each rank sees its part of the sequence) are all-reduced over TP as well; heads
and neurons see the whole sequence on every rank and are only gathered.

The hooks are those of ``Accumulator`` (per-head output norms, per-neuron activation x down
column norm, per-channel input magnitudes), shared with the hybrid scorer ``moe_mamba.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distributed.state import tensor_parallel


@dataclass
class LayerScores:
    heads: torch.Tensor | None = None  # [H]
    ffn: torch.Tensor | None = None  # [F]
    attn_block: float = 0.0
    mlp_block: float = 0.0


@dataclass
class Importance:
    hidden: torch.Tensor  # [h]
    layers: list[LayerScores] = field(default_factory=list)
    tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "hidden": self.hidden.tolist(),
            "tokens": self.tokens,
            "layers": [
                {
                    "heads": None if s.heads is None else s.heads.tolist(),
                    "ffn": None if s.ffn is None else s.ffn.tolist(),
                    "attn_block": s.attn_block,
                    "mlp_block": s.mlp_block,
                }
                for s in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Importance:
        def t(x: list | None) -> torch.Tensor | None:
            return None if x is None else torch.tensor(x, dtype=torch.float64)

        return cls(
            hidden=torch.tensor(d["hidden"], dtype=torch.float64),
            tokens=int(d["tokens"]),
            layers=[LayerScores(t(s["heads"]), t(s["ffn"]), s["attn_block"], s["mlp_block"]) for s in d["layers"]],
        )


def parallel_groups() -> dict[str, tuple[int, Any]]:
    """``{"tp" | "ep" | "etp": (size, process group)}``; sizes 1 (group ``None``) when Megatron's
    parallel state is not initialized (one process without ``init_distributed``)."""
    from megatron.core import parallel_state as ps

    group, _, world = tensor_parallel()
    if not ps.model_parallel_is_initialized():
        return {"tp": (1, None), "ep": (1, None), "etp": (1, None)}
    return {
        "tp": (world, group),
        "ep": (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()),
        "etp": (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()),
    }


def cat_over(x: torch.Tensor, n: int, group: Any, dim: int = 0) -> torch.Tensor:
    """Concatenate a per-rank shard along ``dim`` over ``group`` (rank order = Megatron's split)."""
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def sum_over(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (a copy; ``x`` itself is left alone)."""
    if n > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


def _in_features(linear: Any) -> int:
    return int(linear.weight.shape[1])


class Accumulator:
    """Per-unit sums over the calibration tokens, filled by forward hooks, keyed by ``(block, kind)``.

    Every sum is created (zeros, on the module's device) when its hook is registered, so every rank
    holds the same keys and the reductions after the pass are the same collectives on every rank.
    The hooks see this rank's shard: the caller gathers / sums over the parallel groups.
    """

    def __init__(self) -> None:
        self.sums: dict[Hashable, torch.Tensor] = {}
        self._handles: list[Any] = []

    def zeros(self, key: Hashable, shape: tuple[int, ...], module: torch.nn.Module) -> None:
        """Create the sum ``key`` (zeros of ``shape``, on ``module``'s device) unless it exists."""
        if key not in self.sums:
            p = next(module.parameters(), None)
            self.sums[key] = torch.zeros(shape, dtype=torch.float64, device=None if p is None else p.device)

    def add(self, key: Hashable, v: torch.Tensor, index: int | None = None) -> None:
        t = self.sums[key] if index is None else self.sums[key][index]
        t.add_(v.to(t.device))

    def pre_hook(self, module: torch.nn.Module, fn: Callable[[Any, tuple], None]) -> None:
        self._handles.append(module.register_forward_pre_hook(fn))

    def post_hook(self, module: torch.nn.Module, fn: Callable[[Any, tuple, Any], None]) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def head_norms(self, proj: torch.nn.Module, key: Hashable, head_dim: int) -> None:
        """``sum_t ||W[:, i] o_ti||`` per head ``i`` of an output projection ``proj`` (input
        ``o [..., n*d]``, row-parallel weight ``W [h, n*d]``): each head's contribution to the output."""
        n = _in_features(proj) // head_dim
        self.zeros(key, (n,), proj)

        def hook(mod: Any, args: tuple) -> None:
            o, w = args[0].double(), mod.weight.double()
            c = torch.einsum("...nd,hnd->...nh", o.view(*o.shape[:-1], n, head_dim), w.view(-1, n, head_dim))
            self.add(key, c.norm(dim=-1).reshape(-1, n).sum(dim=0))

        self.pre_hook(proj, hook)

    def neurons(self, down: torch.nn.Module, key: Hashable, row: int | None = None, rows: int = 1) -> None:
        """``sum_t |a_tn| * ||W_down[:, n]||`` per neuron ``n`` of a down projection ``down`` (input
        ``a [..., F]``); with ``row``, into that row of a ``[rows, F]`` sum (one row per expert)."""
        f = _in_features(down)
        self.zeros(key, (f,) if row is None else (rows, f), down)

        def hook(mod: Any, args: tuple) -> None:
            a = args[0].double().reshape(-1, f)
            self.add(key, a.abs().sum(dim=0) * mod.weight.double().norm(dim=0), row)

        self.pre_hook(down, hook)

    def channels(self, reader: torch.nn.Module, key: Hashable = "hidden") -> None:
        """``sum_t |x_tc|`` per channel ``c`` of the input of ``reader`` (a matrix ``[*, h]`` that reads
        a block's normalized input); every reader adds into the same ``key``."""
        h = _in_features(reader)
        self.zeros(key, (h,), reader)

        def hook(mod: Any, args: tuple) -> None:
            self.add(key, args[0].double().reshape(-1, h).abs().sum(dim=0))

        self.pre_hook(reader, hook)

    def output_ratio(self, block: torch.nn.Module, key: Hashable) -> None:
        """``sum_t ||f(n_t)|| / ||n_t||`` of a block ``f`` with normalized input ``n`` (how much it
        writes into the residual stream relative to its input)."""
        self.zeros(key, (), block)

        def hook(mod: Any, args: tuple, out: Any) -> None:
            y = out[0] if isinstance(out, tuple) else out
            if not args or y is None or not torch.is_tensor(y):
                return
            ratio = y.double().norm(dim=-1) / args[0].double().norm(dim=-1).clamp_min(1e-12)
            self.add(key, ratio.sum())

        self.post_hook(block, hook)

    def run(
        self,
        model: torch.nn.Module,
        batches: Iterable[torch.Tensor],
        forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> int:
        """``forward(model, input_ids_BT)`` over ``batches`` with the hooks on; returns the token count
        of this rank. The hooks are removed afterwards (also on error)."""
        tokens = 0
        try:
            for input_ids in batches:
                forward(model, input_ids)
                tokens += input_ids.numel()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        return tokens


@torch.no_grad()
def collect_importance(
    model: torch.nn.Module,
    spec: ArchSpec,
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    sequence_parallel: bool = False,
) -> Importance:
    """Run ``forward(model, input_ids_BT)`` over ``batches`` and accumulate the scores above."""
    layers = spec.layers()
    acc = Accumulator()
    decoder: Any = model.decoder
    for li, layer in enumerate(decoder.layers):
        attn, mlp = layers[li]
        sa = layer.self_attention
        if not attn.removed and hasattr(sa, "linear_proj"):
            acc.head_norms(sa.linear_proj, (li, "heads"), attn.head_dim)
            acc.channels(sa.linear_qkv)
        if not mlp.removed and hasattr(layer.mlp, "linear_fc2"):
            acc.neurons(layer.mlp.linear_fc2, (li, "ffn"))
            acc.channels(layer.mlp.linear_fc1)
        acc.output_ratio(sa, (li, "attn_block"))
        acc.output_ratio(layer.mlp, (li, "mlp_block"))
    n_tokens_seen = acc.run(model, batches, forward)
    tp, group = parallel_groups()["tp"]
    n = max(n_tokens_seen, 1)

    def tokens_summed(
        key: Hashable,
    ) -> torch.Tensor:  # inputs / outputs of the residual stream: sequence-split under SP
        return (sum_over(acc.sums[key], tp, group) if sequence_parallel else acc.sums[key]).cpu() / n

    def units(key: tuple) -> torch.Tensor | None:  # heads / neurons: the full sequence, this rank's units
        return cat_over(acc.sums[key], tp, group).cpu() / n if key in acc.sums else None

    scores = [
        LayerScores(
            heads=units((li, "heads")),
            ffn=units((li, "ffn")),
            attn_block=tokens_summed((li, "attn_block")).item(),
            mlp_block=tokens_summed((li, "mlp_block")).item(),
        )
        for li in range(len(layers))
    ]
    hidden = tokens_summed("hidden") if "hidden" in acc.sums else torch.zeros(spec.hidden, dtype=torch.float64)
    return Importance(hidden=hidden, layers=scores, tokens=n_tokens_seen)

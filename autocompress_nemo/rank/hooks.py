"""The calibration pass's bookkeeping: per-unit sums over the calibration tokens filled by forward
hooks (``Accumulator``) and the collectives that turn one rank's shard into the global vector.

The hooks a block registers are its kind's (``blocks/<kind>.score``); they use the measures here:

- ``head_norms``: ``sum_t ||W[:, i] o_ti||`` per head ``i`` of an output projection (attention
  ``linear_proj``, Mamba ``out_proj``) — each head's contribution to the block output;
- ``neurons``: ``sum_t |a_tn| * ||W_down[:, n]||`` per neuron ``n`` of a down projection;
- ``channels``: ``sum_t |x_tc|`` per hidden channel of a block's normalized input.

Every sum carries how it is reduced over the parallel groups after the pass (``Reduce``): this
rank's units of a TP-sharded layer (gathered over TP; summed over EP, whose ranks see different
sequences), residual-stream sums (summed over EP, and over TP under sequence parallelism), routed
experts (gathered over EP) and their neurons (gathered over ETP then EP).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from autocompress_nemo.distributed.state import tensor_parallel


class Reduce(Enum):
    UNITS = "units"  # heads / neurons of a TP-sharded layer, the whole sequence on every TP rank
    STREAM = "stream"  # sums over residual-stream positions (hidden channels)
    EXPERTS = "experts"  # one entry per local routed expert
    EXPERT_UNITS = "expert_units"  # [local experts, this ETP rank's neurons]


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
    """Per-unit sums over the calibration tokens, filled by forward hooks, keyed by ``(block, name)``
    (``"hidden"`` for the hidden channels), each with its ``Reduce``.

    Every sum is created (zeros, on the module's device) when its hook is registered, so every rank
    holds the same keys and the reductions after the pass are the same collectives on every rank.
    The hooks see this rank's shard; ``groups`` are the parallel groups (``parallel_groups``).
    """

    def __init__(self, groups: dict[str, tuple[int, Any]] | None = None) -> None:
        self.sums: dict[Hashable, torch.Tensor] = {}
        self.reduce: dict[Hashable, Reduce] = {}
        self.groups = groups or {"tp": (1, None), "ep": (1, None), "etp": (1, None)}
        self._handles: list[Any] = []
        self._consts: dict[tuple[int, str], torch.Tensor] = {}

    def zeros(self, key: Hashable, shape: tuple[int, ...], module: torch.nn.Module, reduce: Reduce) -> None:
        """Create the sum ``key`` (zeros of ``shape``, on ``module``'s device) unless it exists."""
        if key not in self.sums:
            p = next(module.parameters(), None)
            self.sums[key] = torch.zeros(shape, dtype=torch.float64, device=None if p is None else p.device)
            self.reduce[key] = reduce

    def add(self, key: Hashable, v: torch.Tensor, index: int | None = None) -> None:
        t = self.sums[key] if index is None else self.sums[key][index]
        t.add_(v.to(t.device))

    def pre_hook(self, module: torch.nn.Module, fn: Callable[[Any, tuple], None]) -> None:
        self._handles.append(module.register_forward_pre_hook(fn))

    def post_hook(self, module: torch.nn.Module, fn: Callable[[Any, tuple, Any], None]) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def _const(self, mod: torch.nn.Module, what: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn`` of ``mod``'s weight in float64, computed once per pass (the weights do not change
        during the calibration pass)."""
        key = (id(mod), what)
        if key not in self._consts:
            # torch types a module attribute as Tensor | Module
            self._consts[key] = fn(mod.weight.detach().double())  # type: ignore[operator]
        return self._consts[key]

    def head_norms(self, proj: torch.nn.Module, key: Hashable, head_dim: int) -> None:
        """``sum_t ||W[:, i] o_ti||`` per head ``i`` of an output projection ``proj`` (input
        ``o [..., n*d]``, row-parallel weight ``W [h, n*d]``): each head's contribution to the output.

        Computed as ``sqrt(o_ti^T G_i o_ti)`` with the head's Gram matrix ``G_i = W_i^T W_i [d, d]``
        (float64, from the weight once per call): ``n*d*d`` multiply-adds per token instead of the
        ``n*d*h`` of forming ``W_i o_ti`` (9x fewer for SmolLM2's 64-wide heads and 576-wide output);
        equal to the direct norm up to float64 rounding (``tests/test_rank_speed.py``)."""
        n = _in_features(proj) // head_dim
        self.zeros(key, (n,), proj, Reduce.UNITS)

        def gram_of(w: torch.Tensor) -> torch.Tensor:
            v = w.view(-1, n, head_dim)
            return torch.einsum("hnd,hne->nde", v, v)

        def hook(mod: Any, args: tuple) -> None:
            gram = self._const(mod, "gram", gram_of)
            o = args[0].detach().reshape(-1, n, head_dim).double().transpose(0, 1)  # [n, T, d]
            sq = (torch.bmm(o, gram) * o).sum(dim=-1)  # [n, T]: ||W_i o_ti||^2 (G_i = W_i^T W_i: [n, d, d])
            self.add(key, sq.clamp_min_(0.0).sqrt_().sum(dim=1))

        self.pre_hook(proj, hook)

    def neurons(self, down: torch.nn.Module, key: Hashable, row: int | None = None, rows: int = 1) -> None:
        """``sum_t |a_tn| * ||W_down[:, n]||`` per neuron ``n`` of a down projection ``down`` (input
        ``a [..., F]``); with ``row``, into that row of a ``[rows, F]`` sum (one row per routed expert).
        Summed over tokens in float64 after a float64 copy: ``sum(dim=0, dtype=float64)`` on float32 is
        ~20x slower on this CPU (torch 2.x, measured: 11.7 vs 0.5 ms for [512, 1536])."""
        f = _in_features(down)
        self.zeros(key, (f,) if row is None else (rows, f), down, Reduce.UNITS if row is None else Reduce.EXPERT_UNITS)

        def hook(mod: Any, args: tuple) -> None:
            a = args[0].detach().reshape(-1, f)
            norms = self._const(mod, "column_norms", lambda w: w.norm(dim=0))
            self.add(key, a.abs().double().sum(dim=0) * norms, row)

        self.pre_hook(down, hook)

    def channels(self, reader: torch.nn.Module, key: Hashable = "hidden") -> None:
        """``sum_t |x_tc|`` per channel ``c`` of the input of ``reader`` (a matrix ``[*, h]`` that reads
        a block's normalized input); every reader adds into the same ``key``."""
        h = _in_features(reader)
        self.zeros(key, (h,), reader, Reduce.STREAM)

        def hook(mod: Any, args: tuple) -> None:
            self.add(key, args[0].detach().reshape(-1, h).abs().double().sum(dim=0))

        self.pre_hook(reader, hook)

    def run(
        self,
        model: torch.nn.Module,
        batches: Iterable[torch.Tensor],
        forward: Callable[[torch.nn.Module, torch.Tensor], Any],
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
            self._consts.clear()
        return tokens

    def reduced(self, key: Hashable, sequence_parallel: bool) -> torch.Tensor:
        """The global vector of ``key`` (same on every rank; a collective: call on every rank)."""
        (tp, tpg), (ep, epg), (etp, etpg) = self.groups["tp"], self.groups["ep"], self.groups["etp"]
        v, how = self.sums[key], self.reduce[key]
        if how is Reduce.STREAM:
            v = sum_over(v, ep, epg)
            return sum_over(v, tp, tpg) if sequence_parallel else v
        if how is Reduce.EXPERTS:  # each token reached the experts once per TP rank (allgather dispatch)
            return cat_over(v, ep, epg) / tp
        if how is Reduce.EXPERT_UNITS:
            return cat_over(cat_over(v, etp, etpg, dim=1), ep, epg) / tp
        return cat_over(sum_over(v, ep, epg), tp, tpg)

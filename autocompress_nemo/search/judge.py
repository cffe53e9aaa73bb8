"""Judges of a child architecture: how much of the parent's behaviour a set of choices loses.

Repair, growth and the quality guard (``extract/repair.py``, ``search/guard.py``) compare
candidate moves by what they cost the model, per unit of predicted cost. Two judges:

- ``KdJudge`` (the default): the KD loss to the parent of the child that the supernet serves with
  one-hot masks (exactly the extracted child's forward, tests/test_method.py), on a few fixed
  calibration batches. The teacher's logits are computed once; every child costs one masked
  forward, and children already judged are remembered.
- ``ProxyJudge``: the share of the sorted parent's activation importance that the choices drop
  (the rank stage's scores summed over the units each option keeps). It is additive over blocks,
  so it cannot see that many cuts in a row of early layers compound: on SmolLM2 it put every cut of
  a tightened budget on the early layers' MLPs (issue 11). Kept as ``search.judge=importance`` to
  compare with (``bench/bench_repair_order.py``), not as the default.

Parallel runs: every rank holds its rows of the batches (``autocompress._local_rows``) and the
loss is averaged over all ranks (``world_mean``), so every rank gets the same number and makes the
same choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.distill.kd import kd_loss
from autocompress_nemo.distill.optim import Parallel
from autocompress_nemo.extract.compensate import collect_grams, solve
from autocompress_nemo.models.megatron import block_layers
from autocompress_nemo.rank.hooks import cat_over, parallel_groups
from autocompress_nemo.search.space import Decision
from autocompress_nemo.search.supernet import Supernet


class Judge(Protocol):
    label: str

    def loss(self, choices: list[int]) -> float: ...


class ProxyJudge:
    """Share of the summed importance dropped by ``choices`` (0: the parent, 1: everything)."""

    label = "importance"

    def __init__(self, importance: list[list[float]]):
        self.importance = importance
        self.total = max(sum(row[-1] for row in importance), 1e-12)
        self.calls = 0

    def loss(self, choices: list[int]) -> float:
        self.calls += 1
        return sum(row[-1] - row[k] for row, k in zip(self.importance, choices, strict=True)) / self.total


class KdJudge:
    """KD loss (temperature ``temperature``) of one-hot supernet children against the parent on
    fixed batches. ``close()`` removes the mask hooks from ``model``."""

    label = "kd"
    max_group = 8
    """Children judged in one forward at most (``losses``)."""
    logits_bytes = 256 * 2**20
    """Float32 logits of one grouped forward at most (the group shrinks for a large vocabulary)."""

    def __init__(
        self,
        model: torch.nn.Module,
        parent: ArchSpec,
        decisions: list[Decision],
        batches: list[torch.Tensor],
        forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
        temperature: float = 1.0,
        refit: Callable[[torch.nn.Module], RefitCorrection] | None = None,
    ):
        if not batches:
            raise ValueError("KdJudge needs at least one calibration batch (search.judge_batches >= 1)")
        self.model, self.forward, self.temperature = model, forward, float(temperature)
        self.decisions = decisions
        self.par = Parallel.detect()
        self.rows = [local_rows(b, self.par) for b in batches]
        self.tokens = sum(int(b.numel()) for b in batches)
        self.supernet = Supernet(model, parent, decisions)
        self.supernet.enabled = False
        with torch.no_grad():
            self.teacher = [forward(model, x) for x in self.rows]
        self.refit = refit(model) if refit is not None else None  # the parent's Gram matrices: masks off
        self.supernet.enabled = True
        self._memo: dict[tuple[int, ...], float] = {}
        self.calls = 0

    def loss(self, choices: list[int]) -> float:
        key = tuple(int(k) for k in choices)
        if key in self._memo:
            return self._memo[key]
        self.calls += 1
        self.supernet.set_choices(list(key))
        was_training = self.model.training
        self.model.eval()
        if self.refit is not None:
            self.refit.set_children([key], 1)
        try:
            with torch.no_grad():
                vals = [
                    float(kd_loss(self.forward(self.model, x), t, self.temperature))
                    for x, t in zip(self.rows, self.teacher, strict=True)
                ]
        finally:
            if self.refit is not None:
                self.refit.set_children([], 1)
            self.model.train(was_training)
        out = world_mean(sum(vals) / len(vals))
        self._memo[key] = out
        return out

    def losses(self, children: list[list[int]], progress: Callable[[int, int], None] | None = None) -> list[float]:
        """``loss`` of every child, the ones not judged yet in groups of ``group_size()`` per forward
        (the batch repeated once per child, each child's masks on its own rows: ``Supernet.
        set_choices_rows``); one child per forward where the supernet cannot (MoE / Mamba decisions).
        ``progress(done, total)`` after every group."""
        keys = [tuple(int(k) for k in ch) for ch in children]
        todo = list(dict.fromkeys(k for k in keys if k not in self._memo))
        g = self.group_size()
        done = sum(1 for k in keys if k in self._memo)
        if g <= 1:
            for key in todo:
                self.loss(list(key))
                done += sum(1 for k in keys if k == key)
                if progress is not None:
                    progress(min(done, len(keys)), len(keys))
            return [self._memo[k] for k in keys]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(todo), g):
                group = todo[start : start + g]
                sums = [0.0] * len(group)
                for x, t in zip(self.rows, self.teacher, strict=True):
                    b = x.shape[0]
                    self.supernet.set_choices_rows([list(k) for k in group], b)
                    if self.refit is not None:
                        self.refit.set_children(group, b)
                    with torch.no_grad():
                        logits = self.forward(self.model, x.repeat(len(group), 1))
                    for j in range(len(group)):
                        sums[j] += float(kd_loss(logits[j * b : (j + 1) * b], t, self.temperature))
                    del logits
                self.calls += len(group)
                for key, v in zip(group, sums, strict=True):
                    self._memo[key] = world_mean(v / len(self.rows))
                    done += sum(1 for k in keys if k == key)
                if progress is not None:
                    progress(min(done, len(keys)), len(keys))
        finally:
            self.supernet.clear()
            if self.refit is not None:
                self.refit.set_children([], 1)
            self.model.train(was_training)
        return [self._memo[k] for k in keys]

    def group_size(self) -> int:
        """Children per forward: ``KdJudge.max_group``, fewer so that their logits stay within
        ``KdJudge.logits_bytes``; 1 when the supernet cannot give children rows of their own."""
        if not self.supernet.rows_batchable() or not self.rows:
            return 1
        x, t = self.rows[0], self.teacher[0]
        per_child = t.numel() * 4 * max(1, x.shape[0]) // max(1, t.shape[0])
        return max(1, min(self.max_group, self.logits_bytes // max(1, per_child)))

    def close(self) -> None:
        self.supernet.remove()
        if self.refit is not None:
            self.refit.close()
        self.teacher = []


def local_rows(x_BT: torch.Tensor, par: Any) -> torch.Tensor:
    """This DP rank's contiguous ``B / dp`` rows of a judge batch; all ``B`` when ``dp`` does not divide ``B``."""
    if par.dp_size == 1 or x_BT.shape[0] % par.dp_size:
        return x_BT
    n = x_BT.shape[0] // par.dp_size
    return x_BT[par.dp_rank * n : (par.dp_rank + 1) * n]


def world_mean(value: float) -> float:
    """The mean of ``value`` over every rank: bit-identical on all of them, so every rank takes the
    same greedy decisions (a TP rank's float rounding must not split the ranks' choices)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / dist.get_world_size()


def make_judge(
    kind: str,
    *,
    importance: Callable[[], list[list[float]]],
    model: Callable[[], torch.nn.Module] | None,
    parent: ArchSpec,
    decisions: list[Decision],
    batches: Callable[[], list[torch.Tensor]],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    refit: Callable[[torch.nn.Module], RefitCorrection] | None = None,
) -> Any:
    """``search.judge``: ``kd`` (the model's own loss) or ``importance`` (the activation proxy);
    ``refit`` builds the KD judge's ``RefitCorrection`` (children judged as extract re-fits them)."""
    if kind == "importance":
        return ProxyJudge(importance())
    if kind == "kd":
        if model is None:
            raise ValueError("search.judge=kd needs the sorted parent's model")
        return KdJudge(model(), parent, decisions, batches(), forward, temperature, refit)
    raise ValueError(f"search.judge={kind!r} is not a judge; use one of ['importance', 'kd']")


class RefitCorrection:
    """The judge's children as extract will start them: each narrowed attention / MLP block's output
    projection re-fit by least squares (``extract/compensate.py``, ``extract.refit=least_squares``)
    instead of the plain slice, so that the search prices a narrowing the way recovery sees it.

    The re-fit of a block depends only on the parent's Gram matrix at its output projection and on
    the channels the option keeps, so the matrices are collected once (the parent's forward over
    extract's own calibration batches) and each option's correction ``D = V - W[:, K]`` is solved
    the first time a child uses it. A forward hook on the projection (after the supernet's input
    mask) adds ``x_K D^T`` to its output: with one-hot choices the supernet child then computes the
    re-fit student exactly (``tests/test_judge_refit.py``). Under tensor parallelism each rank adds
    its shard's part and the sum is reduced as the projection's own output is."""

    def __init__(
        self,
        model: torch.nn.Module,
        parent: ArchSpec,
        decisions: list[Decision],
        batches: list[torch.Tensor],
        forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
        ridge: float,
    ):
        self.parent, self.decisions, self.ridge = parent, decisions, float(ridge)
        self.tp, self.group = parallel_groups()["tp"]
        layers = block_layers(model)
        self.of_block: dict[int, int] = {}  # block -> its decision's index
        for j, d in enumerate(decisions):
            kind, pb = kind_of(d), parent.blocks[d.block_index]
            if any(kind.refit(pb, kind.merge(d, pb, o)) is not None for o in d.options):
                self.of_block[d.block_index] = j
        self.grams, self.tokens = collect_grams(model, parent, list(self.of_block), batches, forward)
        self.sites = {bi: kind_of(parent.blocks[bi]).refit_site(layers[bi]) for bi in self.of_block}
        self.weights = {
            bi: cat_over(site.weight.detach(), self.tp, self.group, dim=1).double().cpu()
            for bi, site in self.sites.items()
        }
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._children: list[tuple[int, ...]] = []
        self._rows = 1
        self.enabled = True
        self._handles = [site.register_forward_hook(self._hook(bi)) for bi, site in self.sites.items()]

    def correction(self, bi: int, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kept channels, D [H, K])`` of option ``k`` at block ``bi``; None where the option keeps
        the block whole, removes it, or its re-fit is no better than the slice (as extract keeps it)."""
        if (bi, k) not in self._cache:
            d = self.decisions[self.of_block[bi]]
            kind, pb = kind_of(d), self.parent.blocks[bi]
            r = kind.refit(pb, kind.merge(d, pb, d.options[k]))
            out = None
            if r is not None:
                kept = r[1]
                w, g = self.weights[bi], self.grams[bi].cpu()
                v, sliced, fitted = solve(w, g[kept][:, kept], g[kept], g, kept, self.ridge)
                if torch.isfinite(v).all() and fitted <= sliced:
                    out = (kept, (v - w[:, kept]).float())
            self._cache[(bi, k)] = out
        return self._cache[(bi, k)]

    def set_children(self, children: list[tuple[int, ...]], rows: int) -> None:
        """The children of the next forward: child ``g`` owns rows ``g*rows .. (g+1)*rows - 1``."""
        self._children, self._rows = [tuple(c) for c in children], int(rows)

    def _hook(self, bi: int) -> Callable[..., Any]:
        def hook(mod: Any, args: tuple, output: Any) -> Any:
            if not self.enabled or not self._children:
                return None
            cs = [self.correction(bi, ch[self.of_block[bi]]) for ch in self._children]
            if all(c is None for c in cs):
                return None
            x = args[0]  # [S, B, F_local], already masked by the supernet
            local = x.shape[-1]
            start = local * (self._rank() if self.tp > 1 else 0)
            parts = []
            for g, c in enumerate(cs):
                xs = x[:, g * self._rows : (g + 1) * self._rows] if len(cs) > 1 else x
                if c is None:
                    parts.append(xs.new_zeros(*xs.shape[:-1], self.weights[bi].shape[0]))
                    continue
                kept, dk = c
                sel = (kept >= start) & (kept < start + local)
                dk = dk[:, sel].to(device=x.device, dtype=x.dtype)
                parts.append(xs.index_select(-1, (kept[sel] - start).to(x.device)) @ dk.T)
            delta = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            delta = self._reduce(mod, delta)
            if isinstance(output, tuple):
                return (output[0] + delta, *output[1:])
            return output + delta

        return hook

    def _rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def _reduce(self, mod: Any, delta: torch.Tensor) -> torch.Tensor:
        """Each rank's partial correction summed as the row-parallel projection's output is."""
        if self.tp == 1:
            return delta
        if getattr(mod, "sequence_parallel", False):
            return reduce_scatter_to_sequence_parallel_region(delta)
        return reduce_from_tensor_model_parallel_region(delta)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

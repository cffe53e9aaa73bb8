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

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.search.space import Decision


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
    ):
        from autocompress_nemo.distill.optim import Parallel
        from autocompress_nemo.search.supernet import Supernet

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
        self.supernet.enabled = True
        self._memo: dict[tuple[int, ...], float] = {}
        self.calls = 0

    def loss(self, choices: list[int]) -> float:
        from autocompress_nemo.distill.kd import kd_loss

        key = tuple(int(k) for k in choices)
        if key in self._memo:
            return self._memo[key]
        self.calls += 1
        self.supernet.set_choices(list(key))
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            vals = [
                float(kd_loss(self.forward(self.model, x), t, self.temperature))
                for x, t in zip(self.rows, self.teacher, strict=True)
            ]
        self.model.train(was_training)
        out = world_mean(sum(vals) / len(vals))
        self._memo[key] = out
        return out

    def losses(self, children: list[list[int]], progress: Callable[[int, int], None] | None = None) -> list[float]:
        """``loss`` of every child, the ones not judged yet in groups of ``group_size()`` per forward
        (the batch repeated once per child, each child's masks on its own rows: ``Supernet.
        set_choices_rows``); one child per forward where the supernet cannot (MoE / Mamba decisions).
        ``progress(done, total)`` after every group."""
        from autocompress_nemo.distill.kd import kd_loss

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
    import torch.distributed as dist

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
) -> Any:
    """``search.judge``: ``kd`` (the model's own loss) or ``importance`` (the activation proxy)."""
    if kind == "importance":
        return ProxyJudge(importance())
    if kind == "kd":
        if model is None:
            raise ValueError("search.judge=kd needs the sorted parent's model")
        return KdJudge(model(), parent, decisions, batches(), forward, temperature)
    raise ValueError(f"search.judge={kind!r} is not a judge; use one of ['importance', 'kd']")

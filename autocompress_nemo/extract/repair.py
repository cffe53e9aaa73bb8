"""Greedy repair and growth of snapped choices against the exact predictor, judged by a loss.

- repair (over budget): repeatedly take the one-step shrink (option k -> k-1 of one decision)
  that raises the judge's loss least per unit of normalized cost saved on the violated budgets,
  until every budget holds;
- growth (under budget): repeatedly take the one-step widening that lowers the loss most per
  unit of normalized cost added, as long as every budget still holds, until no budget is left
  unused by more than ``threshold``.

The judge (``search/judge.py``) is by default the KD loss of the supernet child on fixed
calibration batches, i.e. the model's own loss, not an additive proxy: a cut whose damage
compounds with earlier cuts is seen as such. A step is lazy-greedy: every move's loss change is
remembered from when it was last measured; the move that ranks best is measured again at the
current choices and taken once its fresh score still ranks best (at most ``reevaluate``
re-measurements per step, then the best freshly measured move is taken). A judge call is one
masked forward on the calibration batches, so a step costs a few forwards instead of one per
decision.

``option_importance`` gives the summed sorted-parent scores every option keeps (heads or ffn
neurons), the activation proxy of ``ProxyJudge``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.search.space import Decision, apply_choices

Predict = Callable[[ArchSpec], dict[str, float]]


def option_importance(decisions: list[Decision], sorted_imp: Any) -> list[list[float]]:
    """Summed sorted-parent scores kept by every option of every decision (a removed option keeps 0;
    what an option keeps: its block kind's ``kept_importance``, ``blocks/``). ``sorted_imp``: the
    rank stage's sorted scores (``rank.importance.Importance``)."""
    out = []
    for d in decisions:
        s = sorted_imp.blocks[d.block_index]
        k = kind_of(d)
        out.append([0.0 if o.removed else k.kept_importance(d, o, s) for o in d.options])
    return out


Progress = Callable[[int, int], None]


def progress_lines(log: Callable[[str], None], label: str, what: str, min_total: int = 4) -> Progress:
    """A ``(done, total)`` callback logging ``[label done/total] what`` with the time left at every quarter
    (and the last) of a call of at least ``min_total`` items; the count never passes the total."""
    import time

    state = {"t0": time.time()}  # (a batched judge's first report may already be past 1)

    def report(done: int, total: int) -> None:
        if done <= 1:
            state["t0"] = time.time()
        if total < min_total or done > total or (done % max(1, total // 4) and done != total):
            return
        el = time.time() - state["t0"]
        log(f"[{label} {done}/{total}] {what} ({el:.0f} s, ~{el / done * (total - done):.0f} s left)")

    return report


def judge_many(judge: Any, children: list[list[int]], progress: Progress | None = None) -> list[float]:
    """The judge's loss of every child: in batches when the judge can (``KdJudge.losses``: several
    children in one forward), else one call each; ``progress(done, total)`` after each."""
    many = getattr(judge, "losses", None)
    if many is not None:
        return list(many(children, progress))
    out = []
    for i, ch in enumerate(children):
        out.append(judge.loss(ch))
        if progress is not None:
            progress(i + 1, len(children))
    return out


def violations(costs: dict[str, float], budgets: dict[str, float]) -> dict[str, float]:
    """Relative excess per violated budget (``cost / budget - 1 > 0``)."""
    return {m: costs[m] / b - 1.0 for m, b in budgets.items() if costs[m] > b * (1 + 1e-9)}


def _norm_cost(costs: dict[str, float], budgets: dict[str, float], metrics: list[str]) -> float:
    return sum(costs[m] / budgets[m] for m in metrics)


def _moves(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    direction: int,
    value: Callable[[dict[str, float]], float | None],
) -> dict[int, tuple[list[int], dict[str, float], float]]:
    """Every allowed one-step move of ``direction``: decision -> (choices after it, their predicted
    costs, the normalized cost it buys, ``value(costs)``, positive)."""
    out: dict[int, tuple[list[int], dict[str, float], float]] = {}
    for i, k in enumerate(choices):
        if not 0 <= k + direction < len(decisions[i].options):
            continue
        trial = choices[:i] + [k + direction] + choices[i + 1 :]
        c = predict(apply_choices(parent, decisions, trial))
        v = value(c)
        if v is not None and v > 0:
            out[i] = (trial, c, v)
    return out


def _lazy_greedy(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    judge: Any,
    direction: int,
    move_value: Callable[[dict[str, float], dict[str, float]], float | None],
    gap: Callable[[dict[str, float]], float],
    log: Callable[[str], None],
    verb: str,
    reevaluate: int = 4,
    batch_fraction: float = 0.2,
) -> tuple[list[int], int, dict[str, float] | None]:
    """Take one-step moves of ``direction`` (-1 shrink, +1 widen) until ``gap(costs) <= 0``.

    ``move_value(costs_now, costs_after)`` is the normalized cost a move buys (saved for a shrink,
    added for a widening) or ``None`` when the move is not allowed; ``gap`` the normalized cost
    still to buy. A move's score is the judge's loss change per unit of its value (lower is better).

    Lazy greedy, in batches: every move's loss change is remembered from when it was last measured
    (a decision that just moved keeps its last figure until measured again); each step measures
    the unmeasured moves and re-measures the stale ones among the best-ranked (at most
    ``max(reevaluate, n // 2)``), then takes the best ``n`` moves on distinct decisions at once,
    ``n`` sized to ``batch_fraction`` of the gap (one move when the gap is small; halved while a
    batch of widenings would break a budget). Returns (choices, moves taken, costs) with ``costs``
    None when no allowed move was left before the gap closed."""
    choices = list(choices)
    costs = predict(apply_choices(parent, decisions, choices))
    cur = judge.loss(choices)
    dloss: dict[int, float] = {}  # decision -> loss change of its move, as last measured
    moves = 0
    while gap(costs) > 0:
        cands = _moves(parent, decisions, choices, predict, direction, partial(move_value, costs))
        if not cands:
            return choices, moves, None
        unmeasured = [i for i in cands if i not in dloss]
        losses = judge_many(judge, [cands[i][0] for i in unmeasured], progress_lines(log, verb, "moves judged", 8))
        for i, v in zip(unmeasured, losses, strict=True):
            dloss[i] = v - cur
        fresh: set[int] = set(unmeasured)

        def ranked(cands: dict[int, tuple[list[int], dict[str, float], float]] = cands) -> list[int]:
            return sorted(cands, key=lambda j: dloss[j] / cands[j][2])

        order = ranked()
        typical = sorted(cands[i][2] for i in order[:10])[min(len(order), 10) // 2]
        n = max(1, min(len(order), int(batch_fraction * gap(costs) / typical)))
        budget_remeasure = max(reevaluate, n // 2)
        while budget_remeasure > 0:
            stale = [i for i in order[:n] if i not in fresh]
            if not stale:
                break
            dloss[stale[0]] = judge.loss(cands[stale[0]][0]) - cur
            fresh.add(stale[0])
            budget_remeasure -= 1
            order = ranked()
        while True:
            take = order[:n]
            new = list(choices)
            for i in take:
                new[i] += direction
            new_costs = predict(apply_choices(parent, decisions, new))
            if n == 1 or move_value(costs, new_costs) is not None:
                break
            n = max(1, n // 2)
        choices, costs = new, new_costs
        cur = judge.loss(choices)
        moves += len(take)
        log(
            f"{verb}: "
            + ", ".join(
                f"decision {i} (block {decisions[i].block_index}) -> {decisions[i].options[choices[i]]}" for i in take
            )
            + f" ({judge.label} {cur:.4f})"
        )
    return choices, moves, costs


def repair(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    budgets: dict[str, float],
    judge: Any,
    log: Callable[[str], None] = lambda s: None,
    batch_fraction: float = 0.2,
) -> tuple[list[int], int]:
    """Shrink until feasible, the move that costs the judge's loss least per unit of cost saved
    first. Returns (choices, steps taken). Raises if no shrink is left."""

    def saved(now: dict[str, float], after: dict[str, float]) -> float | None:
        metrics = list(violations(now, budgets))
        return _norm_cost(now, budgets, metrics) - _norm_cost(after, budgets, metrics)

    def deficit(c: dict[str, float]) -> float:
        return sum(violations(c, budgets).values())

    out, steps, costs = _lazy_greedy(
        parent, decisions, choices, predict, judge, -1, saved, deficit, log, "repair", batch_fraction=batch_fraction
    )
    if costs is None:
        now = predict(apply_choices(parent, decisions, out))
        raise ValueError(
            "repair cannot meet the budget: every decision is at its smallest option; "
            + ", ".join(f"{m} {now[m]:.4g} > {budgets[m]:.4g}" for m in violations(now, budgets))
        )
    return out, steps


def grow(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    budgets: dict[str, float],
    judge: Any,
    threshold: float,
    log: Callable[[str], None] = lambda s: None,
    batch_fraction: float = 0.2,
) -> tuple[list[int], int]:
    """Widen while feasible and some budget is unused by more than ``threshold``, the move that
    lowers the judge's loss most per unit of cost added first."""
    metrics = list(budgets)

    def added(now: dict[str, float], after: dict[str, float]) -> float | None:
        if violations(after, budgets):
            return None
        return max(_norm_cost(after, budgets, metrics) - _norm_cost(now, budgets, metrics), 1e-12)

    def room(c: dict[str, float]) -> float:
        # growing raises every metric: the tightest budget bounds the batch; done when none has room
        if not any(c[m] < budgets[m] * (1 - threshold) for m in metrics):
            return 0.0
        return max(min(1.0 - c[m] / budgets[m] for m in metrics), 1e-9)

    out, steps, _ = _lazy_greedy(
        parent, decisions, choices, predict, judge, +1, added, room, log, "grow", batch_fraction=batch_fraction
    )
    return out, steps

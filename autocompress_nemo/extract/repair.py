"""Greedy repair and growth of snapped choices against the exact predictor.

- repair (over budget): repeatedly take the one-step shrink (option k -> k-1 of one
  decision) that loses the least importance per unit of normalized cost saved on the
  violated budgets, until every budget holds;
- growth (far under budget): repeatedly take the one-step widening that gains the most
  importance per unit of normalized cost added, as long as every budget still holds,
  until no budget is left unused by more than ``grow_threshold``.

Importance of an option = the summed sorted-parent scores of the units it keeps (heads or
ffn neurons), so "loses least importance" is measured in the same activation units the
rank stage produced.
"""

from __future__ import annotations

from collections.abc import Callable

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.rank.importance import Importance
from autocompress_nemo.search.space import Decision, apply_choices

Predict = Callable[[ArchSpec], dict[str, float]]


def option_importance(decisions: list[Decision], sorted_imp: Importance) -> list[list[float]]:
    """Summed sorted scores kept by every option of every decision."""
    out = []
    for d in decisions:
        s = sorted_imp.layers[d.block_index // 2]
        row = []
        for o in d.options:
            if d.kind == "attention":
                if o.removed or s.heads is None:
                    row.append(0.0)
                    continue
                parent_hpg = len(s.heads) // d.options[-1].num_kv_groups  # type: ignore[union-attr]
                idx = [g * parent_hpg + r for g in range(o.num_kv_groups) for r in range(o.heads_per_group)]  # type: ignore[union-attr]
                row.append(float(s.heads[idx].sum()))
            else:
                row.append(0.0 if o.removed or s.ffn is None else float(s.ffn[: o.ffn].sum()))  # type: ignore[union-attr]
        out.append(row)
    return out


def violations(costs: dict[str, float], budgets: dict[str, float]) -> dict[str, float]:
    """Relative excess per violated budget (``cost / budget - 1 > 0``)."""
    return {m: costs[m] / b - 1.0 for m, b in budgets.items() if costs[m] > b * (1 + 1e-9)}


def _norm_cost(costs: dict[str, float], budgets: dict[str, float], metrics: list[str]) -> float:
    return sum(costs[m] / budgets[m] for m in metrics)


def repair(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    budgets: dict[str, float],
    importance: list[list[float]],
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[int], int]:
    """Shrink until feasible. Returns (choices, steps taken). Raises if no shrink is left."""
    choices = list(choices)
    steps = 0
    costs = predict(apply_choices(parent, decisions, choices))
    while viol := violations(costs, budgets):
        metrics = list(viol)
        base = _norm_cost(costs, budgets, metrics)
        best = None
        for i, k in enumerate(choices):
            if k == 0:
                continue
            trial = choices[:i] + [k - 1] + choices[i + 1 :]
            c = predict(apply_choices(parent, decisions, trial))
            saved = base - _norm_cost(c, budgets, metrics)
            if saved <= 0:
                continue
            lost = importance[i][k] - importance[i][k - 1]
            score = lost / saved
            if best is None or score < best[0]:
                best = (score, i, c)
        if best is None:
            raise ValueError(
                "repair cannot meet the budget: every decision is at its smallest option; "
                + ", ".join(f"{m} {costs[m]:.4g} > {budgets[m]:.4g}" for m in metrics)
            )
        _, i, costs = best
        choices[i] -= 1
        steps += 1
        log(f"repair: decision {i} (block {decisions[i].block_index}) -> {decisions[i].options[choices[i]]}")
    return choices, steps


def grow(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    budgets: dict[str, float],
    importance: list[list[float]],
    threshold: float,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[int], int]:
    """Widen while feasible and some budget is unused by more than ``threshold``."""
    choices = list(choices)
    steps = 0
    costs = predict(apply_choices(parent, decisions, choices))
    metrics = list(budgets)
    while any(costs[m] < budgets[m] * (1 - threshold) for m in metrics):
        base = _norm_cost(costs, budgets, metrics)
        best = None
        for i, k in enumerate(choices):
            if k + 1 >= len(decisions[i].options):
                continue
            trial = choices[:i] + [k + 1] + choices[i + 1 :]
            c = predict(apply_choices(parent, decisions, trial))
            if violations(c, budgets):
                continue
            added = max(_norm_cost(c, budgets, metrics) - base, 1e-12)
            gain = importance[i][k + 1] - importance[i][k]
            score = gain / added
            if best is None or score > best[0]:
                best = (score, i, c)
        if best is None:
            break
        _, i, costs = best
        choices[i] += 1
        steps += 1
        log(f"grow: decision {i} (block {decisions[i].block_index}) -> {decisions[i].options[choices[i]]}")
    return choices, steps

"""From the router's (or Minitron++'s) choice to the architecture that is sliced.

``settle`` = repair (over budget) -> grow (under budget, AutoCompress) -> quality guard, all judged
by the model's own loss (``search/judge.py``); ``verify_measured`` closes the loop on the target's
engine: it measures the settled child, tightens a missed metric's predicted target and settles
again, and when a measurement passes with room it calibrates the targets on that measurement and
grows back toward the budget, so the student spends its budget.

The quality guard compares the settled child's loss with two alternatives on the same batches:

- the best uniform child (Minitron-style: one shape per block kind, no block removed): of the
  ``uniform_pool`` uniform children of the largest predicted cost within the same targets, the one
  the judge gives the lowest loss (the widest one alone can be a poor reference: on SmolLM2 at 0.75x
  its KD was 7.29 where the best uniform child's was 1.12);
- the router's final expected loss (the mean KD of its last steps, on its training batches; only
  informative: the engine check may have tightened the targets since).

A child whose loss exceeds ``guard_factor`` (default 1: any loss) times an alternative's is repaired
differently: over the uniform child's, the uniform child itself and the uniform child grown to the
same targets; over the router's, the search's
own choice settled again toward the same targets in small batches (``careful_fraction`` of the
gap per batch instead of ``batch_fraction``, each batch judged afresh). The best of them by the
loss replaces the child. The numbers and the verdict go into ``arch.json`` and the report.

On SmolLM2-135M the uniform child is a weak reference before recovery (from the parent to 0.6x
its scripted decode cost: held-out perplexity 115,308 for the best uniform child, 2,103 with the
importance proxy, 514 with the KD judge in batches of half the gap, 143 in batches of a fifth;
parent 20.4 on that text), so the router comparison is the one that acts there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.extract.repair import _norm_cost, grow, judge_many, progress_lines, repair, violations
from autocompress_nemo.search.space import Decision, apply_choices, uniform_candidates

Predict = Callable[[ArchSpec], dict[str, float]]


@dataclass
class Settler:
    """Repair / grow / guard with one judge, one predictor and one set of decisions."""

    parent: ArchSpec
    decisions: list[Decision]
    predict: Predict
    judge: Any
    grow_threshold: float | None = None
    """AutoCompress grows toward the budget; ``None`` (Minitron++) only repairs."""
    guard_factor: float = 1.0
    uniform_pool: int = 32
    """The guard judges the uniform children that meet the targets, widest (by normalized predicted
    cost) first, at most this many, and compares the child with the best of them."""
    uniform_alternative: bool = True
    """Replace a child worse than the best uniform child. Off for Minitron++, whose child is a uniform
    child already chosen by its own scoring (short retraining, more batches): the guard only records."""
    router_kd: float | None = None
    origin: list[int] | None = None
    """The search's own choice (before any repair): the careful alternative restarts from it."""
    batch_fraction: float = 0.2
    careful_fraction: float = 0.1
    use_guard: bool = True
    log: Callable[[str], None] = print
    repair_steps: int = 0
    grow_steps: int = 0
    guards: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, choices: list[int], target: dict[str, float], guard: bool = True) -> list[int]:
        choices = self._settle(choices, target, self.batch_fraction)
        if guard and self.use_guard:
            choices = self.guard(choices, target)
        return choices

    def _settle(self, choices: list[int], target: dict[str, float], fraction: float) -> list[int]:
        choices, r = repair(
            self.parent, self.decisions, choices, self.predict, target, self.judge, self.log, batch_fraction=fraction
        )
        self.repair_steps += r
        if self.grow_threshold is not None:
            choices, g = grow(
                self.parent,
                self.decisions,
                choices,
                self.predict,
                target,
                self.judge,
                self.grow_threshold,
                self.log,
                batch_fraction=fraction,
            )
            self.grow_steps += g
        return choices

    def uniform_child(self, target: dict[str, float]) -> tuple[list[int] | None, float | None, int]:
        """The best uniform child by the judge among the ``uniform_pool`` widest (by normalized predicted
        cost) that meet ``target``: its choices, its loss and how many were judged (``None, None, 0``
        when none meets the target)."""
        fits: list[tuple[float, list[int]]] = []
        for cand in uniform_candidates(self.parent, self.decisions):
            c = self.predict(apply_choices(self.parent, self.decisions, cand))
            if not violations(c, target):
                fits.append((_norm_cost(c, target, list(target)), cand))
        fits.sort(key=lambda t: -t[0])
        best: tuple[list[int], float] | None = None
        pool = fits[: max(1, int(self.uniform_pool))]
        losses = judge_many(
            self.judge, [cand for _, cand in pool], progress_lines(self.log, "search:guard", "uniform children judged")
        )
        for (_, cand), kd in zip(pool, losses, strict=True):
            if best is None or kd < best[1]:
                best = (cand, kd)
        return (None, None, 0) if best is None else (best[0], best[1], len(pool))

    def guard(self, choices: list[int], target: dict[str, float]) -> list[int]:
        kd = self.judge.loss(choices)
        uni, uni_kd, judged = self.uniform_child(target)
        rec: dict[str, Any] = {
            "judge": self.judge.label,
            "judge_refit": getattr(self.judge, "refit", None) is not None,
            "child_kd": kd,
            "uniform_kd": uni_kd,
            "uniform_choices": uni,
            "uniform_judged": judged,
            "router_expected_kd": self.router_kd,
            "factor": self.guard_factor,
            "target": dict(target),
            "verdict": "kept",
        }
        alternatives: dict[str, list[int]] = {}
        if self.uniform_alternative and uni is not None and uni_kd is not None and kd > self.guard_factor * uni_kd:
            alternatives["the best uniform child"] = list(uni)
            if self.grow_threshold is not None:
                alternatives["the best uniform child grown to the targets"] = self._settle(
                    list(uni), target, self.batch_fraction
                )
        if self.router_kd is not None and self.origin is not None and kd > self.guard_factor * self.router_kd:
            # repaired differently: from the search's own choice, one small batch of moves at a time
            alternatives["the search's choice settled again in small steps"] = self._settle(
                list(self.origin), target, self.careful_fraction
            )
        for what, alt in alternatives.items():
            alt_kd = uni_kd if uni_kd is not None and alt == uni else self.judge.loss(alt)
            rec.setdefault("alternatives", {})[what] = alt_kd
            self.log(
                f"[search:guard] child {self.judge.label} {kd:.4f} over {self.guard_factor}x an alternative: {what} {alt_kd:.4f}"
            )
            if alt_kd < kd:
                choices, kd = alt, alt_kd
                rec["verdict"] = f"replaced by {what}"
        if alternatives and rec["verdict"] == "kept":
            rec["verdict"] = "kept (no alternative was better)"
        rec["final_kd"] = kd
        if self.router_kd is not None and kd > self.guard_factor * self.router_kd:
            rec["note"] = (
                f"final {self.judge.label} {kd:.4f} is over {self.guard_factor}x the router's expected {self.router_kd:.4f} "
                "(the targets may have been tightened by the engine check)"
            )
        self.log(
            f"[search:guard] {self.judge.label}: child {kd:.4f}, uniform child "
            + ("n/a" if uni_kd is None else f"{uni_kd:.4f}")
            + ", router expected "
            + ("n/a" if self.router_kd is None else f"{self.router_kd:.4f}")
            + f" -> {rec['verdict']}"
        )
        self.guards.append(rec)
        return choices


def _retarget(
    target: dict[str, float], over: dict[str, float], b_now: dict[str, float], p: dict[str, float], c: dict[str, float]
) -> str:
    """Move the predicted ``target`` after a measurement (``verify_measured``): tighten the metrics
    over budget, else calibrate every target on it (to grow back). Returns what was done."""
    if over:
        for m in over:
            target[m] = min(target[m], 0.99 * b_now[m] * p[m] / c[m])
        return "tightened " + ", ".join(over)
    for m, b in b_now.items():
        target[m] = max(p[m], 0.99 * b * p[m] / c[m]) if c[m] > 0 else target[m]
    return "calibrated targets on this measurement, grown back"


def verify_measured(
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    predict: Predict,
    budget: dict[str, float],
    settle: Callable[[list[int], dict[str, float]], list[int]],
    measure: Callable[[ArchSpec], Any],
    rounds: int,
    grow_threshold: float | None = None,
    engine_name: str = "engine",
    log: Callable[[str], None] = print,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Measure the settled child in the engine at most ``rounds + 1`` times. ``measure(spec)`` gives the
    metrics in the budget's units, or ``(metrics, budgets, info)``: the budgets in the units of that very
    measurement (the child timed next to the parent: relative budgets against the parent measured in
    the same rounds, so PASS / FAIL is a ratio and does not depend on the minute) and what to record.
    ``budget`` (the table's units) stays the settle target's scale; only ``b_m / c_m`` crosses over:

    - a miss (measured ``c_m > b_m``) tightens that metric's predicted target to
      ``min(t_m, 0.99 * b_m * p_m / c_m)`` (``p_m`` the prediction: the table's error on this very
      model taken out) and settles again;
    - a pass that leaves more than ``grow_threshold`` of a budget unused (AutoCompress) calibrates
      every target on this measurement, ``t_m = max(p_m, 0.99 * b_m * p_m / c_m)``, settles (grows)
      again and measures the grown child;
    - the last passing child is returned when a later one misses and no round is left.
    """
    target, history = dict(budget), []
    last_pass: list[int] | None = None
    for r in range(rounds + 1):
        child = apply_choices(parent, decisions, choices).replace(name=f"{parent.name}-candidate{r}")
        got, p = measure(child), predict(child)
        c, b_now, info = got if isinstance(got, tuple) else (got, budget, {})
        over = {m: c[m] for m, b in b_now.items() if c[m] > b}
        room = (
            grow_threshold is not None and not over and any(c[m] < b * (1 - grow_threshold) for m, b in b_now.items())
        )
        measured, predicted = {m: c[m] for m in budget}, {m: p[m] for m in budget}
        row: dict[str, Any] = dict(round=r, measured=measured, predicted=predicted, predicted_target=dict(target))
        row.update(budget=dict(budget), budget_measured=dict(b_now), **{"pass": not over}, **info)
        history.append(row)
        ratio = info.get("ratio") or {}
        ratio_of = {m: f" [ratio to the parent {ratio[m]:.3f}]" if m in ratio else "" for m in b_now}
        shown = [f"{m} {c[m]:.4g} (predicted {p[m]:.4g}) / budget {b:.4g}{ratio_of[m]}" for m, b in b_now.items()]
        verdict = " -> over budget" if over else " PASS, room left: growing back" if room else " PASS"
        log(f"[search:verify] round {r}: measured in {engine_name} " + ", ".join(shown) + verdict)
        if not over:
            last_pass = list(choices)
            if not room:
                break
        if r == rounds:
            if over and last_pass is not None:
                log(f"[search:verify] round {r} missed the budget: keeping the last child that passed")
                choices = last_pass
                row["action"] = "kept the last passing child"
            elif over:
                log(
                    f"[search:verify] still over budget after {rounds} rounds on measurements: "
                    "the evaluate stage will report it (raise search.verify_rounds or loosen the budget)"
                )
            break
        row["action"] = _retarget(target, over, b_now, p, c)
        try:
            new = settle(choices, target)
        except ValueError as e:  # the tightened target is below the smallest child: stop tightening
            log(f"[search:verify] {e}; keeping the " + ("last child that passed" if last_pass else "measured child"))
            row["action"] = row.get("action", "") + " (target unreachable: stopped)"
            choices = last_pass if last_pass is not None else choices
            break
        if new == choices:
            row["action"] = row.get("action", "") + " (no change)"
            if not over:
                break
        choices = new
    return choices, history

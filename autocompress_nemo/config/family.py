"""``search.budgets`` (a family from one search, ``search/family.py``): the label of a budget in stage
directory names, and the checks ``config/validate.py`` runs on the list."""

from __future__ import annotations

import re
from typing import Any

from autocompress_nemo.config import resolve


def budget_label(value: Any) -> str:
    """A budget value as a readable, path-safe label: ``0.45x``, ``40ms``, ``12GB``, ``0.003``."""
    text = str(value).strip()
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text) or "_"


def check_budgets(search: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """The problems of ``search.budgets`` (``config/validate.py``), each naming the field and the fix."""
    values = search.get("budgets") or []
    p: list[str] = []
    if not isinstance(values, list):
        return [f"search.budgets={values!r} is not a list; give e.g. 'search.budgets=[0.45x,0.6x,0.75x]'"]
    steps = search.get("family_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        p.append(f"search.family_steps={steps!r} must be an integer >= 0 (0: as many as search.steps)")
    if not values:
        return p
    cons = (target.get("budget") or {}).get("constraints") or []
    if len(cons) != 1:
        return p + [
            f"search.budgets needs exactly one constraint in target.budget.constraints (it gives that "
            f"constraint's value per student), the target has {len(cons)}: keep one constraint "
            "(e.g. target.budget.constraints=[{metric:decode_ms,value:0.6x}]) or drop search.budgets"
        ]
    metric = str((cons[0] or {}).get("metric"))
    labels: dict[str, int] = {}
    for i, v in enumerate(values):
        try:
            b = resolve.parse_budget(metric, v)
        except resolve.BudgetError as e:
            p.append(f"search.budgets[{i}]={v!r}: {e} (each entry is a value for the target's {metric})")
            continue
        if b.is_relative and b.relative is not None and b.relative >= 1.0:
            p.append(
                f"search.budgets[{i}]={v!r}: a factor of 1x or more leaves the parent nothing to compress; "
                "give factors below 1 (e.g. 0.6x)"
            )
        label = budget_label(v)
        if label in labels:
            p.append(f"search.budgets[{i}]={v!r} repeats search.budgets[{labels[label]}]; give each budget once")
        labels.setdefault(label, i)
    return p

"""``arch.json``: the chosen architecture and why.

Records the method, the child ArchSpec, per decision its block, options, the router's
final probabilities, the snapped choice and the choice after repair/growth, the exact
predicted costs of the child and of the parent, the budgets, and the tokens spent
choosing. Deterministic: floats are rounded so that the same seed and inputs give the
same bytes (also across TP=1 and TP=2, whose reductions differ in the last bits).
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.search.space import Decision


def _r(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def arch_record(
    method: str,
    parent: ArchSpec,
    child: ArchSpec,
    decisions: list[Decision],
    probs: list[list[float]],
    snapped: list[int],
    final: list[int],
    predicted_child: dict[str, float],
    predicted_parent: dict[str, float],
    budgets: dict[str, float],
    selection_tokens: int,
    repair_steps: int = 0,
    grow_steps: int = 0,
    provenance: str = "",
) -> dict[str, Any]:
    blocks = []
    for d, p, s, f in zip(decisions, probs, snapped, final, strict=True):
        blocks.append(
            {
                "block": d.block_index,
                "kind": d.kind,
                "options": [_describe(o) for o in d.options],
                "probs": [_r(x, 3) for x in p],
                "snapped": s,
                "chosen": f,
                "chosen_shape": _describe(d.options[f]),
                "parent_shape": _describe(d.options[-1]),
            }
        )
    return {
        "method": method,
        "child": child.to_dict(),
        "pattern": child.pattern,
        "decisions": blocks,
        "predicted": {k: _r(v) for k, v in sorted(predicted_child.items()) if isinstance(v, (int, float))},
        "predicted_parent": {k: _r(v) for k, v in sorted(predicted_parent.items()) if isinstance(v, (int, float))},
        "budgets": {k: _r(v) for k, v in sorted(budgets.items())},
        "selection_tokens": int(selection_tokens),
        "repair_steps": repair_steps,
        "grow_steps": grow_steps,
        "cost_provenance": provenance,
    }


def _describe(b: Any) -> str:
    if b.kind == "attention":
        return "removed" if b.removed else f"heads={b.num_heads},kv={b.num_kv_groups}"
    if b.kind == "mlp":
        return "removed" if b.removed else f"ffn={b.ffn}"
    return str(b)

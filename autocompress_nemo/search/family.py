"""A family from one search (``search.budgets``): one student per budget from one profile, one rank
and one supernet.

The first budget's search trains the supernet and its router as a single-budget search does; with
``search.train_weights`` its trained weights are kept in its artifact (``supernet.safetensors``).
Every further budget loads those weights, keeps them frozen and trains only its own router, for
``search.family_steps`` steps (default ``search.steps``, as many as the first: on SmolLM2 at 0.75x a
router given a quarter of them chose a child with KD 1.36 where the full count gave 0.78, worse than
Minitron++'s uniform child at 1.12): one router per budget on the
shared supernet. Frozen, because the weights only judge choices (the student is sliced from the
sorted parent), because the extra cost is then the router's alone (no weight gradients, no weight
optimizer state), and because every budget is then judged by the same weights whatever the other
budgets are — which is what lets a budget's artifacts be reused when another budget changes.

Each budget runs the stages after ``rank`` with its own config (the target's one constraint set to
that budget, ``search.budgets`` set to that budget alone: ``budget_config``), so its cache keys never
see the other budgets, and its stage directories carry the suffix ``@<budget>``
(``search_autocompress@0.45x``, ``evaluate@0.45x``...). Changing the first budget reruns every
budget (the supernet changes); adding, removing or changing another reruns only that one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from autocompress_nemo.config.family import budget_label

SUPERNET = "supernet.safetensors"
"""In the first budget's search artifact: the supernet weights its search trained (HF names)."""


@dataclass(frozen=True)
class Member:
    """One budget of the family: its raw value, its directory suffix, its config, whether it trains the supernet."""

    value: Any
    suffix: str
    cfg: DictConfig
    first: bool


def family_steps(search: Any) -> int:
    """Router steps of every budget after the first: ``search.family_steps``, or (0) ``search.steps``."""
    n = int(search.get("family_steps", 0) or 0)
    return n if n > 0 else max(1, int(search.steps))


def budget_config(cfg: DictConfig, value: Any, first: bool) -> DictConfig:
    """``cfg`` for one budget: the target's constraint set to ``value`` and ``search.budgets=[value]``
    (the first budget's ``family_steps`` zeroed: it does not read it, so changing it keeps the supernet)."""
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    with open_dict(out):
        out.target.budget.constraints[0].value = value
        out.search.budgets = [value]
        if first:
            out.search.family_steps = 0
    return out


def members(cfg: DictConfig) -> list[Member]:
    """The family of ``cfg`` (empty when ``search.budgets`` is unset): one member per budget, in the given order."""
    values = list(cfg.search.get("budgets") or [])
    return [
        Member(v, f"@{budget_label(v)}", budget_config(cfg, v, i == 0), first=(i == 0)) for i, v in enumerate(values)
    ]


def save_supernet(ctx: Any, spec: Any, model: Any, out: Path) -> Path:
    """The trained supernet weights of the first budget's search, HF-named, in its artifact."""
    from safetensors.torch import save_file

    sd = ctx.to_hf(spec, model)
    path = out / SUPERNET
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(path))
    return path


def load_supernet(first: Path | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The first budget's trained supernet weights (``None`` when its search trained none: the
    supernet is then the sorted parent itself) and what was read, for ``arch.json``."""
    if first is None:
        return None, {}
    path = Path(first) / SUPERNET
    if not path.is_file():
        return None, {"supernet_from": "the sorted parent (search.train_weights=false: no weights trained)"}
    from safetensors.torch import load_file

    from autocompress_nemo.utils.artifacts import sha256_file

    return load_file(str(path)), {"supernet_from": str(path), "supernet_sha256": sha256_file(path)}


def family_record(
    search: Any, method: str, first: bool, outcome: Any, read: dict[str, Any], steps: int
) -> dict[str, Any]:
    """``arch.json``'s ``family`` entry: this budget, its role, the supernet it read, its search cost."""
    from autocompress_nemo.stages.common import method_object

    value = (list(search.get("budgets") or []) or [None])[0]
    shares = method_object(method).shares_supernet
    if not shares:
        role = "per budget: Minitron++ enumerates uniform candidates (no supernet)"
    elif first:
        role = "first: trains the supernet and its router"
    else:
        role = "extra: its own router on the first budget's supernet, frozen"
    return {
        "budget": str(value),
        "first": first,
        "role": role,
        "router_steps": steps,
        "supernet_trained": bool(search.train_weights) and first and shares,
        "supernet_read": bool(read.get("supernet_sha256")),
        **read,
        "search_tokens": int(getattr(outcome, "tokens", 0)),
        "search_wall_s": round(float(getattr(outcome, "wall_s", 0.0)), 2),
    }

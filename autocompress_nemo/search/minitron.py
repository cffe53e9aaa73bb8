"""Minitron++ baseline: a mode of the same code (``search=minitron_pp``).

Same importance-sorted parent, same cost model and budgets; one width per dimension for
all layers, all layers kept. It enumerates the uniform candidates the exact predictor
calls feasible, keeps the ``minitron_candidates`` largest (by the normalized cost they
spend, i.e. closest to the budget), optionally gives each a short distillation from the
parent (``minitron_retrain_steps``, as Minitron's lightweight retraining of its top
candidates), scores each by distillation loss on calibration batches, and returns the
best. Every token it spends choosing is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distill.kd import kd_loss, kd_train
from autocompress_nemo.search.autocompress import CostFunctions, SearchOutcome
from autocompress_nemo.search.space import Decision, apply_choices, uniform_candidates
from autocompress_nemo.search.supernet import Supernet


def feasible_uniform(
    parent: ArchSpec, decisions: list[Decision], costs: CostFunctions, budgets: dict[str, float]
) -> list[tuple[float, list[int], dict[str, float]]]:
    """(normalized cost spent, choices, predicted costs) of every feasible uniform candidate,
    most budget-spending first."""
    out = []
    for ch in uniform_candidates(parent, decisions):
        c = costs.predict(apply_choices(parent, decisions, ch))
        if all(c[m] <= b for m, b in budgets.items()):
            spent = sum(c[m] / b for m, b in budgets.items())
            out.append((spent, ch, c))
    out.sort(key=lambda t: (-t[0], t[1]))
    return out


def run_minitron_pp(
    model: torch.nn.Module,
    parent: ArchSpec,
    decisions: list[Decision],
    costs: CostFunctions,
    budgets: dict[str, float],
    batch_at: Callable[[int], torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: Any,
    log: Callable[[str], None] = print,
    fresh_model: Callable[[], torch.nn.Module] | None = None,
) -> SearchOutcome:
    """``fresh_model()`` builds another copy of the sorted parent (needed when candidates are
    retrained: Megatron models hold process groups and cannot be deep-copied)."""
    t0 = time.time()
    feas = feasible_uniform(parent, decisions, costs, budgets)
    if not feas:
        raise ValueError(
            "Minitron++: no uniform architecture (one width for all layers, all layers kept) meets the budget; "
            "the heterogeneous search space may still reach it"
        )
    top = feas[: max(1, cfg.minitron_candidates)]
    log(f"minitron++: {len(feas)} feasible uniform candidates; scoring the top {len(top)}")
    retrain = int(getattr(cfg, "minitron_retrain_steps", 0))
    n_score = int(cfg.minitron_score_batches)
    tokens = 0
    trajectory = []
    best: tuple[float, list[int]] | None = None
    for ci, (spent, ch, c) in enumerate(top):
        if retrain and fresh_model is None:
            raise ValueError("minitron_retrain_steps > 0 needs fresh_model() to copy the sorted parent")
        cand_model = fresh_model() if retrain and fresh_model is not None else model
        sn = Supernet(cand_model, parent, decisions)

        def teacher(x: torch.Tensor, sn: Supernet = sn, m: torch.nn.Module = cand_model) -> torch.Tensor:
            sn.enabled = False
            try:
                return forward(model, x)
            finally:
                sn.enabled = True

        sn.set_choices(ch)
        if retrain:
            for p in cand_model.parameters():
                p.requires_grad_(True)
            kd_train(
                cand_model,
                teacher,
                lambda x, m=cand_model: forward(m, x),
                (batch_at(s) for s in range(retrain)),
                lr=cfg.weight_lr,
                temperature=cfg.kd_temperature,
            )
            tokens += sum(batch_at(s).numel() for s in range(retrain))
        losses = []
        with torch.no_grad():
            for s in range(n_score):
                x = batch_at(10_000_000 + s)  # calibration batches disjoint from the retraining ones
                sn.enabled = False
                t = forward(model, x)
                sn.enabled = True
                losses.append(float(kd_loss(forward(cand_model, x), t, cfg.kd_temperature)))
                tokens += x.numel()
        sn.remove()
        score = sum(losses) / len(losses)
        arch = apply_choices(parent, decisions, ch)
        log(f"minitron++ candidate {ci + 1}/{len(top)}: kd={score:.4f} spent={spent:.3f} pattern={_shape(arch)}")
        trajectory.append({"candidate": ci, "kd": score, "spent": spent, "choices": ch, **{f"predicted_{m}": v for m, v in c.items()}})
        if best is None or score < best[0]:
            best = (score, ch)
    assert best is not None
    return SearchOutcome(
        choices=best[1],
        probs=[[1.0 if k == best[1][i] else 0.0 for k in range(len(d.options))] for i, d in enumerate(decisions)],
        trajectory=trajectory,
        tokens=tokens,
        wall_s=time.time() - t0,
    )


def _shape(spec: ArchSpec) -> str:
    a, m = spec.layers()[0]
    return f"heads={a.num_heads} kv={a.num_kv_groups} ffn={m.ffn}"

"""Learning-rate schedule of recovery distillation: linear warm-up, then cosine decay.

The same schedule runs on both optimizer paths. With ``W`` warm-up steps, ``N`` total
steps, peak ``lr`` and floor ``min_lr``, the learning rate used by (0-based) step ``s`` is
Megatron's ``OptimizerParamScheduler.get_lr`` evaluated at ``n = s + 1`` steps taken:

    n <= W:  lr * n / W
    n >  W:  min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (n - W) / (N - W)))

so the first step already learns (``lr / W``) and the last step (``n = N``) uses ``min_lr``.
On the Megatron path the scheduler itself is stepped before each optimizer step, which
gives exactly these values (``tests/test_distill.py`` checks the two agree).
"""

from __future__ import annotations

import math
from typing import Any


def clamp_warmup(warmup_steps: int, total_steps: int) -> int:
    """Warm-up shorter than the run (Megatron asserts ``warmup < decay steps``)."""
    return max(0, min(int(warmup_steps), int(total_steps) - 1))


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 0-based ``step`` (formula in the module docstring)."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: need at least one step")
    if min_lr > lr:
        raise ValueError(f"distill.min_lr={min_lr} is above distill.lr={lr}; make min_lr <= lr")
    w = clamp_warmup(warmup_steps, total_steps)
    n = step + 1
    if w > 0 and n <= w:
        return lr * n / w
    if n > total_steps:
        return min_lr
    ratio = (n - w) / (total_steps - w)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def megatron_scheduler(
    optimizer: Any, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, weight_decay: float
) -> Any:
    """Megatron's ``OptimizerParamScheduler`` set up for the schedule above.

    Step it with ``step(increment=1)`` *before* each optimizer step: after ``s + 1``
    increments it holds ``lr_at(s)``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=clamp_warmup(warmup_steps, total_steps),
        lr_decay_steps=max(1, total_steps),
        lr_decay_style="cosine",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(1, total_steps),
        wd_incr_style="constant",
    )

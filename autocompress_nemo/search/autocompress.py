"""AutoCompress search: the router trained by distillation from the frozen parent plus the
two-sided resource penalty on the expected cost from the differentiable predictor.

The teacher is the same sorted parent with masks off (the supernet shares its weights),
so a search step costs one teacher forward and one masked student forward + backward.
Under tensor parallelism the distillation gradient of the router logits is summed over
the TP group (each rank's masks only touch its own heads / neurons); the penalty's
gradient is computed identically on every rank and added after that reduction. Gumbel
noise comes from a generator seeded the same on every rank, so every rank takes the
same step and TP=2 gives the same ``arch.json`` as TP=1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.distill.kd import kd_loss
from autocompress_nemo.distributed.state import tensor_parallel
from autocompress_nemo.search.router import Router, temperature, two_sided_penalty
from autocompress_nemo.search.space import Decision, apply_choices
from autocompress_nemo.search.supernet import Supernet


class CostFunctions(Protocol):
    def predict(self, spec: ArchSpec) -> dict[str, float]: ...

    def expected(self, options: list[list[Block]], probs: list[torch.Tensor], spec: ArchSpec) -> dict[str, torch.Tensor]: ...


@dataclass
class SearchOutcome:
    choices: list[int]
    probs: list[list[float]]
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0


def _tp_group() -> tuple[Any, int]:
    group, _, world = tensor_parallel()
    return group, world


def check_budget_reachable(
    parent: ArchSpec, decisions: list[Decision], costs: CostFunctions, budgets: dict[str, float]
) -> str | None:
    """``None`` if the search is needed; ``"parent"`` if the parent already meets every budget.

    Raises ``ValueError`` (before any training) when even the smallest architecture of the
    search space misses a budget, giving the smallest reachable cost.
    """
    smallest = apply_choices(parent, decisions, [0] * len(decisions))
    c_min = costs.predict(smallest)
    bad = {m: c_min[m] for m, b in budgets.items() if c_min[m] > b}
    if bad:
        raise ValueError(
            "infeasible budget: the smallest architecture in the search space costs "
            + ", ".join(f"{m}={v:.4g} (budget {budgets[m]:.4g})" for m, v in bad.items())
            + "; raise the budget to at least that, or widen the search space (engine capabilities)"
        )
    c_parent = costs.predict(parent)
    if all(c_parent[m] <= b for m, b in budgets.items()):
        return "parent"
    return None


def run_router_search(
    model: torch.nn.Module,
    parent: ArchSpec,
    decisions: list[Decision],
    costs: CostFunctions,
    budgets: dict[str, float],
    batch_at: Callable[[int], torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: Any,
    seed: int,
    checkpoint: str | None = None,
    log: Callable[[str], None] = print,
    router_init: str = "uniform",
) -> SearchOutcome:
    """Train the router for ``cfg.steps`` steps; resumable from ``checkpoint``."""
    supernet = Supernet(model, parent, decisions)
    router = Router(decisions, init=router_init)
    opt = torch.optim.Adam(router.parameters(), lr=cfg.router_lr)
    weight_params = [p for p in model.parameters()] if cfg.train_weights else []
    for p in model.parameters():
        p.requires_grad_(bool(cfg.train_weights))
    wopt = torch.optim.Adam(weight_params, lr=cfg.weight_lr) if weight_params else None
    gen = torch.Generator().manual_seed(seed)
    options = [list(d.options) for d in decisions]
    group, tp_world = _tp_group()
    start, trajectory, tokens = 0, [], 0
    if checkpoint and os.path.exists(checkpoint):
        st = torch.load(checkpoint, weights_only=False)
        router.load_state_dict(st["router"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        start, trajectory, tokens = st["step"], st["trajectory"], st["tokens"]
        if wopt is not None and "weights" in st:
            model.load_state_dict(st["weights"], strict=False)
            wopt.load_state_dict(st["wopt"])
        log(f"search: resumed at step {start}")
    t0 = time.time()
    for step in range(start, cfg.steps):
        tau = temperature(step, cfg.steps, cfg.tau_start, cfg.tau_end)
        x = batch_at(step)
        supernet.enabled = False
        with torch.no_grad():
            t_logits = forward(model, x)
        supernet.enabled = True
        sample = router.sample(tau, gen)
        supernet.set_choice_weights(sample)
        s_logits = forward(model, x)
        kd = kd_loss(s_logits, t_logits, cfg.kd_temperature)
        opt.zero_grad(set_to_none=True)
        if wopt is not None:
            wopt.zero_grad(set_to_none=True)
        kd.backward()
        if tp_world > 1:
            for p in router.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        probs = router.probs()
        exp = costs.expected(options, probs, parent)
        pen = sum(
            two_sided_penalty(exp[m], b, cfg.penalty_over, cfg.penalty_under, cfg.slack) for m, b in budgets.items()
        )
        if torch.is_tensor(pen) and pen.requires_grad:
            pen.backward()
        opt.step()
        if wopt is not None:
            wopt.step()
        tokens += x.numel()
        row = {
            "step": step,
            "tau": tau,
            "kd": float(kd.detach()),
            "penalty": float(pen.detach()) if torch.is_tensor(pen) else float(pen),
            "entropy": router.entropy(),
            **{f"expected_{m}": float(exp[m].detach()) for m in budgets},
            **{f"budget_{m}": b for m, b in budgets.items()},
        }
        trajectory.append(row)
        if step % max(1, cfg.steps // 20) == 0 or step == cfg.steps - 1:
            log(
                f"search step {step + 1}/{cfg.steps} kd={row['kd']:.4f} pen={row['penalty']:.4f} "
                f"H={row['entropy']:.2f} tau={tau:.3f} "
                + " ".join(f"{m}={float(exp[m].detach()):.4g}/{b:.4g}" for m, b in budgets.items())
            )
        if checkpoint and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            st = {"router": router.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                  "step": step + 1, "trajectory": trajectory, "tokens": tokens}
            if wopt is not None:
                st["weights"] = model.state_dict()
                st["wopt"] = wopt.state_dict()
            tmp = f"{checkpoint}.tmp-{os.getpid()}"
            torch.save(st, tmp)
            os.replace(tmp, checkpoint)
    supernet.remove()
    return SearchOutcome(
        choices=router.choices(),
        probs=[p.detach().tolist() for p in router.probs()],
        trajectory=trajectory,
        tokens=tokens,
        wall_s=time.time() - t0,
    )

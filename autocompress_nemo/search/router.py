"""The architecture router: logits per decision, Gumbel-softmax with an annealed temperature,
and the two-sided resource penalty.

Penalty per budget ``b`` on the expected cost ``c`` (costs where smaller is better; a
throughput budget is turned into its per-step time first):

    over  = relu(c / b - 1)                  -> w_over  * (over + over**2)   (strong)
    under = relu((1 - slack) - c / b)        -> w_under * under               (mild)

so exceeding the budget is punished hard, and leaving more than ``slack`` of it unused is
punished too: the budget is spent on quality, not saved.
"""

from __future__ import annotations

import math

import torch

from autocompress_nemo.search.space import Decision


def two_sided_penalty(cost: torch.Tensor, budget: float, w_over: float, w_under: float, slack: float) -> torch.Tensor:
    ratio = cost / budget
    over = torch.relu(ratio - 1.0)
    under = torch.relu((1.0 - slack) - ratio)
    return w_over * (over + over**2) + w_under * under


def temperature(step: int, steps: int, tau_start: float, tau_end: float) -> float:
    """Exponential annealing from ``tau_start`` to ``tau_end`` over ``steps``."""
    if steps <= 1:
        return tau_end
    frac = min(step / (steps - 1), 1.0)
    return tau_start * math.exp(frac * math.log(tau_end / tau_start))


class Router(torch.nn.Module):
    def __init__(self, decisions: list[Decision], init: str = "uniform", init_scale: float = 3.0):
        super().__init__()
        self.decisions = decisions
        logits = []
        for d in decisions:
            x = torch.zeros(len(d.options))
            if init == "parent":
                x[d.parent_option] = init_scale
            elif init == "linear":
                x = torch.linspace(0.0, init_scale, len(d.options))
            elif init != "uniform":
                raise ValueError(f"unknown router init {init!r} (uniform, parent, linear)")
            logits.append(torch.nn.Parameter(x))
        self.logits = torch.nn.ParameterList(logits)

    def probs(self) -> list[torch.Tensor]:
        return [torch.softmax(x, dim=0) for x in self.logits]

    def sample(self, tau: float, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """Gumbel-softmax samples (soft, differentiable), one per decision."""
        out = []
        for x in self.logits:
            u = torch.rand(x.shape, generator=generator).clamp(1e-10, 1 - 1e-10)
            g = -torch.log(-torch.log(u))
            out.append(torch.softmax((x + g) / tau, dim=0))
        return out

    def choices(self) -> list[int]:
        """Argmax option per decision (ties: the larger option, deterministic)."""
        out = []
        for x in self.logits:
            m = x.max()
            out.append(int(torch.nonzero(x == m).max()))
        return out

    def entropy(self) -> float:
        with torch.no_grad():
            return float(sum(-(p * torch.log(p.clamp_min(1e-12))).sum() for p in self.probs()))


def settled(trajectory: list[dict], steps: int, patience: int) -> str | None:
    """Why the router may stop after the last row of ``trajectory``, or ``None`` to go on.

    The rule (``search.settle_steps`` = ``patience``; 0 turns it off): the hard choice — the argmax
    option of every decision, ``row["choice"]``, which is what settle / repair start from — has been
    the same for ``patience`` consecutive steps, the child it names is within ``search.slack`` of
    every budget by the table (``row["choice_fits"]``; the argmax of a router whose expected cost
    meets a budget often lies a few per cent over it, and settle's repair closes that), and at least
    half of ``steps`` are done, so the first half of the temperature anneal always runs. A pure function of the checkpointed trajectory: a resumed
    search stops at the same step."""
    done = len(trajectory)
    if patience <= 0 or done < max(patience, (steps + 1) // 2) or done >= steps:
        return None
    last = trajectory[-patience:]
    if all(r.get("choice") == last[-1].get("choice") and r.get("choice_fits") for r in last):
        return f"the router's choice has been the same for {patience} steps, within the slack of the budget"
    return None

"""AutoCompress search: the router trained by distillation from the frozen parent plus the
two-sided resource penalty on the expected cost from the differentiable predictor.

The teacher is the same sorted parent with masks off (the supernet shares its weights),
so a search step costs one teacher forward and one masked student forward + backward.

Parallel runs (``g`` the router-logit gradient of this rank's KD loss ``kd_r``):

- tensor parallelism: ``g`` is summed over the TP group (each rank's masks only touch its own
  heads / neurons);
- data parallelism, and expert parallelism (world = DP x EP at TP=1): each DP rank takes its
  ``B / dp`` rows of the step's global batch (the whole batch when ``dp`` does not divide ``B``)
  and ``g <- all_reduce_DP(g) / dp``. That is the gradient of the global mean KD also under EP,
  where a rank's expert-ffn masks act on the tokens of every EP rank (its local experts compute
  them): autograd already sends those contributions to the rank that applied the mask, so the
  sum over ranks counts every use of every mask once. Shared weights (``train_weights``) are
  reduced as Megatron's DDP does (``distill.optim.reduce_gradients``: experts over the
  expert-data-parallel group);
- the penalty's gradient is computed identically on every rank and added after the reduction.
  Gumbel noise comes from a generator seeded the same on every rank, so every rank takes the
  same step: TP=2 and EP=2 give the same ``arch.json`` as one process (tests/test_method_tp.py,
  tests/test_ep_stages.py).

Training: the one trainer (``distill.recover.train``) runs the steps, with the router's objective
(``_router_objective``: temperature and Gumbel sample per step, KD of the masked supernet to the
unmasked model) and ``RouterOptimizer``. Checkpoints (``<checkpoint>/checkpoints/step_<N>/``, every
``cfg.checkpoint_every`` steps, at the end and where the router stopped) are the trainer's: one
``torch.save`` shard per model-parallel rank holding the router (and, with ``train_weights``, that
rank's shared weights), both optimizers, the Gumbel generator and the trajectory so far; a resumed
search continues exactly, a checkpoint of other settings is not resumed, one with non-finite
logits is not resumed, and an unreadable one is set aside.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.distill.kd import kd_loss
from autocompress_nemo.distill.optim import Parallel, reduce_gradients
from autocompress_nemo.search.router import Router, settled, temperature, two_sided_penalty
from autocompress_nemo.search.space import Decision, apply_choices
from autocompress_nemo.search.supernet import Supernet


class CostFunctions(Protocol):
    def predict(self, spec: ArchSpec) -> dict[str, float]: ...

    def expected(
        self, options: list[list[Block]], probs: list[torch.Tensor], spec: ArchSpec
    ) -> dict[str, torch.Tensor]: ...


@dataclass
class SearchOutcome:
    choices: list[int]
    probs: list[list[float]]
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    stopped: str | None = None  # why the router ended before ``steps`` (``router.settled``), if it did


def _reduce_router_grads(params: list[torch.nn.Parameter], par: Parallel) -> None:
    """``g <- all_reduce_DP(all_reduce_TP(g)) / dp`` over all router logits in one flat tensor."""
    if par.tp_size == 1 and par.dp_size == 1:
        return
    flat = torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in params])
    if par.tp_size > 1:
        dist.all_reduce(flat, group=par.tp_group)
    if par.dp_size > 1:
        dist.all_reduce(flat, group=par.dp_group)
        flat.div_(par.dp_size)
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p).clone()


class _Trained(torch.nn.Module):
    """What the trainer trains and checkpoints in a router search: the router, and the shared
    weights when ``train_weights``. ``train()`` / ``eval()`` reach the router only: the shared
    model keeps its mode (it is also the teacher)."""

    def __init__(self, router: Router, model: torch.nn.Module | None) -> None:
        super().__init__()
        self.router = router
        if model is not None:
            self.model = model

    def train(self, mode: bool = True) -> _Trained:
        self.training = mode
        self.router.train(mode)
        return self


class RouterOptimizer:
    """The router's Adam (``router_lr``) and, with ``train_weights``, the shared weights' Adam
    (``weight_lr``), in the trainer's optimizer face. A step reduces the gradients as the module
    docstring says, adds the budget penalty's gradient after the reduction (the same on every
    rank), and skips the update when any gradient is non-finite (the same verdict on every rank,
    as a loss scaler skips an overflowing step). The Gumbel generator's state travels in its
    state dict, so a resumed search draws the same samples."""

    name = "router_adam"
    skips_nonfinite = True

    def __init__(
        self,
        router: Router,
        weights: list[torch.nn.Parameter],
        cfg: Any,
        par: Parallel,
        penalty: Callable[[], tuple[Any, dict[str, torch.Tensor]]],
        gen: torch.Generator,
        log: Callable[[str], None],
    ) -> None:
        self.params = list(router.parameters())
        self.opt = torch.optim.Adam(self.params, lr=cfg.router_lr)
        self.weights = weights
        self.wopt = torch.optim.Adam(weights, lr=cfg.weight_lr) if weights else None
        self.lr, self.par, self.penalty, self.gen, self.log = float(cfg.router_lr), par, penalty, gen, log
        self.skipped = 0
        self.last: dict[str, Any] = {}

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.wopt is not None:
            self.wopt.zero_grad(set_to_none=True)

    def step(self, step: int) -> float:
        par = self.par
        _reduce_router_grads(self.params, par)
        if self.wopt is not None and par.world > 1:
            reduce_gradients(self.weights, par)
        pen, exp = self.penalty()
        if torch.is_tensor(pen) and pen.requires_grad:
            pen.backward()
        checked = self.params + self.weights
        finite_t = torch.tensor([float(all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in checked))])
        if par.world > 1:  # expert weights differ per rank: every rank takes the same verdict
            dist.all_reduce(finite_t, op=dist.ReduceOp.MIN)
        finite = bool(finite_t.item())
        if finite:
            self.opt.step()
            if self.wopt is not None:
                self.wopt.step()
        else:
            self.skipped += 1
            self.log(f"search step {step + 1}: non-finite router gradient, update skipped ({self.skipped} so far)")
        self.last = {
            "penalty": float(pen.detach()) if torch.is_tensor(pen) else float(pen),
            "skipped": not finite,
            **{f"expected_{m}": float(v.detach()) for m, v in exp.items()},
        }
        norm = torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None] or [torch.zeros(1)]).norm()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {
            "router": self.opt.state_dict(),
            "weights": self.wopt.state_dict() if self.wopt is not None else None,
            "gen": self.gen.get_state(),
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.opt.load_state_dict(st["router"])
        if self.wopt is not None:
            if st.get("weights") is None:
                raise ValueError("the search checkpoint holds no shared-weight optimizer but train_weights is on")
            self.wopt.load_state_dict(st["weights"])
        self.gen.set_state(st["gen"])


class ParentMeetsBudget(ValueError):
    """The parent already meets every budget: there is nothing to compress (the run stops cleanly)."""


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
    checkpoint: str | Path | None = None,
    log: Callable[[str], None] = print,
    router_init: str = "uniform",
    flops_per_token: float = 0.0,
) -> SearchOutcome:
    """Train the router for ``cfg.steps`` steps, or until its choice has settled
    (``cfg.settle_steps``, ``router.settled``), on the one trainer (``distill.recover.train``, the
    loop of local reconstruction, recovery and pretraining): its checkpoints (``<checkpoint>/
    checkpoints``, every ``cfg.checkpoint_every`` steps and at the end), exact resume, progress and
    TensorBoard. ``checkpoint``: the directory; ``None`` keeps them in a temporary one."""
    from autocompress_nemo.distill.recover import train

    router = Router(decisions, init=router_init)
    train_weights = bool(cfg.train_weights)
    for p in model.parameters():
        p.requires_grad_(train_weights)
    penalty = _penalty(router, parent, decisions, costs, budgets, cfg)
    weights = list(model.parameters()) if train_weights else []
    gen = torch.Generator().manual_seed(seed)
    opt = RouterOptimizer(router, weights, cfg, Parallel.detect(), penalty, gen, log)
    b, t = batch_at(0).shape
    run_cfg = SimpleNamespace(
        tokens=int(cfg.steps) * b * t,
        batch_size=b,
        seq_len=t,
        checkpoint_every=int(cfg.checkpoint_every or 0),
        keep_checkpoints=1,
    )
    supernet = Supernet(model, parent, decisions)
    objective = _router_objective(model, supernet, router, opt, parent, decisions, costs, budgets, forward, cfg, log)
    objective.fingerprint.update(router_init=router_init)
    try:
        with _directory(checkpoint) as ckpt_dir:
            result = train(
                _Trained(router, model if train_weights else None),
                objective,
                batch_at,
                run_cfg,
                ckpt_dir,
                seed,
                optimizer=opt,
                log=log,
                name="search",
                flops_per_token=flops_per_token,
            )
    finally:
        supernet.remove()
    return SearchOutcome(
        choices=router.choices(),
        probs=[p.detach().tolist() for p in router.probs()],
        trajectory=result["history"],
        tokens=int(result["tokens"]),
        wall_s=float(result["wall_s"]),
        stopped=result["stopped"],
    )


@contextlib.contextmanager
def _directory(path: str | Path | None) -> Iterator[str | Path]:
    """``path``, or a temporary directory removed afterwards when it is ``None``."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="acn-router-") as tmp:
        yield tmp


def _penalty(
    router: Router,
    parent: ArchSpec,
    decisions: list[Decision],
    costs: CostFunctions,
    budgets: dict[str, float],
    cfg: Any,
) -> Callable[[], tuple[Any, dict[str, torch.Tensor]]]:
    """The two-sided budget penalty on the router's expected costs, and those costs."""
    options = [list(d.options) for d in decisions]

    def penalty() -> tuple[Any, dict[str, torch.Tensor]]:
        exp = costs.expected(options, router.probs(), parent)
        pen = sum(
            two_sided_penalty(exp[m], b, cfg.penalty_over, cfg.penalty_under, cfg.slack) for m, b in budgets.items()
        )
        return pen, exp

    return penalty


_ROUTER_KEYS = (
    "steps",
    "router_lr",
    "weight_lr",
    "train_weights",
    "tau_start",
    "tau_end",
    "penalty_over",
    "penalty_under",
    "slack",
    "kd_temperature",
    "settle_steps",
)


def _router_objective(
    model: torch.nn.Module,
    supernet: Supernet,
    router: Router,
    opt: RouterOptimizer,
    parent: ArchSpec,
    decisions: list[Decision],
    costs: CostFunctions,
    budgets: dict[str, float],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: Any,
    log: Callable[[str], None],
) -> Any:
    """The router's objective on the trainer: per step a temperature and a Gumbel sample of the
    masks, the KD loss of the masked supernet to the same model with masks off, and a row with the
    penalty, expected costs, entropy and the hard choice; it stops when the choice has settled."""
    from autocompress_nemo.distill.recover import Objective

    steps, patience = int(cfg.steps), int(getattr(cfg, "settle_steps", 0) or 0)
    now: dict[str, Any] = {}

    def begin_step(step: int) -> None:
        now.update(step=step, tau=temperature(step, steps, cfg.tau_start, cfg.tau_end))
        supernet.set_choice_weights(router.sample(now["tau"], opt.gen))

    def loss(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        supernet.enabled = False
        with torch.no_grad():
            t_logits = forward(model, x)
        supernet.enabled = True
        kd = kd_loss(forward(model, x), t_logits, cfg.kd_temperature)
        return kd, {"kd": float(kd.detach())}

    def extras() -> dict[str, Any]:
        hard = router.choices()
        row = {
            "tau": now["tau"],
            **opt.last,
            "entropy": router.entropy(),
            **{f"budget_{m}": b for m, b in budgets.items()},
            "choice": hard,
        }
        if patience > 0:
            cost = costs.predict(apply_choices(parent, decisions, hard))
            row["choice_fits"] = all(cost[m] <= b * (1 + cfg.slack) for m, b in budgets.items())
        step = now["step"]
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            log(
                f"search step {step + 1}/{steps} pen={row['penalty']:.4f} H={row['entropy']:.2f} tau={now['tau']:.3f} "
                + " ".join(f"{m}={row[f'expected_{m}']:.4g}/{b:.4g}" for m, b in budgets.items())
            )
        return row

    return Objective(
        "router",
        loss,
        {**{k: getattr(cfg, k, None) for k in _ROUTER_KEYS}, "budgets": {m: float(b) for m, b in budgets.items()}},
        begin_step=begin_step,
        extras=extras,
        stop=lambda history: settled(history, steps, patience),
    )

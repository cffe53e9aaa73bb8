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

Checkpoint (``checkpoint``, every ``cfg.checkpoint_every`` steps): the router, its optimizer and
the Gumbel generator (the same on every rank) in one file written by rank 0; with
``train_weights`` on more than one process the shared weights and their optimizer go to one file
per model-parallel shard, ``<checkpoint>.<mp_tp.._ep.._pp..>.step<N>.pt``, written before the
router file names step N (so a kill leaves the previous complete checkpoint).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.distill.checkpoint import save_atomic
from autocompress_nemo.distill.kd import kd_loss
from autocompress_nemo.distill.optim import Parallel, reduce_gradients
from autocompress_nemo.search.router import Router, temperature, two_sided_penalty
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


def _local_rows(x_BT: torch.Tensor, par: Parallel) -> torch.Tensor:
    """This DP rank's contiguous ``B / dp`` rows; all ``B`` when ``dp`` does not divide ``B``."""
    if par.dp_size == 1 or x_BT.shape[0] % par.dp_size:
        return x_BT
    n = x_BT.shape[0] // par.dp_size
    return x_BT[par.dp_rank * n : (par.dp_rank + 1) * n]


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


def _shard_file(checkpoint: str, par: Parallel, step: int) -> Path:
    return Path(f"{checkpoint}.{par.shard_name}.step{step:06d}.pt")


def _save_checkpoint(checkpoint: str, par: Parallel, st: dict[str, Any], weights: dict[str, Any] | None) -> None:
    """Weights per shard first (more than one process), then the router file by rank 0 (module docstring)."""
    step = int(st["step"])
    if weights is not None and par.world > 1:
        if par.writes_checkpoint:
            save_atomic(weights, _shard_file(checkpoint, par, step))
        st = {**st, "weights_layout": par.layout}
    elif weights is not None:
        st = {**st, **weights}
    par.barrier()
    if par.is_rank0:
        save_atomic(st, Path(checkpoint))
        for old in Path(checkpoint).parent.glob(f"{Path(checkpoint).name}.mp_*.step*.pt"):
            if not old.name.endswith(f".step{step:06d}.pt"):
                old.unlink(missing_ok=True)
    par.barrier()


_CHECKPOINT_KEYS = ("router", "opt", "gen", "step", "trajectory", "tokens")


def _read_checkpoint(checkpoint: str, par: Parallel, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The router checkpoint, or ``None`` when it cannot be read (truncated, corrupted, not a
    router checkpoint): reported by path and set aside (``router.pt.corrupt``) by rank 0."""
    from autocompress_nemo.utils.artifacts import set_aside

    try:
        st = torch.load(checkpoint, weights_only=False)
        missing = [k for k in _CHECKPOINT_KEYS if not isinstance(st, dict) or k not in st]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        return st
    except Exception as e:  # noqa: BLE001 - any unreadable file: start over, never crash on it
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        where = checkpoint
        if par.is_rank0 and os.path.exists(checkpoint):
            where = str(set_aside(checkpoint, "corrupt"))
        log(
            f"search: checkpoint {checkpoint} cannot be read ({type(e).__name__}: {why}); "
            f"set aside as {where}; starting from step 0"
        )
        return None


def _load_weights(checkpoint: str, par: Parallel, st: dict[str, Any]) -> dict[str, Any]:
    """The shared weights saved with router checkpoint ``st`` for this rank's shard."""
    if par.world == 1:
        if "weights" not in st:
            raise ValueError(
                f"search checkpoint {checkpoint} holds no shared weights but train_weights is on; "
                f"delete {checkpoint} to start over"
            )
        return st
    if st.get("weights_layout") != par.layout:
        raise ValueError(
            f"search checkpoint {checkpoint} was written with layout {st.get('weights_layout')}, this "
            f"run has {par.layout}: resume with the same cluster.tp/ep/pp and processes, or delete "
            f"{checkpoint} to start over"
        )
    path = _shard_file(checkpoint, par, int(st["step"]))
    if not path.is_file():
        raise FileNotFoundError(
            f"search checkpoint {checkpoint} (step {st['step']}) has no weight shard {path}; "
            f"delete {checkpoint} to start over"
        )
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - truncated / corrupted: name it and the fix, no traceback
        raise ValueError(
            f"search checkpoint shard {path} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); "
            f"delete {checkpoint} and its shards to start over"
        ) from None


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
    par = Parallel.detect()
    router_params = list(router.parameters())
    start, trajectory, tokens = 0, [], 0
    st = _read_checkpoint(checkpoint, par, log) if checkpoint and os.path.exists(checkpoint) else None
    if st is not None and not all(bool(torch.isfinite(v).all()) for v in st["router"].values()):
        log(f"search: checkpoint {checkpoint} holds non-finite router logits; starting from step 0")
        st = None
    if st is not None:
        try:
            router.load_state_dict(st["router"])
        except (RuntimeError, KeyError) as e:  # another search space: the pipeline's fingerprint prevents it
            raise ValueError(
                f"search checkpoint {checkpoint} holds a router of another search space ({str(e).splitlines()[0]}); "
                f"delete {checkpoint} to start over"
            ) from None
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        start, trajectory, tokens = st["step"], st["trajectory"], st["tokens"]
        if wopt is not None:
            w = _load_weights(checkpoint, par, st)
            model.load_state_dict(w["weights"], strict=False)
            wopt.load_state_dict(w["wopt"])
        log(f"search: resumed at step {start}")
    t0 = time.time()
    skipped = 0
    for step in range(start, cfg.steps):
        tau = temperature(step, cfg.steps, cfg.tau_start, cfg.tau_end)
        x = batch_at(step)
        rows = _local_rows(x, par)
        supernet.enabled = False
        with torch.no_grad():
            t_logits = forward(model, rows)
        supernet.enabled = True
        sample = router.sample(tau, gen)
        supernet.set_choice_weights(sample)
        s_logits = forward(model, rows)
        kd = kd_loss(s_logits, t_logits, cfg.kd_temperature)
        opt.zero_grad(set_to_none=True)
        if wopt is not None:
            wopt.zero_grad(set_to_none=True)
        kd.backward()
        _reduce_router_grads(router_params, par)
        if wopt is not None and par.world > 1:
            reduce_gradients(weight_params, par)
        probs = router.probs()
        exp = costs.expected(options, probs, parent)
        pen = sum(
            two_sided_penalty(exp[m], b, cfg.penalty_over, cfg.penalty_under, cfg.slack) for m, b in budgets.items()
        )
        if torch.is_tensor(pen) and pen.requires_grad:
            pen.backward()
        # A non-finite gradient (reduced: the same verdict on every rank) skips the update instead
        # of turning the router's logits into NaN, as a loss scaler skips an overflowing step.
        checked = router_params + (weight_params if wopt is not None else [])
        finite = torch.tensor([float(all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in checked))])
        if par.world > 1:  # expert weights differ per rank: every rank takes the same verdict
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        finite = bool(finite.item())
        if finite:
            opt.step()
            if wopt is not None:
                wopt.step()
        else:
            skipped += 1
            log(f"search step {step + 1}: non-finite router gradient, update skipped ({skipped} so far)")
        tokens += x.numel()
        row = {
            "step": step,
            "tau": tau,
            "kd": par.mean_over_dp(float(kd.detach())),
            "penalty": float(pen.detach()) if torch.is_tensor(pen) else float(pen),
            "entropy": router.entropy(),
            "skipped": not finite,
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
            st = {
                "router": router.state_dict(),
                "opt": opt.state_dict(),
                "gen": gen.get_state(),
                "step": step + 1,
                "trajectory": trajectory,
                "tokens": tokens,
            }
            weights = {"weights": model.state_dict(), "wopt": wopt.state_dict()} if wopt is not None else None
            _save_checkpoint(checkpoint, par, st, weights)
    supernet.remove()
    return SearchOutcome(
        choices=router.choices(),
        probs=[p.detach().tolist() for p in router.probs()],
        trajectory=trajectory,
        tokens=tokens,
        wall_s=time.time() - t0,
    )

"""Minitron++ baseline: a mode of the same code (``search=minitron_pp``), for every model family.

The paper's Minitron++ keeps uniform layer dimensions and retains all layers: that is the default
(width axis only). ``search.minitron_depth=true`` adds the depth axis below — an extension beyond
the paper's baseline (Minitron itself prunes depth too), labelled as such in the log and arch.json.

Same importance-sorted parent, same cost model and budgets, same supernet (``Supernet(...)``
dispatches to ``HybridSupernet`` for MoE / Mamba parents, as the router search does). Minitron
(Sreenivas et al. 2024; Nemotron-H's pruning of hybrids) prunes along two axes:

- **width**: one shape per decision kind for all blocks of that kind (``space.uniform_candidates``:
  attention heads / KV groups, mlp ffn, routed experts kept + expert ffn + top-k, shared-expert
  ffn, Mamba heads);
- **depth**: remove the ``k`` least important *removable units*. A unit is one block of a hybrid
  (``M``, ``*``, ``E``, ``-``) or one Llama layer (its attention *and* its mlp: Minitron removes
  whole layers); it is removable when every decision on it offers a removed option and choosing
  them removes all its blocks (so only what the engine can serve; for MoE both the routed part
  and the shared expert must be removable). Importance of a unit (Minitron's "drop in LM/KD loss
  when the block alone is removed"): on calibration batches ``x``,

      I(u) = mean_x KD(parent(x) || parent_without_u(x)),

  the KD loss (``distill.kd.kd_loss``: KL on softened logits, ``T^2``-scaled) of the parent with
  only ``u`` removed (through the supernet masks, which equal the extracted child exactly)
  against the parent. A unit whose removal leaves the logits unchanged scores 0. Tokens counted:
  one batch per unit per batch (the teacher's logits are computed once per batch and reused).

Candidates = uniform widths x depth. Costs never rise when a unit is removed, so for each uniform
width only the fewest removals that meet every budget is kept (found by bisection over ``k``, each
step an exact prediction); the same widths with more blocks removed are sub-networks that spend
less of the budget, dominated under Minitron++'s ranking. Feasibility is always checked exactly.
The feasible candidates are ranked by the normalized budget they spend, ``sum_m c_m / b_m``
(closest to the budget first), within each ``k``; the ``minitron_candidates`` scored are taken
round-robin over ``k`` ascending (fewest removals first), so width-only and depth-pruned shapes
both compete. Each gets an optional short distillation (``minitron_retrain_steps``, Minitron's
lightweight retraining), is scored by KD loss on calibration batches, and the best is returned.
Every token spent choosing is counted.

Dense parents: under the llama.cpp targets (``attention_needs_ffn``: no ffn removal) no Llama
layer is removable, so the depth axis is empty, no importance pass runs and the candidates,
their order and the token count are exactly the width-only ones of before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.distill.kd import kd_loss, kd_train
from autocompress_nemo.search.autocompress import CostFunctions, SearchOutcome
from autocompress_nemo.search.space import Decision, apply_choices, uniform_candidates
from autocompress_nemo.search.supernet import Supernet

RETRAIN_OFFSET, SCORE_OFFSET, IMPORTANCE_OFFSET = 0, 10_000_000, 20_000_000  # disjoint batch indices


@dataclass(frozen=True)
class Unit:
    """A removable unit: its blocks and, per decision on them, the option that removes it."""

    blocks: tuple[int, ...]
    removal: tuple[tuple[int, int], ...]
    """``(decision index, removed option index)`` pairs."""


@dataclass
class Candidate:
    spent: float
    """``sum_m c_m / b_m`` over the budgets (at most the number of budgets when feasible)."""
    removed: tuple[int, ...]
    """Block indices removed by the depth axis (empty: width only)."""
    choices: list[int]
    costs: dict[str, float]

    @property
    def k(self) -> int:
        return len(self.removed)


@dataclass
class MinitronOutcome(SearchOutcome):
    """``SearchOutcome`` plus the depth axis: units with their importance, least important first."""

    block_importance: list[dict[str, Any]] = field(default_factory=list)
    importance_tokens: int = 0
    depth: bool = False

    def record(self) -> dict[str, Any]:
        variant = (
            "width + depth (search.minitron_depth=true: beyond the paper's baseline, which keeps every layer)"
            if self.depth
            else "width only, every layer kept (the paper's Minitron++)"
        )
        return {
            "variant": variant,
            "block_importance": self.block_importance,
            "importance_tokens": self.importance_tokens,
            "importance_metric": "KD loss of the parent with the unit alone removed (0 = no effect)",
        }


def removable_units(parent: ArchSpec, decisions: list[Decision]) -> list[Unit]:
    """Units (hybrid blocks; Llama layers = attention + mlp) the space can remove entirely."""
    groups = (
        [(2 * i, 2 * i + 1) for i in range(parent.num_layers)]
        if parent.is_dense_layered()
        else [(i,) for i, b in enumerate(parent.blocks) if not b.removed]
    )
    full = [d.parent_option for d in decisions]
    units = []
    for blocks in groups:
        on = [i for i, d in enumerate(decisions) if d.block_index in blocks]
        if {decisions[i].block_index for i in on} != set(blocks):
            continue  # a block of the unit has no decision (its shape is fixed)
        removal = []
        for i in on:
            k = next((k for k, o in enumerate(decisions[i].options) if o.removed), None)
            if k is None:
                break
            removal.append((i, k))
        else:
            ch = list(full)
            for i, k in removal:
                ch[i] = k
            child = apply_choices(parent, decisions, ch)
            if all(child.blocks[b].removed for b in blocks):
                units.append(Unit(tuple(blocks), tuple(removal)))
    return units


def with_removed(choices: list[int], units: list[Unit]) -> list[int]:
    out = list(choices)
    for u in units:
        for i, k in u.removal:
            out[i] = k
    return out


def unit_importance(
    model: torch.nn.Module,
    parent: ArchSpec,
    decisions: list[Decision],
    units: list[Unit],
    batches: list[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
) -> tuple[list[float], int]:
    """``(I(u) per unit, tokens)``: the KD loss of the parent with ``u`` alone removed (module
    docstring), mean over ``batches``; masks through the supernet, removed afterwards."""
    sn = Supernet(model, parent, decisions)
    full = [d.parent_option for d in decisions]
    sums = [0.0] * len(units)
    tokens = 0
    try:
        with torch.no_grad():
            for x in batches:
                sn.enabled = False
                teacher = forward(model, x)
                sn.enabled = True
                for j, u in enumerate(units):
                    sn.set_choices(with_removed(full, [u]))
                    sums[j] += float(kd_loss(forward(model, x), teacher, temperature))
                    tokens += x.numel()
    finally:
        sn.remove()
    return [s / max(1, len(batches)) for s in sums], tokens


def _spent(c: dict[str, float], budgets: dict[str, float]) -> float | None:
    """``sum_m c_m / b_m`` if every budget is met, else ``None``."""
    if all(c[m] <= b for m, b in budgets.items()):
        return sum(c[m] / b for m, b in budgets.items())
    return None


def feasible_uniform(
    parent: ArchSpec,
    decisions: list[Decision],
    costs: CostFunctions,
    budgets: dict[str, float],
    removal_order: list[Unit] | None = None,
) -> list[Candidate]:
    """Every feasible candidate: per uniform width, the fewest units of ``removal_order`` (least
    important first) whose removal meets every budget (module docstring); sorted by ``k``, then
    most budget-spending first."""
    order = list(removal_order or [])
    out: dict[tuple[int, ...], Candidate] = {}

    def at(width: list[int], k: int) -> Candidate | None:
        ch = with_removed(width, order[:k])
        c = costs.predict(apply_choices(parent, decisions, ch))
        s = _spent(c, budgets)
        if s is None:
            return None
        return Candidate(s, tuple(b for u in order[:k] for b in u.blocks), ch, c)

    for width in uniform_candidates(parent, decisions):
        best = at(width, 0)
        if best is None and order:
            best = at(width, len(order))
            lo, hi = 0, len(order)  # infeasible at lo, feasible at hi: bisect for the fewest removals
            while best is not None and hi - lo > 1:
                mid = (lo + hi) // 2
                c = at(width, mid)
                if c is None:
                    lo = mid
                else:
                    hi, best = mid, c
        if best is not None and tuple(best.choices) not in out:
            out[tuple(best.choices)] = best
    return sorted(out.values(), key=lambda c: (c.k, -c.spent, c.choices))


def select_candidates(feasible: list[Candidate], n: int) -> list[Candidate]:
    """``n`` candidates round-robin over ``k`` ascending, each ``k``'s most budget-spending first."""
    by_k: dict[int, list[Candidate]] = {}
    for c in feasible:
        by_k.setdefault(c.k, []).append(c)
    queues = [by_k[k] for k in sorted(by_k)]
    out: list[Candidate] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
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
    checkpoint: str | None = None,
) -> MinitronOutcome:
    """``fresh_model()`` builds another copy of the sorted parent (needed when candidates are
    retrained: Megatron models hold process groups and cannot be deep-copied). ``checkpoint``: a
    JSON file of the candidates scored so far (written after each one by rank 0); a rerun resumes
    after the last one scored (the pipeline keeps it in the stage's fingerprinted checkpoint
    directory, so it never holds the scores of other inputs)."""
    t0 = time.time()
    n_score = int(cfg.minitron_score_batches)
    depth = bool(getattr(cfg, "minitron_depth", False))
    units = removable_units(parent, decisions) if depth else []
    order, importance, imp_tokens = _depth_order(model, parent, decisions, units, batch_at, forward, cfg, log)
    tokens = imp_tokens
    feas = feasible_uniform(parent, decisions, costs, budgets, order)
    if not feas:
        raise _none_feasible(depth, len(order))
    top = select_candidates(feas, max(1, int(cfg.minitron_candidates)))
    ks = sorted({c.k for c in feas})
    log(f"minitron++: {len(feas)} feasible uniform candidates (blocks removed: {ks}); scoring {len(top)}")
    retrain = int(getattr(cfg, "minitron_retrain_steps", 0))
    if retrain and fresh_model is None:
        raise ValueError("minitron_retrain_steps > 0 needs fresh_model() to copy the sorted parent")
    trajectory: list[dict[str, Any]] = _scored(checkpoint, top, log)
    tokens += sum(int(r.get("tokens", 0)) for r in trajectory)
    resumed, t_cands = len(trajectory), time.time()
    log(
        f"minitron++: scoring {len(top) - resumed} candidates, each {retrain} retraining steps and "
        f"{n_score} scoring batches"
    )
    for ci, cand in enumerate(top):
        if ci < resumed:
            continue  # scored before the stage was interrupted
        cand_model = fresh_model() if retrain and fresh_model is not None else model
        what = f"[minitron++ candidate {ci + 1}/{len(top)}]"
        score, used = _score(model, cand_model, parent, decisions, cand.choices, batch_at, forward, cfg, what, log)
        tokens += used
        arch = apply_choices(parent, decisions, cand.choices)
        left = (time.time() - t_cands) / max(ci + 1 - resumed, 1) * (len(top) - ci - 1)
        log(
            f"minitron++ candidate {ci + 1}/{len(top)}: kd={score:.4f} spent={cand.spent:.3f} "
            f"removed={list(cand.removed)} {uniform_shape(arch)} "
            f"({len(top) - ci - 1} candidates left, ~{left:.0f} s)"
        )
        row = {"candidate": ci, "kd": score, "spent": cand.spent, "choices": cand.choices}
        row.update(removed_blocks=list(cand.removed), **{f"predicted_{m}": v for m, v in cand.costs.items()})
        trajectory.append({**row, "tokens": used})
        if checkpoint:
            _save_scored(checkpoint, trajectory)
    best = min(trajectory, key=lambda r: float(r["kd"]))  # the first of equal scores, as scored
    choices = list(best["choices"])
    return MinitronOutcome(
        choices=choices,
        probs=[[1.0 if k == choices[i] else 0.0 for k in range(len(d.options))] for i, d in enumerate(decisions)],
        trajectory=trajectory,
        tokens=tokens,
        wall_s=time.time() - t0,
        block_importance=importance,
        importance_tokens=imp_tokens,
        depth=depth,
    )


def _none_feasible(depth: bool, removable: int) -> ValueError:
    how = (
        f"with the 0..{removable} least important removable blocks removed"
        if depth
        else "every block kept, as the paper's baseline; search.minitron_depth=true also lets it remove the "
        "least important blocks"
    )
    return ValueError(
        f"Minitron++: no uniform architecture (one shape per block kind for all blocks, {how}) meets the "
        "budget; the heterogeneous search space may still reach it"
    )


def _depth_order(
    model: torch.nn.Module,
    parent: ArchSpec,
    decisions: list[Decision],
    units: list[Unit],
    batch_at: Callable[[int], torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: Any,
    log: Callable[[str], None],
) -> tuple[list[Unit], list[dict[str, Any]], int]:
    """The removable ``units`` least important first (KD loss with the unit alone removed): (order,
    its record, tokens spent). Nothing to order without units (the depth axis off)."""
    if not units:
        return [], [], 0
    batches = [batch_at(IMPORTANCE_OFFSET + s) for s in range(int(cfg.minitron_score_batches))]
    scores, used = unit_importance(model, parent, decisions, units, batches, forward, float(cfg.kd_temperature))
    ranked = sorted(zip(scores, units, strict=True), key=lambda t: (t[0], t[1].blocks))
    importance = [
        {"blocks": list(u.blocks), "kinds": [parent.blocks[b].kind for b in u.blocks], "kd_when_removed": round(s, 6)}
        for s, u in ranked
    ]
    log(
        "minitron++ depth axis: importance (KD loss with the block alone removed), least important first: "
        + ", ".join(f"{'+'.join(str(b) for b in u.blocks)}:{s:.4g}" for s, u in ranked)
        + f" ({used} tokens)"
    )
    return [u for _, u in ranked], importance, used


def _score(
    model: torch.nn.Module,
    cand_model: torch.nn.Module,
    parent: ArchSpec,
    decisions: list[Decision],
    choices: list[int],
    batch_at: Callable[[int], torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: Any,
    what: str,
    log: Callable[[str], None],
) -> tuple[float, int]:
    """One candidate's KD to the parent (``model`` with the supernet off) on the scoring batches,
    after ``minitron_retrain_steps`` of KD retraining of ``cand_model`` when set: (score, tokens)."""
    retrain, n_score = int(getattr(cfg, "minitron_retrain_steps", 0)), int(cfg.minitron_score_batches)
    temperature = float(cfg.kd_temperature)
    tokens = 0
    sn = Supernet(cand_model, parent, decisions)
    sn.set_choices(choices)

    def teacher(x: torch.Tensor) -> torch.Tensor:  # the parent: the same model with the supernet off
        sn.enabled = False
        try:
            return forward(model, x)
        finally:
            sn.enabled = True

    if retrain:
        for p in cand_model.parameters():
            p.requires_grad_(True)
        batches = [batch_at(RETRAIN_OFFSET + s) for s in range(retrain)]
        kd_train(
            cand_model,
            teacher,
            lambda x: forward(cand_model, x),
            steps_logged(batches, retrain, f"{what} retraining step", log),
            lr=cfg.weight_lr,
            temperature=temperature,
        )
        tokens += sum(x.numel() for x in batches)
    losses = []
    with torch.no_grad():
        for s in steps_logged(range(n_score), n_score, f"{what} scoring batch", log):
            x = batch_at(SCORE_OFFSET + s)  # calibration batches disjoint from the retraining ones
            t = teacher(x)
            losses.append(float(kd_loss(forward(cand_model, x), t, temperature)))
            tokens += x.numel()
    sn.remove()
    return sum(losses) / len(losses), tokens


def steps_logged(items: Iterable[Any], total: int, what: str, log: Callable[[str], None]) -> Iterator[Any]:
    """``items``, with ``{what} i/total`` and the time left logged after every ``total // 4``-th item
    (and the last): the count never passes ``total`` (items past it are yielded without a line)."""
    t0, every = time.time(), max(1, total // 4)
    for i, x in enumerate(items):
        yield x
        n = i + 1
        if n <= total and (n % every == 0 or n == total):
            el = time.time() - t0
            log(f"{what} {n}/{total} ({el:.0f} s, ~{el / n * (total - n):.0f} s left)")


def _scored(checkpoint: str | None, top: list[Candidate], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The candidates scored by an earlier, interrupted run (a prefix of ``top``), from ``checkpoint``.
    A file that cannot be read, or whose candidates are not this run's, is set aside and named.
    Every rank reads it before any rank goes on (rank 0 writes the next candidate's score)."""
    import json
    from pathlib import Path

    from autocompress_nemo.distill.optim import Parallel
    from autocompress_nemo.utils.artifacts import set_aside

    par = Parallel.detect()
    rows: list[dict[str, Any]] = []
    if checkpoint and Path(checkpoint).exists():
        try:
            rows = json.loads(Path(checkpoint).read_text())["scored"]
            for ci, r in enumerate(rows):
                if ci >= len(top) or list(r["choices"]) != list(top[ci].choices) or not isinstance(r["kd"], float):
                    raise ValueError(f"candidate {ci + 1} is not this run's candidate {ci + 1}")
        except Exception as e:  # noqa: BLE001 - a damaged file: score again, never crash on it
            rows = []
            where = set_aside(checkpoint, "corrupt") if par.is_rank0 and Path(checkpoint).exists() else checkpoint
            log(f"minitron++: checkpoint {checkpoint} cannot be used ({type(e).__name__}: {e}); set aside as {where}")
    par.barrier()
    if rows:
        log(f"minitron++: resumed with {len(rows)}/{len(top)} candidates scored ({checkpoint})")
    return rows


def _save_scored(checkpoint: str, trajectory: list[dict[str, Any]]) -> None:
    from autocompress_nemo.distill.optim import Parallel
    from autocompress_nemo.utils.artifacts import write_json_atomic

    if Parallel.detect().is_rank0:
        write_json_atomic(checkpoint, {"scored": trajectory})


def uniform_shape(spec: ArchSpec) -> str:
    """The shapes of a (uniform) child per block kind, and its removed blocks, in one line."""
    shapes: dict[str, list[str]] = {}
    for b in spec.blocks:
        if not b.removed and (s := kind_of(b).fields(b)) not in shapes.setdefault(b.kind, []):
            shapes[b.kind].append(s)
    removed = [i for i, b in enumerate(spec.blocks) if b.removed]
    return "; ".join(f"{k}: {' | '.join(v)}" for k, v in shapes.items()) + (
        f"; removed blocks {removed}" if removed else ""
    )

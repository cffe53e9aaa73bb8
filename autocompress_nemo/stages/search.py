"""search_<method>: the architecture (``SearchDir.arch``) chosen by the router (AutoCompress) or the
Minitron++ enumeration under the budgets, settled by repair / grow / quality guard (judged by the KD
loss of the supernet child) and checked in the target's engine before any weights are sliced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.counts import forward_flops_per_token, param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import describe
from autocompress_nemo.context import Context, load_weights, read_json
from autocompress_nemo.search.autocompress import (
    ParentMeetsBudget,
    SearchOutcome,
    check_budget_reachable,
    run_router_search,
)
from autocompress_nemo.search.family import family_record, family_steps, load_supernet, save_supernet
from autocompress_nemo.search.minitron import run_minitron_pp
from autocompress_nemo.search.space import apply_choices, build_space
from autocompress_nemo.stages.common import (
    METHODS,
    budgets,
    budgets_measured,
    judge_batches,
    load_table,
    measured_metrics,
    method_object,
    refit_batches,
    search_capabilities,
)
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Inputs, Stage, reads
from autocompress_nemo.stages.layout import ProfileDir, RankDir, SearchDir, ValidateDir
from autocompress_nemo.utils.artifacts import write_json_atomic


def run(
    ctx: Context,
    out: Path,
    method: str,
    rank: RankDir,
    profile: ProfileDir,
    validation: ValidateDir | None,
    ckpt_dir: Path,
    supernet: SearchDir | None = None,
) -> None:
    """Choose the architecture (``arch.json``) with the router or the Minitron++ enumeration.
    ``supernet``: the first budget's search of a family (``search/family.py``), whose trained
    supernet this budget's router trains on, frozen."""
    from autocompress_nemo.extract.repair import option_importance
    from autocompress_nemo.rank.importance import Importance

    spec, sd = load_weights(rank.dir)
    imp = Importance.from_dict(read_json(rank.sorted_scores))

    def importance(ds: list) -> list[list[float]]:
        return option_importance(ds, imp)

    search_core(
        ctx,
        out,
        method,
        spec,
        sd,
        importance,
        profile.table,
        validation,
        ckpt_dir,
        describe=describe,
        supernet=supernet.dir if supernet is not None else None,
    )


class _Costs:
    """The predictor restricted to the budget's metrics (the router's differentiable face)."""

    def __init__(self, predictor: Any, metrics: tuple[str, ...]):
        self.p, self.metrics = predictor, metrics

    def predict(self, spec: ArchSpec) -> dict[str, float]:
        return self.p.predict(spec)

    def expected(self, options: list, probs: list, spec: ArchSpec) -> dict[str, torch.Tensor]:
        return self.p.expected(options, probs, spec, metrics=self.metrics)


def search_core(
    ctx: Context,
    out: Path,
    method: str,
    spec: ArchSpec,
    sd: dict[str, torch.Tensor],
    option_importance: Any,
    table_path: Path,
    validation: ValidateDir | None,
    ckpt_dir: Path,
    describe: Any,
    supernet: Path | None = None,
) -> None:
    """The search of every model family: budgets, space, router or Minitron++, repair/grow, ``arch.json``.

    ``option_importance(decisions)`` gives the importance kept by every option (for repair/grow);
    ``describe(spec)`` a one-line shape for the log. ``supernet``: the first budget's search artifact
    of a family (``search.budgets``); this budget's router then trains on its supernet, frozen, for
    ``search.family_steps`` steps."""
    from autocompress_nemo.costs.predictor import Predictor
    from autocompress_nemo.extract.archjson import arch_record

    cfg, s = ctx.cfg, ctx.cfg.search
    meth = method_object(method)
    predictor = Predictor(load_table(ctx, table_path), cfg.target)
    budget, how = budgets(ctx, predictor, spec, validation)
    costs = _Costs(predictor, tuple(budget))
    decisions = build_space(spec, search_capabilities(cfg), int(s.ffn_options))
    ctx.say(
        f"[search:{method}] {describe(spec)}: budgets {budget} (relative ones against the {how} parent); "
        f"{len(decisions)} decisions ({', '.join(sorted({d.kind for d in decisions}))}), "
        f"{sum(len(d.options) for d in decisions)} options"
    )
    if check_budget_reachable(spec, decisions, costs, budget) == "parent":
        # distilling the parent into itself would only copy it: stop (docs/errors.md)
        pc = costs.predict(spec)
        raise ParentMeetsBudget(
            f"the parent {describe(spec)} already meets every budget ("
            + ", ".join(f"{m} {pc[m]:.4g} <= {b:.4g}" for m, b in budget.items())
            + "); tighten target.budget (e.g. target.budget.constraints.0.value=0.6x) for a smaller student"
        )
    family = bool(list(s.get("budgets") or []))
    outcome, model, steps, read = _explore(ctx, out, meth, spec, sd, decisions, costs, budget, ckpt_dir, supernet)
    final, settler, verified = settle_choices(
        ctx, out, method, spec, decisions, outcome, costs, budget, lambda: option_importance(decisions), model
    )
    child = apply_choices(spec, decisions, final).replace(name=f"{spec.name}-{method}")
    pred = predictor.predict(child)
    chosen = (decisions, outcome.probs, outcome.choices, final)
    cost = (pred, predictor.predict(spec), budget, outcome.tokens)
    rec = arch_record(
        method, spec, child, *chosen, *cost, settler.repair_steps, settler.grow_steps, predictor.table.label
    )
    rec.update(budget_reference=how, params=param_count(child), search_wall_s=round(outcome.wall_s, 2))
    rec.update(_how_it_was_chosen(meth, outcome, settler, verified, steps))
    if family:
        rec["family"] = family_record(s, method, supernet is None, outcome, read, steps)
    art = SearchDir(out)
    write_json_atomic(art.arch, rec)
    write_json_atomic(art.trajectory, outcome.trajectory)
    _plot_trajectory(outcome.trajectory, art.trajectory_plot, method)
    ctx.say(
        f"[search:{method}] chose {describe(child)} params {param_count(child):,} predicted "
        + ", ".join(f"{m}={pred[m]:.4g}/{b:.4g}" for m, b in budget.items())
    )


def _explore(
    ctx: Context,
    out: Path,
    meth: Any,
    spec: ArchSpec,
    sd: dict[str, torch.Tensor],
    decisions: list,
    costs: Any,
    budget: dict[str, float],
    ckpt_dir: Path,
    supernet: Path | None,
) -> tuple[Any, torch.nn.Module, int, dict[str, Any]]:
    """The method's own search over ``decisions``: the router's steps (on the first budget's frozen
    supernet for a later member of a family) or Minitron++'s candidates. Returns the outcome, the
    model whose weights settle judges with (the sorted parent's), the router steps planned and what
    was read of a supernet."""
    s = ctx.cfg.search
    family = bool(list(s.get("budgets") or []))
    read: dict[str, Any]
    steps, read, start_sd = int(s.steps), {}, sd
    if family and supernet is not None and meth.shares_supernet:
        trained, read = load_supernet(supernet)
        start_sd = trained if trained is not None else sd
        steps, s = family_steps(s), frozen_router_settings(s, family_steps(s))
        ctx.say(f"[search:{meth.name}] supernet of the first budget: {read['supernet_from']}; {steps} router steps")
    model = ctx.model(spec, start_sd)
    seq, bs = int(s.seq_len), int(s.batch_size)

    def batch_at(step: int) -> torch.Tensor:
        return ctx.batch_at("train", step, bs, seq, seed_offset=17)

    shared = (model, spec, decisions, costs, budget, batch_at, ctx.forward, s)
    if not meth.router:
        outcome: SearchOutcome = run_minitron_pp(
            *shared, log=ctx.say, fresh_model=lambda: ctx.model(spec, sd), checkpoint=str(ckpt_dir / "candidates.json")
        )
        return outcome, model, steps, read
    # per token: the unmasked (teacher) forward, the masked forward and its backward to the router
    # logits (input gradients only, ~1 forward; with the shared weights trained, ~2)
    flops = (4.0 if bool(s.train_weights) else 3.0) * forward_flops_per_token(spec, seq)
    outcome = run_router_search(
        *shared,
        seed=int(ctx.cfg.seed),
        checkpoint=ckpt_dir,
        log=ctx.say,
        router_init=str(s.router_init),
        flops_per_token=flops,
    )
    if family and supernet is None and bool(s.train_weights):  # the first budget: keep the trained supernet
        save_supernet(ctx, spec, model, out)
    if bool(s.train_weights) or start_sd is not sd:
        # settle judges the child extract slices (from the sorted parent, not these weights) against the
        # parent: extract refuses a sliced student whose KD differs from the judged one
        from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron

        hf_to_megatron(spec, sd, model)
    return outcome, model, steps, read


def _how_it_was_chosen(meth: Any, outcome: Any, settler: Any, verified: Any, steps: int) -> dict[str, Any]:
    """``arch.json``'s account of the choice: router steps run, engine checks, quality guards, the
    judge's calls and tokens, Minitron++'s depth axis."""
    rec: dict[str, Any] = {}
    if meth.router:
        rec["router_steps"] = {"done": len(outcome.trajectory), "planned": steps, "stopped": outcome.stopped}
    if verified:
        rec["verified_in_engine"] = verified
    if settler.guards:
        rec["quality_guard"] = settler.guards[-1]
        rec["quality_guards"] = settler.guards
    rec["judge"] = {
        "kind": settler.judge.label,
        "refit": getattr(settler.judge, "refit", None) is not None,
        "calls": int(getattr(settler.judge, "calls", 0)),
        "tokens": int(getattr(settler.judge, "tokens", 0)),
    }
    if hasattr(outcome, "record"):  # Minitron++'s depth axis (search/minitron.py)
        rec["minitron"] = outcome.record()
    return rec


def frozen_router_settings(s: Any, steps: int) -> Any:
    """The search settings of a family's extra budget: ``steps`` router steps, supernet weights frozen."""
    from omegaconf import OmegaConf

    out = OmegaConf.create(OmegaConf.to_container(s, resolve=True))  # the stage's view is read-only
    out.steps, out.train_weights = int(steps), False
    return out


def _plot_trajectory(traj: list[dict], path: Path, method: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not traj or "step" not in traj[0]:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(range(len(traj)), [r.get("kd", 0.0) for r in traj])
        ax.set_title(f"{METHODS.get(method, method)}: KD loss per scored candidate")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return
    steps = [r["step"] for r in traj]
    metrics = [k[len("expected_") :] for k in traj[0] if k.startswith("expected_")]
    fig, axes = plt.subplots(1, 2 + len(metrics), figsize=(4 * (2 + len(metrics)), 3))
    axes[0].plot(steps, [r["kd"] for r in traj])
    axes[0].set_title("KD loss")
    axes[1].plot(steps, [r["entropy"] for r in traj])
    axes[1].set_title("choice entropy")
    for ax, m in zip(axes[2:], metrics, strict=True):
        ax.plot(steps, [r[f"expected_{m}"] for r in traj], label="expected (predicted)")
        ax.axhline(traj[0][f"budget_{m}"], color="r", ls="--", label="budget")
        ax.set_title(m)
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(f"{METHODS.get(method, method)} search trajectory (costs estimated by the cost table)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def settle_choices(
    ctx: Context,
    out: Path,
    method: str,
    spec: ArchSpec,
    decisions: list,
    outcome: Any,
    costs: Any,
    budget: dict[str, float],
    importance: Any,
    model: torch.nn.Module | None,
) -> tuple[list[int], Any, list[dict[str, Any]]]:
    """Repair / grow / quality guard of the search's choice, judged by ``search.judge`` (the KD
    loss of the supernet child by default), then the engine check (``verify_measured``)."""
    from autocompress_nemo.search.judge import ProxyJudge, make_judge
    from autocompress_nemo.search.settle import Settler

    s = ctx.cfg.search
    if model is None:  # the parent already meets the budget: nothing to judge but the proxy
        judge: Any = ProxyJudge(importance())
    else:
        judge = make_judge(
            str(s.judge),
            importance=importance,
            model=lambda: model,
            parent=spec,
            decisions=decisions,
            batches=lambda: judge_batches(ctx),
            forward=ctx.forward,
            temperature=float(s.kd_temperature),
            refit=judge_refit(ctx, spec, decisions),
        )
    traj = [r for r in getattr(outcome, "trajectory", []) if "step" in r]
    meth = method_object(method)
    tail = traj[-max(1, len(traj) // 10) :] if meth.router and traj else []
    settler = Settler(
        spec,
        decisions,
        costs.predict,
        judge,
        grow_threshold=float(s.grow_threshold) if meth.settle_grows and model is not None else None,
        guard_factor=float(s.guard_factor),
        uniform_pool=int(s.get("guard_uniform", 32)),
        uniform_alternative=meth.guard_uniform_alternative,
        router_kd=(sum(float(r["kd"]) for r in tail) / len(tail)) if tail else None,
        origin=list(outcome.choices) if tail else None,
        log=ctx.say,
    )
    try:
        final = settler(list(outcome.choices), budget, guard=model is not None)
        final, verified = verify_measured(ctx, out, spec, decisions, final, costs, budget, settler)
    finally:
        if hasattr(judge, "close"):
            judge.close()
    return final, settler, verified


def judge_refit(ctx: Context, spec: ArchSpec, decisions: list) -> Any:
    """The KD judge's re-fit correction (``search.judge_refit``): children judged with their narrowed
    output projections re-fit on extract's own calibration batches and ridge, as extract will start
    them (``search.judge.RefitCorrection``); None when off or when extract keeps the plain slice."""
    if not bool(ctx.cfg.search.get("judge_refit", False)) or str(ctx.cfg.extract.refit) == "none":
        return None
    from autocompress_nemo.search.judge import RefitCorrection

    batches, ridge = refit_batches(ctx), float(ctx.cfg.extract.ridge)
    return lambda model: RefitCorrection(model, spec, decisions, batches, ctx.forward, ridge)


def verify_measured(
    ctx: Context,
    out: Path,
    parent: ArchSpec,
    decisions: list,
    choices: list[int],
    costs: Any,
    budget: dict[str, float],
    settle: Any,
    engine: Any = None,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The engine check before any weights are sliced (``search/settle.verify_measured``) in the
    target's engine (or ``engine``): measured engines only (an analytic one has nothing to add);
    timing runs on rank 0 and its result is broadcast, so every rank makes the same choices."""
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.pipeline import is_rank0, rank0s
    from autocompress_nemo.search.settle import verify_measured as verify

    rounds = int(ctx.cfg.search.verify_rounds)
    engine = engine if engine is not None else get_engine(ctx.cfg.target, workdir=out / "verify_engine")
    if rounds <= 0 or engine.estimated:
        return choices, []
    wl = Workload.from_config(ctx.cfg.target.workload)

    def measure(child: ArchSpec) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
        """The child timed next to the parent in the same rounds: its metrics and the budgets in the
        units of this very measurement (relative ones against the parent measured with it)."""
        out: list[Any] = [None]
        if is_rank0():
            m = engine.measure_many([child], wl, reference=parent.replace(name="parent"))[0]
            b_now, ref = budgets_measured(ctx, m, wl, parent, budget)
            info = {k: getattr(m, k) for k in ("ratio", "ratio_spread") if getattr(m, k, None)}
            if getattr(m, "reference", None):
                from autocompress_nemo.costs.engines.paired import all_flags

                info["flags"] = all_flags([m])
                for f in info["flags"]:
                    ctx.say(f"[search:verify] flagged: {f}")
            if ref is not None:
                info.update(
                    parent_measured={k: ref[k] for k in budget},
                    reference={k: v for k, v in m.reference.items() if k not in ("memory", "flags")},
                )
            out = [(measured_metrics(m, wl, child), b_now, info)]
        return rank0s(out[0])

    try:
        return verify(
            parent,
            decisions,
            choices,
            costs.predict,
            budget,
            settle,
            measure,
            rounds,
            grow_threshold=getattr(settle, "grow_threshold", None),
            engine_name=str(engine.name),
            log=ctx.say,
        )
    finally:
        import shutil

        shutil.rmtree(out / "verify_engine", ignore_errors=True)


def _entry(ctx: Context, out: Path, inp: Inputs) -> None:
    validation, first = inp.get("validate"), inp.get("search@first")
    assert inp.method is not None and inp.checkpoint is not None
    run(
        ctx,
        out,
        inp.method,
        RankDir(inp["rank"]),
        ProfileDir(inp["profile"]),
        ValidateDir(validation) if validation else None,
        inp.checkpoint,
        SearchDir(first) if first else None,
    )


STAGE = Stage(
    "search",
    reads=reads(PARENT, LAYOUT, DATA, "target", "search", "extract"),
    needs=("rank", "profile"),
    optional=("validate",),
    per_method=True,
    distributed=True,
    resumable=True,
    entry=_entry,
)

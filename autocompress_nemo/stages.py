"""The stages of one run as functions ``stage(ctx, out_dir, ...)`` writing into an artifact directory.

``search/__main__.py`` calls them in order through ``pipeline.Run.stage`` (skip when
complete, atomic artifacts, manifests). Heavy lifting lives in the stage subpackages;
this module only loads inputs, calls them and saves outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo import stages_hybrid
from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.context import Context, load_weights, read_json, save_weights
from autocompress_nemo.utils.artifacts import write_json_atomic

METHODS = {"autocompress": "AutoCompress", "minitron_pp": "Minitron++"}


def search_capabilities(cfg: Any) -> dict[str, Any]:
    """The target engine's capabilities, with what this run's own layout needs on top: under
    expert parallelism (``cluster.ep``) every student keeps a multiple of EP routed experts per
    MoE block (``expert_align = lcm(engine's, ep)``), so search, extraction and recovery
    distillation can shard it the way they shard the parent."""
    import math

    from omegaconf import OmegaConf

    caps = cfg.target.engine.capabilities
    out = dict(OmegaConf.to_container(caps, resolve=True) if OmegaConf.is_config(caps) else (caps or {}))
    ep = int(OmegaConf.select(cfg, "cluster.ep", default=1) or 1)
    if ep > 1:
        out["expert_align"] = math.lcm(int(out.get("expert_align") or 1), ep)
    return out


# -- rank -------------------------------------------------------------------------------------------
def rank(ctx: Context, out: Path) -> None:
    """Importance from a calibration pass, the permutations, and the sorted parent."""
    from autocompress_nemo.rank.importance import collect_importance
    from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores

    spec, sd, _ = ctx.parent
    if not spec.is_dense_layered():  # MoE / Mamba hybrids
        return stages_hybrid.rank(ctx, out)
    s = ctx.cfg.search
    model = ctx.model(spec, sd)
    n_batches = max(1, int(s.calib_sequences) // int(s.batch_size))
    batches = [ctx.batch_at("calib", i, int(s.batch_size), int(s.seq_len)) for i in range(n_batches)]
    imp = collect_importance(model, spec, batches, ctx.forward, bool(ctx.cfg.cluster.sequence_parallel))
    perms = permutations_from_scores(spec, imp, sort_hidden=bool(s.search_hidden))
    write_json_atomic(out / "scores.json", imp.to_dict())
    write_json_atomic(out / "permutations.json", perms.to_dict())
    save_weights(out, spec, apply_permutations(spec, sd, perms))
    ctx.say(
        f"[rank] {imp.tokens} calibration tokens; block importance "
        + " ".join(f"{s.attn_block:.2f}/{s.mlp_block:.2f}" for s in imp.layers[:6])
        + " ..."
    )


def sorted_parent(rank_dir: Path) -> tuple[ArchSpec, dict[str, torch.Tensor], Any, Any]:
    """(spec, sorted state dict, Importance, Permutations) from the rank artifact."""
    from autocompress_nemo.rank.importance import Importance
    from autocompress_nemo.rank.reorder import Permutations

    spec, sd = load_weights(rank_dir)
    return (
        spec,
        sd,
        Importance.from_dict(read_json(rank_dir / "scores.json")),
        Permutations.from_dict(read_json(rank_dir / "permutations.json")),
    )


# -- budgets ------------------------------------------------------------------------------------------
def parent_reference(
    ctx: Context, validation_dir: Path | None, predicted: dict[str, Any]
) -> tuple[dict[str, float], str]:
    """The parent's costs that relative budgets refer to: measured in the engine when the
    validate stage measured it, else predicted (and said so)."""
    if validation_dir is not None and (validation_dir / "validation.json").is_file():
        v = read_json(validation_dir / "validation.json")
        for row in v.get("rows", []):
            if row.get("name") == "parent":
                ref = {
                    k[5:]: float(x) for k, x in row.items() if k.startswith("meas_") and not k.startswith("meas_mem_")
                }
                ref["params"] = float(predicted["params"])
                return ref, "measured"
    return {k: float(v) for k, v in predicted.items() if isinstance(v, (int, float))}, "predicted"


def budgets(
    ctx: Context, predictor: Any, parent: ArchSpec, validation_dir: Path | None
) -> tuple[dict[str, float], str]:
    from autocompress_nemo.costs.predictor import resolve_budget

    ref, how = parent_reference(ctx, validation_dir, predictor.predict(parent))
    return resolve_budget(ctx.cfg.target.budget, ref, int(ctx.cfg.target.workload.batch)), how


class _Costs:
    """The predictor restricted to the budget's metrics (the router's differentiable face)."""

    def __init__(self, predictor: Any, metrics: tuple[str, ...]):
        self.p, self.metrics = predictor, metrics

    def predict(self, spec: ArchSpec) -> dict[str, float]:
        return self.p.predict(spec)

    def expected(self, options: list, probs: list, spec: ArchSpec) -> dict[str, torch.Tensor]:
        return self.p.expected(options, probs, spec, metrics=self.metrics)


# -- search + extract ----------------------------------------------------------------------------------
def search(
    ctx: Context, out: Path, method: str, rank_dir: Path, table_path: Path, validation_dir: Path | None, ckpt_dir: Path
) -> None:
    """Choose the architecture (``arch.json``) with the router or the Minitron++ enumeration."""
    from autocompress_nemo.extract.repair import option_importance
    from autocompress_nemo.rank.reorder import sorted_importance

    if not ctx.parent[0].is_dense_layered():  # MoE / Mamba hybrids: their importance per option
        return stages_hybrid.search(ctx, out, method, rank_dir, table_path, validation_dir, ckpt_dir)
    spec, sd, imp, perms = sorted_parent(rank_dir)
    search_core(
        ctx,
        out,
        method,
        spec,
        sd,
        lambda ds: option_importance(ds, sorted_importance(imp, perms)),
        table_path,
        validation_dir,
        ckpt_dir,
        describe=lambda a: a.pattern,
    )


def search_core(
    ctx: Context,
    out: Path,
    method: str,
    spec: ArchSpec,
    sd: dict[str, torch.Tensor],
    option_importance: Any,
    table_path: Path,
    validation_dir: Path | None,
    ckpt_dir: Path,
    describe: Any,
) -> None:
    """The search of every model family: budgets, space, router or Minitron++, repair/grow, ``arch.json``.

    ``option_importance(decisions)`` gives the importance kept by every option (for repair/grow);
    ``describe(spec)`` a one-line shape for the log."""
    from autocompress_nemo.costs.predictor import Predictor
    from autocompress_nemo.extract.archjson import arch_record
    from autocompress_nemo.profile.stage import load_table
    from autocompress_nemo.search.autocompress import SearchOutcome, check_budget_reachable, run_router_search
    from autocompress_nemo.search.minitron import run_minitron_pp
    from autocompress_nemo.search.space import apply_choices, build_space

    cfg, s = ctx.cfg, ctx.cfg.search
    predictor = Predictor(load_table(cfg, table_path), cfg.target)
    budget, how = budgets(ctx, predictor, spec, validation_dir)
    costs = _Costs(predictor, tuple(budget))
    decisions = build_space(spec, search_capabilities(cfg), int(s.ffn_options))
    ctx.say(
        f"[search:{method}] {describe(spec)}: budgets {budget} (relative ones against the {how} parent); "
        f"{len(decisions)} decisions ({', '.join(sorted({d.kind for d in decisions}))}), "
        f"{sum(len(d.options) for d in decisions)} options"
    )
    verdict = check_budget_reachable(spec, decisions, costs, budget)
    model: torch.nn.Module | None = None
    if verdict == "parent":
        ctx.say(f"[search:{method}] the parent already meets every budget: returning the parent")
        outcome = SearchOutcome(
            [d.parent_option for d in decisions],
            [[float(k == d.parent_option) for k in range(len(d.options))] for d in decisions],
        )
    else:
        model = ctx.model(spec, sd)
        seq, bs = int(s.seq_len), int(s.batch_size)

        def batch_at(step: int) -> torch.Tensor:
            return ctx.batch_at("train", step, bs, seq, seed_offset=17)

        if method == "autocompress":
            outcome = run_router_search(
                model,
                spec,
                decisions,
                costs,
                budget,
                batch_at,
                ctx.forward,
                s,
                seed=int(cfg.seed),
                checkpoint=str(ckpt_dir / "router.pt"),
                log=ctx.say,
                router_init=str(s.get("router_init", "uniform")),
            )
        else:
            outcome = run_minitron_pp(
                model,
                spec,
                decisions,
                costs,
                budget,
                batch_at,
                ctx.forward,
                s,
                log=ctx.say,
                fresh_model=lambda: ctx.model(spec, sd),
            )
    final, settler, verified = settle_choices(
        ctx,
        out,
        method,
        spec,
        decisions,
        outcome,
        costs,
        budget,
        lambda: option_importance(decisions),
        model,
    )
    r_steps, g_steps = settler.repair_steps, settler.grow_steps
    child = apply_choices(spec, decisions, final).replace(name=f"{spec.name}-{method}")
    pred = predictor.predict(child)
    rec = arch_record(
        method,
        spec,
        child,
        decisions,
        outcome.probs,
        outcome.choices,
        final,
        pred,
        predictor.predict(spec),
        budget,
        outcome.tokens,
        r_steps,
        g_steps,
        predictor.table.label,
    )
    rec.update(budget_reference=how, params=param_count(child), search_wall_s=round(outcome.wall_s, 2))
    if verified:
        rec["verified_in_engine"] = verified
    if settler.guards:
        rec["quality_guard"] = settler.guards[-1]
        rec["quality_guards"] = settler.guards
    rec["judge"] = {
        "kind": settler.judge.label,
        "calls": int(getattr(settler.judge, "calls", 0)),
        "tokens": int(getattr(settler.judge, "tokens", 0)),
    }
    if method == "minitron_pp" and hasattr(outcome, "record"):  # Minitron++'s depth axis (search/minitron.py)
        rec["minitron"] = outcome.record()
    write_json_atomic(out / "arch.json", rec)
    write_json_atomic(out / "trajectory.json", outcome.trajectory)
    _plot_trajectory(outcome.trajectory, out / "trajectory.png", method)
    ctx.say(
        f"[search:{method}] chose {describe(child)} params {param_count(child):,} predicted "
        + ", ".join(f"{m}={pred[m]:.4g}/{b:.4g}" for m, b in budget.items())
    )


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


def extract(ctx: Context, out: Path, rank_dir: Path, search_dir: Path) -> None:
    """Slice the chosen architecture from the sorted **parent** weights (every model family)."""
    from autocompress_nemo.extract.slice import slice_state_dict

    spec, sd = load_weights(rank_dir)
    rec = read_json(search_dir / "arch.json")
    child = ArchSpec.from_dict(rec["child"])
    child_sd = slice_state_dict(spec, sd, child)
    guard = rec.get("quality_guard")
    if guard and guard.get("judge") == "kd" and child != spec:
        guard["sliced_kd"] = sliced_kd(ctx, spec, sd, child, child_sd)
        ref = float(guard["final_kd"])
        ctx.say(f"[extract] KD of the sliced student {guard['sliced_kd']:.4f} (the search judged {ref:.4f})")
        if abs(guard["sliced_kd"] - ref) > 0.02 * abs(ref) + 1e-3:
            raise ValueError(
                f"the sliced student's KD to the parent ({guard['sliced_kd']:.4f}) differs from the child the search "
                f"judged ({ref:.4f}) on the same batches: slicing and the supernet disagree; not training it"
            )
    save_weights(out, child, child_sd)
    write_json_atomic(out / "arch.json", rec)
    ctx.export_hf(child, child_sd, out / "hf")
    shape = child.pattern if child.is_dense_layered() else stages_hybrid.describe(child)
    ctx.say(
        f"[extract] {shape}: {param_count(child):,} parameters "
        f"({param_count(child) / param_count(spec):.1%} of the parent)"
    )


def judge_batches(ctx: Context) -> list[torch.Tensor]:
    """The fixed calibration batches the KD judge scores children on (``search.judge_batches`` of
    ``search.batch_size x search.judge_seq_len`` tokens), shared by the search and the extract check."""
    s = ctx.cfg.search
    bs, seq = int(s.batch_size), int(s.judge_seq_len)
    return [ctx.batch_at("calib", i, bs, seq, seed_offset=41) for i in range(int(s.judge_batches))]


def sliced_kd(
    ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], child: ArchSpec, child_sd: dict[str, torch.Tensor]
) -> float:
    """KD loss to the sorted parent of the sliced student on the search judge's calibration batches
    (``settle_choices``): the number the quality guard judged, recomputed on the real child."""
    from autocompress_nemo.distill.kd import kd_loss
    from autocompress_nemo.distill.optim import Parallel
    from autocompress_nemo.search.autocompress import _local_rows

    s, par = ctx.cfg.search, Parallel.detect()
    teacher, student = ctx.model(spec, sd), ctx.model(child, child_sd)
    teacher.eval()
    student.eval()
    vals = []
    with torch.no_grad():
        for b in judge_batches(ctx):
            x = _local_rows(b, par)
            vals.append(float(kd_loss(ctx.forward(student, x), ctx.forward(teacher, x), float(s.kd_temperature))))
    from autocompress_nemo.search.judge import world_mean

    return world_mean(sum(vals) / len(vals))


# -- distill -------------------------------------------------------------------------------------------
def distill(ctx: Context, out: Path, rank_dir: Path, extract_dir: Path, ckpt_dir: Path) -> None:
    """Recovery distillation of the extracted student from the sorted parent (every model family)."""
    from autocompress_nemo.distill.recover import distill as run_distill

    d = ctx.cfg.distill
    pspec, psd = load_weights(rank_dir)
    cspec, csd = load_weights(extract_dir)
    teacher = ctx.model(pspec, psd)
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = ctx.model(cspec, csd)
    seq, bs = int(d.seq_len), int(d.batch_size)
    result = run_distill(
        student,
        teacher,
        ctx.forward,
        lambda step: ctx.batch_at("train", step, bs, seq, seed_offset=29),
        d,
        ckpt_dir,
        int(ctx.cfg.seed),
    )
    save_weights(out, cspec, ctx.to_hf(cspec, student))
    write_json_atomic(out / "distill.json", result)


# -- evaluate ----------------------------------------------------------------------------------------------
def heldout_perplexity(
    ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], lm_eval: bool = True
) -> dict[str, Any]:
    from autocompress_nemo.distill.kd import kd_loss, lm_loss

    ev = ctx.cfg.evaluate
    batches = ctx.heldout_batches(2, int(ev.seq_len), int(ev.heldout_batches))
    model = ctx.model(spec, sd)
    pspec, psd, _ = ctx.parent
    nll, kd = [], []
    with torch.no_grad():
        teacher = ctx.model(pspec, psd) if spec != pspec else None
        for x in batches:
            logits = ctx.forward(model, x)
            nll.append(float(lm_loss(logits, x)))
            if teacher is not None:
                kd.append(float(kd_loss(logits, ctx.forward(teacher, x))))
    mean = sum(nll) / len(nll)
    out = {
        "heldout_nll": mean,
        "heldout_ppl": float(torch.tensor(mean).exp()),
        "heldout_tokens": sum(x.numel() for x in batches),
        "kd_to_parent": (sum(kd) / len(kd)) if kd else 0.0,
    }
    if lm_eval:
        out["lm_eval"] = lm_eval_scores(ctx, model)
    return out


class GgufModel(torch.nn.Module):
    """An exported GGUF file as a model for the lm-eval adapter: ``gguf_forward`` computes its
    logits in llama.cpp (a child process per batch, ``export/parity.gguf_logits``)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path


def gguf_forward(model: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    import numpy as np

    from autocompress_nemo.export.parity import gguf_logits

    assert isinstance(model, GgufModel)
    rows = gguf_logits(model.path, ids_BT.tolist())
    return torch.from_numpy(np.stack(rows))  # type: ignore[arg-type]


def lm_eval_scores(ctx: Context, model: torch.nn.Module, forward: Any = None) -> dict[str, Any]:
    """The configured lm-eval tasks through the harness adapter (``stdlib_next_line`` is
    written from held-out modules on first use); ``forward`` defaults to the Megatron one."""
    from autocompress_nemo.evaluate.lm_eval_adapter import run_lm_eval
    from autocompress_nemo.evaluate.stdlib_task import TASK, write_task

    ev = ctx.cfg.evaluate
    tasks = [str(t) for t in ev.lm_eval_tasks]
    if not tasks:
        return {}
    include = str(ev.lm_eval_include) or None
    if TASK in tasks:
        task_dir = Path(str(ctx.cfg.run_dir)) / "lm_eval_tasks"
        if not (task_dir / f"{TASK}.yaml").is_file():
            write_task(task_dir, [d.text for d in ctx.data.heldout_docs], int(ev.lm_eval_items), int(ctx.cfg.seed))
        include = str(task_dir) if include is None else include
        if include != str(task_dir):
            raise ValueError("evaluate.lm_eval_include and the generated stdlib_next_line task need one directory")
    res = run_lm_eval(
        model,
        forward or ctx.forward,
        ctx.tokenizer,
        tasks,
        include_path=include,
        limit=int(ev.lm_eval_limit) or None,
        seed=int(ctx.cfg.seed),
    )
    return res.get("results", {})


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))


def evaluate(
    ctx: Context,
    out: Path,
    rank_dir: Path,
    table_path: Path,
    validation_dir: Path | None,
    students: dict[str, Path],
    extracted: dict[str, Path] | None = None,
    exports: dict[str, Path] | None = None,
) -> None:
    """Accuracy on held-out text and costs measured in the target's engine, against the budgets,
    next to the predictions — for the parent and every student, measured in one interleaved session.
    A student exported as a GGUF file also gets its held-out perplexity measured on that file in
    llama.cpp, next to the PyTorch figure."""
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.costs.predictor import Predictor
    from autocompress_nemo.profile.stage import load_table

    cfg = ctx.cfg
    pspec, psd, _ = ctx.parent
    predictor = Predictor(load_table(cfg, table_path), cfg.target)
    budget, how = budgets(ctx, predictor, pspec, validation_dir)
    models: dict[str, tuple[ArchSpec, dict[str, torch.Tensor]]] = {"parent": (pspec, psd)}
    for name, d in students.items():
        models[name] = load_weights(d)
    results: dict[str, Any] = {"budgets": budget, "budget_reference": how, "models": {}}
    for name, (spec, sd) in models.items():
        ctx.say(f"[evaluate] {name}: held-out perplexity")
        acc = heldout_perplexity(ctx, spec, sd)
        results["models"][name] = {
            "spec": spec.to_dict(),
            "pattern": spec.pattern,
            "params": param_count(spec),
            "accuracy": acc,
            "predicted": _numbers(predictor.predict(spec)),
        }
    # the architectures alone: extracted students before any recovery (held-out loss only)
    results["before_recovery"] = {}
    for name, d in (extracted or {}).items():
        if d in students.values():
            continue
        spec, sd = load_weights(d)
        ctx.say(f"[evaluate] {name} before recovery: held-out perplexity")
        results["before_recovery"][name] = heldout_perplexity(ctx, spec, sd, lm_eval=False)
    from autocompress_nemo.pipeline import is_rank0

    if not is_rank0():  # engine timings run once (rank 0): concurrent copies would disturb each other
        return
    for name, d in (exports or {}).items():
        files = sorted(d.glob("*.gguf"))
        if not files or name not in results["models"]:
            continue
        from autocompress_nemo.export.parity import gguf_heldout

        ev = ctx.cfg.evaluate
        ctx.say(f"[evaluate] {name}: held-out perplexity of the exported {files[0].name} in llama.cpp")
        on_file = gguf_heldout(files[0], ctx.heldout_batches(2, int(ev.seq_len), int(ev.heldout_batches)))
        torch_ppl = results["models"][name]["accuracy"]["heldout_ppl"]
        on_file.update(
            file=files[0].name,
            measured_by=f"llama.cpp (llama-cpp-python {_llama_cpp_version()}) on this CPU, F32 KV cache",
            rel_diff_vs_pytorch=on_file["heldout_ppl"] / torch_ppl - 1.0,
        )
        ctx.say(f"[evaluate] {name}: lm-eval on the exported {files[0].name} in llama.cpp")
        on_file["lm_eval"] = lm_eval_scores(ctx, GgufModel(files[0]), gguf_forward)
        results["models"][name]["accuracy_exported"] = on_file
    engine = get_engine(cfg.target, workdir=out / "engine_work")
    wl = Workload.from_config(cfg.target.workload)
    specs = [models[n][0].replace(name=n) for n in models]
    if engine.estimated:
        ctx.say("[evaluate] the target's engine is an analytic estimate: costs are estimated, not measured")
    measured = engine.measure_many(specs, wl, log=lambda m: ctx.say(f"[evaluate] {m}"))
    label = f"{engine.name} {engine.version()} on {engine.device()}" + (
        " (estimated, not measured)" if engine.estimated else ""
    )
    for n, m in zip(models, measured, strict=True):
        meas = measured_metrics(m, wl, models[n][0])
        r = results["models"][n]
        r["measured"] = meas
        r["measured_memory"] = m.memory
        r["measured_by"] = label
        r["spread"] = m.spread
        r["budget_check"] = {
            k: {"budget": b, "measured": meas[k], "predicted": r["predicted"].get(k), "pass": bool(meas[k] <= b)}
            for k, b in budget.items()
        }
    import shutil

    shutil.rmtree(out / "engine_work", ignore_errors=True)
    write_json_atomic(out / "evaluation.json", results)
    for n, r in results["before_recovery"].items():
        ctx.say(f"[evaluate] {n} before recovery: ppl {r['heldout_ppl']:.3f} KD to parent {r['kd_to_parent']:.4f}")
    for n, r in results["models"].items():
        on_file = r.get("accuracy_exported")
        ctx.say(
            f"[evaluate] {n}: ppl {r['accuracy']['heldout_ppl']:.3f}"
            + (f" (exported file in llama.cpp: {on_file['heldout_ppl']:.3f})" if on_file else "")
            + f" params {r['params']:,} "
            + " ".join(
                f"{k} {c['measured']:.4g}/{c['budget']:.4g} {'PASS' if c['pass'] else 'FAIL'}"
                for k, c in r["budget_check"].items()
            )
        )


def _llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def measured_metrics(m: Any, wl: Any, spec: ArchSpec) -> dict[str, float]:
    """One engine ``Measurement`` in the budget metrics' names and units: response latency
    ``prefill + output_len * decode``, throughput ``1000 * batch / decode`` tok/s."""
    return {
        "prefill_ms": m.prefill_ms,
        "ttft_ms": m.prefill_ms,
        "decode_ms": m.decode_ms,
        "tpot_ms": m.decode_ms,
        "response_latency_ms": m.prefill_ms + wl.output_len * m.decode_ms,
        "throughput_tps": 1000.0 * wl.batch / m.decode_ms if m.decode_ms else float("inf"),
        "memory_bytes": m.memory_bytes,
        "params": float(param_count(spec)),
    }


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
        )
    traj = [r for r in getattr(outcome, "trajectory", []) if "step" in r]
    tail = traj[-max(1, len(traj) // 10) :] if method == "autocompress" and traj else []
    settler = Settler(
        spec,
        decisions,
        costs.predict,
        judge,
        grow_threshold=float(s.grow_threshold) if method == "autocompress" and model is not None else None,
        guard_factor=float(s.guard_factor),
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
    from autocompress_nemo.pipeline import is_rank0
    from autocompress_nemo.search.settle import verify_measured as verify

    rounds = int(ctx.cfg.search.verify_rounds)
    engine = engine if engine is not None else get_engine(ctx.cfg.target, workdir=out / "verify_engine")
    if rounds <= 0 or engine.estimated:
        return choices, []
    wl = Workload.from_config(ctx.cfg.target.workload)

    def measure(child: ArchSpec) -> dict[str, float]:
        meas = [measured_metrics(engine.measure_many([child], wl)[0], wl, child) if is_rank0() else None]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(meas, src=0)
        return meas[0]  # type: ignore[return-value]

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


def _numbers(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def export(ctx: Context, out: Path, student_dir: Path) -> None:
    """The student in the engine's format (GGUF for llama.cpp), as a Hugging Face directory
    (DeciLM-style ``block_configs`` when heterogeneous) and as a Megatron checkpoint."""
    import numpy as np

    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.models.llama.hf_io import export_hf

    spec, sd = load_weights(student_dir)
    if not spec.is_dense_layered():  # MoE / Mamba hybrids: HF (Nemotron-H) + Megatron, no GGUF
        return stages_hybrid.export(ctx, out, student_dir)
    export_hf(spec, sd, out / "hf", tokenizer=None)
    if str(ctx.cfg.target.engine.name) == "llama_cpp":
        from autocompress_nemo.export.parity import check_export

        dtype = str(ctx.cfg.target.engine.dtype)
        path = write_gguf(
            spec,
            out / f"{spec.name or 'student'}.gguf",
            {k: v.float().numpy().astype(np.float32) for k, v in sd.items()},
            tokenizer_from=ctx.parent_gguf(),
            dtype=dtype,
        )
        ctx.say(f"[export] GGUF ({'llama' if spec.is_uniform() else 'deci'}) -> {path}")
        # the gate: the file's logits against the project's student on a fixed held-out sequence
        tokens = ctx.heldout_batches(1, int(ctx.cfg.evaluate.parity_tokens), 1)[0][0].tolist()

        def reference(spec_k: ArchSpec, sd_k: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
            m = ctx.model(spec_k, {k: torch.as_tensor(v) for k, v in sd_k.items()})
            m.eval()
            return ctx.forward(m, ids)[0]

        parity = check_export(spec, sd, path, reference, tokens, dtype)
        write_json_atomic(out / "parity.json", {**parity, "file": path.name})
        ctx.say(
            f"[export] parity with the PyTorch student on {parity['tokens']} held-out tokens: max |dlogit| "
            f"{parity['max_abs_dlogit']:.4g} <= {parity['tolerance']} ({dtype}) PASS"
        )
    model = ctx.model(spec, sd)
    torch.save({"arch_spec": spec.to_dict(), "megatron_state_dict": model.state_dict()}, out / "megatron_model.pt")


def report(ctx: Context, run: Any, methods: list[str], validation_dir: Path | None) -> Path:
    """``report.md`` / ``report.json`` and the plots in the run directory."""
    from autocompress_nemo.report import write_report

    results = collect_results(ctx, run, methods, validation_dir)
    write_report(run.dir, results)
    return run.dir / "report.md"


def collect_results(ctx: Context, run: Any, methods: list[str], validation_dir: Path | None) -> dict[str, Any]:
    """Everything the report shows, read back from the artifacts of this run."""
    from autocompress_nemo.utils.artifacts import read_manifest

    d = run.dir
    ev = read_json(d / "evaluate" / "evaluation.json") if (d / "evaluate" / "evaluation.json").is_file() else {}
    table = d / "profile" / "cost_table" / "cost_table.json"
    prov = read_json(table).get("provenance", {}) if table.is_file() else {}
    eng = ctx.cfg.target.engine
    engine = {
        "name": str(eng.name),
        "dtype": str(prov.get("dtype") or eng.get("dtype", "")),
        # the version the cost table measured (the config's `version` is usually left empty)
        "version": str(prov.get("engine_version") or eng.get("version") or ""),
    }
    res: dict[str, Any] = {
        "target": {
            "name": str(ctx.cfg.target.name),
            "description": str(ctx.cfg.target.get("description", "")),
            "engine": engine,
            "hardware": str(ctx.cfg.target.hardware.name),
            "workload": dict(ctx.cfg.target.workload),
        },
        "budgets": ev.get("budgets", {}),
        "budget_reference": ev.get("budget_reference", ""),
        "models": ev.get("models", {}),
        "methods": {},
        "stages_wall_s": {},
        "before_recovery": ev.get("before_recovery", {}),
    }
    for m in methods:
        arch = d / f"search_{m}" / "arch.json"
        if arch.is_file():
            rec = read_json(arch)
            dist = d / f"distill_{m}" / "distill.json"
            res["methods"][m] = {
                "label": METHODS.get(m, m),
                "arch": rec,
                "trajectory": read_json(d / f"search_{m}" / "trajectory.json"),
                "selection_tokens": rec.get("selection_tokens", 0),
                "recovery_tokens": read_json(dist).get("tokens", 0) if dist.is_file() else 0,
            }
    if validation_dir is not None and (validation_dir / "validation.json").is_file():
        res["validation"] = read_json(validation_dir / "validation.json")["summary"]
    for p in sorted(d.iterdir()):
        m = read_manifest(p) if p.is_dir() else None
        if m:
            res["stages_wall_s"][p.name] = m.get("wall_s")
    return res

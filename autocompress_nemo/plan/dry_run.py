"""``dry_run=true``: plan a run with no weights and no GPUs (DESIGN.md section 5).

For each Megatron stage (rank, search, distill): the parallel layout and the per-GPU memory
(weights, gradients, optimizer state, activations under the configured recompute, teacher +
student in distillation). For serving on the target: the memory of the parent and of a
budget-sized student at the target's context (weights + KV cache + SSM state + workspace),
and whether the budget is reachable within the model's search space.

Every figure is computed from shapes: estimated, not measured. Counts come from
``arch/counts.py``; training-memory formulas from ``plan/memory_train.py``; serving memory
from ``costs/memory.py`` (through ``plan/serving.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TypedDict

from omegaconf import OmegaConf

from autocompress_nemo.arch import counts
from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.config.engine import settings_of
from autocompress_nemo.config.resolve import search_capabilities
from autocompress_nemo.costs.memory import bytes_per_element
from autocompress_nemo.plan import memory_train as mt
from autocompress_nemo.plan.layout import (
    DISTRIBUTED_STAGES,
    ParallelLayout,
    layout_for_stage,
    layout_problems,
    pipeline_stages,
)
from autocompress_nemo.plan.serving import budget_student, check_budget, serving_memory, smallest_servable
from autocompress_nemo.utils.artifacts import write_json_atomic, write_text_atomic

LABEL = "estimated, not measured"
HEADROOM = 0.10
"""Fraction of GPU memory left for the CUDA context, NCCL buffers and allocator fragmentation,
which the estimate does not count: a stage fits when its peak is below 90% of the GPU."""
GB = 1e9


class _StagePeak(TypedDict):
    """One pipeline stage's per-GPU memory (``_stage_memory``'s ``pipeline`` entries)."""

    pipeline_stage: int
    blocks: list[int]
    bytes: dict[str, float]
    total: float


def _stage_memory(
    stage: str,
    layout: ParallelLayout,
    model: ArchSpec,
    teacher: ArchSpec | None,
    cl: Any,
    *,
    seq_len: int,
    global_batch: int,
    trainable: bool,
    backward: bool,
) -> dict[str, Any]:
    """Per-GPU memory of the most loaded pipeline stage (bytes, by part)."""
    L = layout
    dp = max(L.dp, 1)
    mb = int(cl.micro_batch_size)
    s = seq_len // max(L.cp, 1)
    n_micro = max(1, global_batch // (mb * dp))
    recompute = str(cl.recompute)
    ranges = pipeline_stages(model, L.pp, seq_len)
    t_ranges = pipeline_stages(teacher, L.pp, seq_len) if teacher is not None else None
    first, last = mt.embedding_and_head_params(model.vocab, model.hidden, model.tied_embeddings, L.pp)
    per_stage: list[_StagePeak] = []
    for i, r in enumerate(ranges):
        blocks = [model.blocks[j] for j in r]
        dense, expert = mt.dense_and_expert_params(blocks, model.hidden)
        dense += (first if i == 0 else 0) + (last if i == L.pp - 1 else 0)
        p_dense, p_expert = dense / L.tp, expert / (L.ep * L.etp)
        part: dict[str, float] = {"weights": mt.weight_bytes(p_dense + p_expert)}
        if trainable:
            part["gradients"] = mt.grad_bytes(p_dense + p_expert)
            part["optimizer"] = mt.optimizer_bytes(p_dense, dp, bool(cl.distributed_optimizer)) + mt.optimizer_bytes(
                p_expert, max(L.expert_dp, 1), bool(cl.distributed_optimizer)
            )
        if backward:
            act = mt.stage_activation_bytes(blocks, model.hidden, s, mb, L.tp, L.etp, L.sp, recompute)
            part["activations"] = act * mt.in_flight_microbatches(L.pp, i, n_micro)
        else:
            part["activations"] = mt.forward_only_peak_bytes(blocks, model.hidden, s, mb, L.tp, L.etp, L.sp)
        if i == L.pp - 1:
            part["logits"] = mt.logits_bytes(
                model.vocab, s, mb, L.tp, with_teacher=teacher is not None or stage == "search", trainable=backward
            )
        if teacher is not None and t_ranges is not None:
            tb = [teacher.blocks[j] for j in t_ranges[i]]
            td, te = mt.dense_and_expert_params(tb, teacher.hidden)
            tf, tl = mt.embedding_and_head_params(teacher.vocab, teacher.hidden, teacher.tied_embeddings, L.pp)
            td += (tf if i == 0 else 0) + (tl if i == L.pp - 1 else 0)
            part["teacher_weights"] = mt.weight_bytes(td / L.tp + te / (L.ep * L.etp))
            part["teacher_activations"] = mt.forward_only_peak_bytes(tb, teacher.hidden, s, mb, L.tp, L.etp, L.sp)
        per_stage.append({"pipeline_stage": i, "blocks": [r.start, r.stop], "bytes": part, "total": sum(part.values())})
    worst = max(per_stage, key=lambda x: x["total"])
    gpu_mem = int(cl.gpu_memory_bytes or 0)
    return {
        "per_gpu_peak_bytes": worst["total"],
        "peak_pipeline_stage": worst["pipeline_stage"],
        "breakdown_bytes": worst["bytes"],
        "pipeline": per_stage,
        "micro_batch": mb,
        "microbatches_per_step": n_micro,
        "seq_len": seq_len,
        "recompute": recompute,
        "gpu_memory_bytes": gpu_mem,
        "fits": (worst["total"] <= (1 - HEADROOM) * gpu_mem) if gpu_mem else None,
        "label": LABEL,
    }


def build_plan(cfg: Any) -> dict[str, Any]:
    """The plan as a JSON-able dict (see the module docstring)."""
    parent = spec_from_model_config(cfg.model)
    eng, wl = cfg.target.engine, cfg.target.workload
    kv_bytes = bytes_per_element(str(eng.kv_dtype))
    ssm_bytes = bytes_per_element(settings_of(eng.settings).ssm_cache_dtype or str(eng.kv_dtype))
    # one model instance is served on engine.tensor_parallel devices (the others hold replicas)
    hw_mem = int(cfg.target.hardware.memory_bytes) * max(int(eng.tensor_parallel), 1)

    def serve(spec: ArchSpec) -> dict[str, Any]:
        return serving_memory(spec, cfg.target)

    parent_serving = serve(parent)
    student, how = budget_student(parent, cfg.target, serve)
    student_serving = serve(student) if student is not None else None
    smallest = smallest_servable(parent, search_capabilities(cfg))
    smallest_serving = serve(smallest)
    reach = check_budget(smallest, smallest_serving, parent, parent_serving, cfg.target)
    plan: dict[str, Any] = {
        "label": LABEL,
        "model": {
            "name": str(cfg.model.name),
            "pattern": parent.pattern,
            "params": counts.param_count(parent),
            "active_params": counts.active_param_count(parent),
            "kv_bytes_per_token": counts.kv_bytes_per_token(parent, kv_bytes),
            "ssm_state_bytes_per_sequence": counts.ssm_state_bytes_per_sequence(parent, ssm_bytes),
            "reference": str(cfg.model.get("reference", "")),
        },
        "target": {
            "name": str(cfg.target.name),
            "device": str(cfg.target.hardware.device or cfg.target.hardware.name),
            "memory_bytes": hw_mem,
            "engine": str(eng.name),
            "dtype": str(eng.dtype),
            "kv_dtype": str(eng.kv_dtype),
            "context_len": int(wl.context_len),
            "batch": int(wl.batch),
            "budget": [{"metric": str(c.metric), "value": c.value} for c in cfg.target.budget.constraints],
        },
        "serving": {
            "memory_per_instance_bytes": hw_mem,
            "parent": parent_serving,
            "parent_fits": parent_serving["total"] <= hw_mem,
            "student": student_serving,
            "student_params": counts.param_count(student) if student is not None else None,
            "student_fits": (student_serving["total"] <= hw_mem) if student_serving else None,
            "student_how": how,
            "student_pattern": student.pattern if student is not None else None,
            "smallest_in_space": {"params": counts.param_count(smallest), "serving": smallest_serving},
            "budget_reachable": reach["ok"],
            "budget_checks": reach["checks"],
        },
        "stages": {},
        "cluster": {
            "name": str(cfg.cluster.name),
            "kind": str(cfg.cluster.kind),
            "gpu": str(cfg.cluster.get("gpu", "")),
        },
    }
    for stage in DISTRIBUTED_STAGES:
        plan["stages"][stage] = _stage_plan(cfg, stage, parent, student if student is not None else parent)
    return plan


def _stage_plan(cfg: Any, stage: str, parent: ArchSpec, student: ArchSpec) -> dict[str, Any]:
    """One distributed stage's layout on the cluster, its problems and, without any, its memory per
    device: distill and reconstruct train ``student`` next to the frozen parent, rank runs the
    calibration set, search its training batches."""
    layout = layout_for_stage(cfg.cluster, stage)
    if stage in ("distill", "reconstruct"):  # both train the student next to the frozen parent
        model, teacher, seq, batch = student, parent, int(cfg.distill.seq_len), int(cfg.distill.batch_size)
        trainable, backward = True, True
    else:  # rank runs the calibration set, search its training batches
        batch = int(cfg.search.calib_sequences if stage == "rank" else cfg.search.batch_size)
        model, teacher, seq = parent, None, int(cfg.search.seq_len)
        trainable = stage == "search" and bool(cfg.search.train_weights)
        backward = stage == "search"  # router gradients flow back through the whole supernet
    micro = int(cfg.cluster.micro_batch_size)
    problems = layout_problems(layout, parent, seq_len=seq, global_batch=batch, micro_batch=micro)
    if stage == "distill" and model is not parent:
        more = layout_problems(layout, model, seq_len=seq, global_batch=batch, micro_batch=micro)
        problems += [p for p in more if p not in problems]
    entry: dict[str, Any] = {"layout": layout.to_dict(), "layout_text": layout.describe(), "problems": problems}
    if not problems:
        train = {"trainable": trainable, "backward": backward}
        entry["memory"] = _stage_memory(
            stage, layout, model, teacher, cfg.cluster, seq_len=seq, global_batch=batch, **train
        )
    return entry


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:,.2f} GB"


def render_markdown(plan: dict[str, Any]) -> str:
    """The plan as Markdown (what ``plan.md`` holds and the dry run prints)."""
    m, t, sv = plan["model"], plan["target"], plan["serving"]
    lines = [
        f"# Dry-run plan: {m['name']} -> {t['name']} ({LABEL})",
        "",
        f"Model: {m['params']:,} parameters ({m['active_params']:,} active per token); "
        f"KV cache {m['kv_bytes_per_token']:,.0f} B/token; SSM state {m['ssm_state_bytes_per_sequence']:,.0f} B/sequence.",
        f"Target: {t['device']} ({_gb(t['memory_bytes'])}), engine {t['engine']} {t['dtype']} (KV {t['kv_dtype']}), "
        f"context {t['context_len']:,} x batch {t['batch']}. Budget: "
        + (", ".join(f"{c['metric']} <= {c['value']}" for c in t["budget"]) or "none"),
        "",
        f"## Serving memory at the target's context ({LABEL})",
        "",
        "| model | params | weights | KV cache | SSM state | workspace | total | fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [("parent", m["params"], sv["parent"], sv["parent_fits"])]
    if sv["student"] is not None:
        rows.append(("budget-sized student", sv["student_params"], sv["student"], sv["student_fits"]))
    rows.append(
        ("smallest in search space", sv["smallest_in_space"]["params"], sv["smallest_in_space"]["serving"], None)
    )
    for name, p, s, fits in rows:
        lines.append(
            f"| {name} | {p / 1e9:,.2f} B | {_gb(s['weights'])} | {_gb(s['kv_cache'])} | {_gb(s['ssm_state'])} | "
            f"{_gb(s['workspace'])} | {_gb(s['total'])} | {'-' if fits is None else ('yes' if fits else 'NO')} |"
        )
    excess = sv["parent"]["total"] - sv["memory_per_instance_bytes"]
    if excess > 0:
        lines += [
            "",
            f"Why the parent does not fit: it needs {_gb(sv['parent']['total'])} against {_gb(sv['memory_per_instance_bytes'])}; "
            f"the student must shed at least {_gb(excess)} (about {excess / sv['parent']['weights'] * m['params'] / 1e9:,.1f} B "
            f"parameters at {t['dtype']}) before any headroom for more sessions.",
        ]
    lines += ["", f"Student: {sv['student_how']}", ""]
    lines.append(f"Budget reachable within the search space: {'yes' if sv['budget_reachable'] else 'NO'}")
    lines += [f"- {c}" for c in sv["budget_checks"]]
    lines += ["", f"## Training stages, per GPU ({LABEL})", ""]
    for stage, e in plan["stages"].items():
        lines.append(f"### {stage}: {e['layout_text']}")
        if e["problems"]:
            lines += [f"- LAYOUT PROBLEM: {p}" for p in e["problems"]]
            lines.append("")
            continue
        mem = e["memory"]
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in mem["breakdown_bytes"].items())
        fits = mem["fits"]
        verdict = "unknown GPU memory" if fits is None else ("fits" if fits else "DOES NOT FIT")
        lines.append(
            f"- peak {_gb(mem['per_gpu_peak_bytes'])} on pipeline stage {mem['peak_pipeline_stage']} "
            f"of {_gb(mem['gpu_memory_bytes'] or None)} ({verdict}, {int(HEADROOM * 100)}% kept free): {parts}"
        )
        lines.append(
            f"- seq {mem['seq_len']}, micro batch {mem['micro_batch']} x {mem['microbatches_per_step']} per step, "
            f"recompute {mem['recompute']}"
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def run_dry_run(cfg: Any) -> dict[str, Any]:
    """Plan ``cfg`` without weights or GPUs; print it, write ``plan.json`` and ``plan.md`` into
    ``cfg.run_dir`` and return the plan dict."""
    t0 = time.perf_counter()
    plan = build_plan(cfg)
    plan["wall_seconds"] = round(time.perf_counter() - t0, 3)
    run_dir = Path(str(OmegaConf.select(cfg, "run_dir") if OmegaConf.is_config(cfg) else cfg.run_dir))
    md = render_markdown(plan)
    write_json_atomic(run_dir / "plan.json", json.loads(json.dumps(plan, default=str)))
    write_text_atomic(run_dir / "plan.md", md)
    print(md)
    print(f"plan written to {run_dir / 'plan.json'} and {run_dir / 'plan.md'}")
    return plan

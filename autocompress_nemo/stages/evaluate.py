"""evaluate: accuracy on held-out text (PyTorch, and the exported GGUF in llama.cpp) and lm-eval, and
the costs measured in the target's engine against the budgets, next to the predictions — for the
parent and every student, measured in one interleaved session (``EvaluateDir``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.context import Context, load_weights
from autocompress_nemo.costs.engines import engine_class, get_engine
from autocompress_nemo.stages.common import budgets, budgets_measured, load_table, measured_metrics, numbers
from autocompress_nemo.stages.declare import DATA, LAYOUT, STUDENT, Inputs, Stage, reads
from autocompress_nemo.stages.layout import EvaluateDir, ExportDir, ProfileDir, ValidateDir
from autocompress_nemo.utils.artifacts import write_json_atomic


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
    out: dict[str, Any] = {
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


def run(
    ctx: Context,
    out: Path,
    profile: ProfileDir,
    validation: ValidateDir | None,
    students: dict[str, Path],
    extracted: dict[str, Path] | None = None,
    exports: dict[str, Path] | None = None,
    reconstructed: dict[str, Path] | None = None,
) -> None:
    """Accuracy on held-out text and costs measured in the target's engine, against the budgets,
    next to the predictions — for the parent and every student, measured in one interleaved session.
    A student exported as a GGUF file also gets its held-out perplexity measured on that file in
    llama.cpp, next to the PyTorch figure."""
    from autocompress_nemo.costs.predictor import Predictor
    from autocompress_nemo.pipeline import is_rank0

    pspec, psd, _ = ctx.parent
    predictor = Predictor(load_table(ctx, profile.table), ctx.cfg.target)
    budget, how = budgets(ctx, predictor, pspec, validation)
    models: dict[str, tuple[ArchSpec, dict[str, torch.Tensor]]] = {"parent": (pspec, psd)}
    for name, d in students.items():
        models[name] = load_weights(d)
    results: dict[str, Any] = {"budgets": budget, "budget_reference": how, "models": {}}
    for name, (spec, sd) in models.items():
        ctx.say(f"[evaluate] {name}: held-out perplexity")
        results["models"][name] = {
            "spec": spec.to_dict(),
            "pattern": spec.pattern,
            "params": param_count(spec),
            "accuracy": heldout_perplexity(ctx, spec, sd),
            "predicted": numbers(predictor.predict(spec)),
        }
    # the students on their way (held-out loss only): extracted (the architecture alone, before any
    # recovery) and, when the stage ran, after the local reconstruction, before global distillation
    for key, what, dirs in (
        ("before_recovery", "before recovery", extracted),
        ("after_local", "after local reconstruction", reconstructed),
    ):
        results[key] = {}
        for name, d in (dirs or {}).items():
            if d in students.values():
                continue
            spec, sd = load_weights(d)
            ctx.say(f"[evaluate] {name} {what}: held-out perplexity")
            results[key][name] = heldout_perplexity(ctx, spec, sd, lm_eval=False)
    if not is_rank0():  # engine timings run once (rank 0): concurrent copies would disturb each other
        return
    _exported_accuracy(ctx, exports or {}, results["models"])
    dtype = str(ctx.cfg.target.engine.get("dtype", "f16"))
    if engine_class(str(ctx.cfg.target.engine.name)).own_quantizer and _is_quantized(dtype):
        quantization_costs(ctx, models, exports or {}, results["models"], dtype, out / "quantization_work")
    _engine_costs(ctx, out, models, budget, results)
    write_json_atomic(EvaluateDir(out).evaluation, results)
    _say_results(ctx, results)


def _exported_accuracy(ctx: Context, exports: dict[str, Path], rows: dict[str, Any]) -> None:
    """Held-out perplexity and lm-eval of each student's exported GGUF file in llama.cpp, beside its
    PyTorch figure (``rows[name]["accuracy_exported"]``)."""
    for name, d in exports.items():
        files = ExportDir(d).ggufs()
        if not files or name not in rows:
            continue
        from autocompress_nemo.export.parity import gguf_heldout

        ev = ctx.cfg.evaluate
        ctx.say(f"[evaluate] {name}: held-out perplexity of the exported {files[0].name} in llama.cpp")
        on_file = gguf_heldout(files[0], ctx.heldout_batches(2, int(ev.seq_len), int(ev.heldout_batches)))
        torch_ppl = rows[name]["accuracy"]["heldout_ppl"]
        on_file.update(
            file=files[0].name,
            measured_by=f"llama.cpp (llama-cpp-python {_llama_cpp_version()}) on this CPU, F32 KV cache",
            rel_diff_vs_pytorch=on_file["heldout_ppl"] / torch_ppl - 1.0,
        )
        ctx.say(f"[evaluate] {name}: lm-eval on the exported {files[0].name} in llama.cpp")
        on_file["lm_eval"] = lm_eval_scores(ctx, GgufModel(files[0]), gguf_forward)
        rows[name]["accuracy_exported"] = on_file


def _engine_costs(
    ctx: Context,
    out: Path,
    models: dict[str, tuple[ArchSpec, dict[str, torch.Tensor]]],
    budget: dict[str, float],
    results: dict[str, Any],
) -> None:
    """The parent and every student timed in the target's engine next to the parent in the same
    rounds (``costs/engines/paired.py``), each checked against the budgets in the units of that
    very measurement."""
    import shutil

    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.costs.engines.paired import all_flags

    pspec = models["parent"][0]
    engine = get_engine(ctx.cfg.target, workdir=out / "engine_work")
    wl = Workload.from_config(ctx.cfg.target.workload)
    specs = [models[n][0].replace(name=n) for n in models]
    if engine.estimated:
        ctx.say("[evaluate] the target's engine is an analytic estimate: costs are estimated, not measured")
    measured = engine.measure_many(
        specs, wl, log=lambda m: ctx.say(f"[evaluate] {m}"), reference=pspec.replace(name="parent")
    )
    label = f"{engine.name} {engine.version()} on {engine.device()}" + (
        " (estimated, not measured)" if engine.estimated else ""
    )
    b_now, ref = budgets_measured(ctx, measured[0], wl, pspec, budget)
    for f in all_flags(measured):
        ctx.say(f"[evaluate] flagged: {f}")
    if ref is not None:
        results["timing"] = {
            "method": "ratio to the parent timed in the same rounds; PASS / FAIL on the ratio",
            "reference": {k: v for k, v in measured[0].reference.items() if k != "flags"},
            "parent_measured": {k: ref[k] for k in budget},
            "budgets_measured": b_now,
            "flags": all_flags(measured),
        }
    for n, m in zip(models, measured, strict=True):
        meas = measured_metrics(m, wl, models[n][0])
        r = results["models"][n]
        r.update(measured=meas, measured_memory=m.memory, measured_by=label, spread=m.spread)
        if m.ratio:
            r.update(ratio_to_parent=m.ratio, ratio_spread=m.ratio_spread, measured_absolute=m.absolute, flags=m.flags)
        r["budget_check"] = {
            k: {
                "budget": b_now[k],
                "measured": meas[k],
                "predicted": r["predicted"].get(k),
                "pass": bool(meas[k] <= b_now[k]),
                **({"ratio": meas[k] / ref[k], "budget_ratio": b_now[k] / ref[k]} if ref and ref.get(k) else {}),
            }
            for k in budget
        }
    shutil.rmtree(out / "engine_work", ignore_errors=True)


def _say_results(ctx: Context, results: dict[str, Any]) -> None:
    for n, r in results["before_recovery"].items():
        ctx.say(f"[evaluate] {n} before recovery: ppl {r['heldout_ppl']:.3f} KD to parent {r['kd_to_parent']:.4f}")
    for n, r in results["models"].items():
        on_file = r.get("accuracy_exported")
        ctx.say(
            f"[evaluate] {n}: ppl {r['accuracy']['heldout_ppl']:.3f}"
            + (f" (exported file in llama.cpp: {on_file['heldout_ppl']:.3f})" if on_file else "")
            + f" params {r['params']:,} "
            + " ".join(
                f"{k} {c['measured']:.4g}/{c['budget']:.4g}"
                + (f" (ratio to the parent {c['ratio']:.3f} vs {c['budget_ratio']:.3f})" if "ratio" in c else "")
                + f" {'PASS' if c['pass'] else 'FAIL'}"
                for k, c in r["budget_check"].items()
            )
        )


def _is_quantized(dtype: str) -> bool:
    from autocompress_nemo.costs.gguf_types import check_dtype, is_quantized

    return is_quantized(check_dtype(dtype))


def quantization_costs(
    ctx: Context,
    models: dict[str, tuple[ArchSpec, dict[str, torch.Tensor]]],
    exports: dict[str, Path],
    results: dict[str, Any],
    dtype: str,
    work: Path,
) -> None:
    """What the deployment's quantization costs on top of pruning, measured in llama.cpp: every
    model's held-out perplexity as an F16 GGUF and in ``dtype`` (llama.cpp's own quantizer), and
    lm-eval in ``dtype``. The parent is written and quantized here exactly as a student is on export;
    a student's ``dtype`` figures are those of its exported file (``accuracy_exported``). Recorded as
    ``results[name]["accuracy_quantization"]``."""
    import json
    import shutil

    import numpy as np

    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import gguf_heldout
    from autocompress_nemo.export.quantize import quant_record, quantize_gguf

    ev = ctx.cfg.evaluate
    batches = ctx.heldout_batches(2, int(ev.seq_len), int(ev.heldout_batches))
    by = f"llama.cpp (llama-cpp-python {_llama_cpp_version()}) on this CPU, F32 KV cache"
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name, (spec, sd) in models.items():
            r = results.get(name)
            if r is None or not spec.is_dense_layered():
                continue
            f16 = write_gguf(
                spec,
                work / f"{name}.f16.gguf",
                {k: v.float().numpy().astype(np.float32) for k, v in sd.items()},
                tokenizer_from=ctx.parent_gguf(),
                dtype="f16",
            )
            ctx.say(f"[evaluate] {name}: held-out perplexity of its F16 GGUF in llama.cpp")
            rec: dict[str, Any] = {"dtype": dtype, "measured_by": by, "f16": gguf_heldout(f16, batches)}
            on_file = r.get("accuracy_exported")
            export_dir = exports.get(name)
            if on_file is not None and export_dir is not None:
                q = dict(on_file)
                qj = ExportDir(export_dir).quantization
                if qj.is_file():
                    qrec = json.loads(qj.read_text())
                    q.update(bpw_matrices=qrec["bpw_matrices"], fallbacks=len(qrec["fallbacks"]))
            else:  # the parent (or a student exported without a GGUF): quantized here like an export
                path = work / f"{name}.{dtype}.gguf"
                qrec = quant_record(spec, quantize_gguf(f16, path, dtype), dtype)
                ctx.say(f"[evaluate] {name}: held-out perplexity and lm-eval of its {dtype} GGUF in llama.cpp")
                q = gguf_heldout(path, batches)
                q.update(
                    file=path.name,
                    bpw_matrices=qrec["bpw_matrices"],
                    fallbacks=len(qrec["fallbacks"]),
                    lm_eval=lm_eval_scores(ctx, GgufModel(path), gguf_forward),
                )
            rec[dtype] = q
            rec["ppl_increase"] = q["heldout_ppl"] / rec["f16"]["heldout_ppl"] - 1.0
            r["accuracy_quantization"] = rec
            ctx.say(
                f"[evaluate] {name}: ppl F16 {rec['f16']['heldout_ppl']:.3f} -> {dtype} {q['heldout_ppl']:.3f} "
                f"({100 * rec['ppl_increase']:+.2f} %) in llama.cpp"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def _entry(ctx: Context, out: Path, inp: Inputs) -> None:
    validation = inp.get("validate")
    students: dict[str, Path] = {}
    for m in inp.methods:  # each method's latest student (distilled, else reconstructed, else extracted)
        found = [inp.by_method.get(n, {}).get(m) for n in STUDENT.split("|")]
        if (p := next((f for f in found if f is not None), None)) is not None:
            students[m] = p
    run(
        ctx,
        out,
        ProfileDir(inp["profile"]),
        ValidateDir(validation) if validation else None,
        students,
        inp.by_method.get("extract", {}),
        inp.by_method.get("export", {}),
        inp.by_method.get("reconstruct", {}),
    )


STAGE = Stage(
    "evaluate",
    reads=reads(LAYOUT, DATA, "target", "evaluate"),
    needs=("profile", "rank", STUDENT, "extract"),
    optional=("validate", "export"),
    per_budget=True,
    script="the students scored in <run_dir>/evaluate and report.md / report.json",
    entry=_entry,
)

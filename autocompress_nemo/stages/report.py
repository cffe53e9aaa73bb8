"""report: ``report.md`` / ``report.json`` and the plots, read back from the run's artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autocompress_nemo.context import Context, read_json
from autocompress_nemo.stages.common import METHODS
from autocompress_nemo.stages.declare import Inputs, Stage
from autocompress_nemo.stages.layout import DistillDir, EvaluateDir, ProfileDir, SearchDir, ValidateDir


def run(ctx: Context, run_: Any, methods: list[str], validation: ValidateDir | None) -> Path:
    """``report.md`` / ``report.json`` and the plots in the run directory."""
    from autocompress_nemo.report import write_report

    results = collect_results(ctx, run_, methods, validation)
    write_report(run_.dir, results)
    return run_.dir / "report.md"


def _timing(prov: dict[str, Any], val: dict[str, Any], methods: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """The parent as timing reference in each timed stage (``costs/engines/paired.py``) and every flag."""
    verify = {}
    for m, rec in methods.items():
        rows = rec["arch"].get("verified_in_engine") or []
        if rows and rows[-1].get("reference"):
            verify[METHODS.get(m, m)] = rows[-1]["reference"]
    flags = [*(prov.get("reference") or {}).get("flags", []), *val.get("flags", []), *ev.get("flags", [])]
    for rec in methods.values():
        for r in rec["arch"].get("verified_in_engine") or []:
            flags += r.get("flags", [])
    return {
        "profile": prov.get("reference"),
        "validate": val.get("reference"),
        "verify": verify,
        "evaluate": ev.get("reference"),
        "flags": sorted(set(flags)),
    }


def collect_results(
    ctx: Context, run_: Any, methods: list[str], validation: ValidateDir | None, suffix: str = ""
) -> dict[str, Any]:
    """Everything the report shows, read back from the artifacts of this run (``suffix``: those of
    one budget of a family, ``@<budget>``)."""
    from autocompress_nemo.utils.artifacts import read_manifest

    d = run_.dir
    evaluation = EvaluateDir(d / f"evaluate{suffix}").evaluation
    ev = read_json(evaluation) if evaluation.is_file() else {}
    table = ProfileDir(d / "profile").table
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
        "after_local": ev.get("after_local", {}),
    }
    for m in methods:
        found = SearchDir(d / f"search_{m}{suffix}")
        if found.arch.is_file():
            rec = read_json(found.arch)
            dist = DistillDir(d / f"distill_{m}{suffix}").record
            res["methods"][m] = {
                "label": METHODS.get(m, m),
                "arch": rec,
                "trajectory": read_json(found.trajectory),
                "selection_tokens": rec.get("selection_tokens", 0),
                "recovery_tokens": read_json(dist).get("tokens", 0) if dist.is_file() else 0,
            }
            extracted = d / f"extract_{m}{suffix}" / "arch.json"
            if extracted.is_file() and (refit := read_json(extracted).get("refit")):
                res["methods"][m]["refit"] = refit
            local = d / f"reconstruct_{m}{suffix}" / "reconstruct.json"
            if local.is_file():
                res["methods"][m]["reconstruct"] = {k: v for k, v in read_json(local).items() if k != "history"}
    if validation is not None and validation.validation.is_file():
        res["validation"] = read_json(validation.validation)["summary"]
    from autocompress_nemo.report.outputs import collect_outputs

    res["outputs"] = collect_outputs(d, [f"{m}{suffix}" for m in methods])
    from autocompress_nemo.report.quality_curve import read_curve

    res["quality_curve"] = read_curve(d, suffix)
    res["timing"] = _timing(prov, res.get("validation") or {}, res["methods"], ev.get("timing") or {})
    for p in sorted(d.iterdir()):
        manifest = read_manifest(p) if p.is_dir() else None
        if manifest and ("@" not in p.name or p.name.endswith(suffix or "@")):  # a family: this budget's stages
            res["stages_wall_s"][p.name] = manifest.get("wall_s")
    return res


def run_family(ctx: Context, run_: Any, methods: list[str], validation: ValidateDir | None, family: list) -> Path:
    """A family's reports (``search.budgets``): every budget's own ``report@<budget>/report.md``, and
    ``report.md`` — the first budget's report with the family table (``report/family.py``) on top."""
    from autocompress_nemo.report import write_report
    from autocompress_nemo.report.family import family_rows
    from autocompress_nemo.report.quality_curve import read_curve

    results = []
    for member in family:
        view = Context(member.cfg, ctx.say).for_stage(STAGE.reads)
        res = collect_results(view, run_, methods, validation, member.suffix)
        if res["models"]:
            write_report(
                run_.dir / f"report{member.suffix}", {**res, "quality_curve": read_curve(run_.dir, member.suffix, up=1)}
            )
        results.append((member, res))
    main = dict(results[0][1])
    main["family"] = family_rows(results, methods)
    write_report(run_.dir, main)
    return run_.dir / "report.md"


def _entry(ctx: Context, run_dir: Path, inp: Inputs) -> Path:
    validation = inp.get("validate")
    v = ValidateDir(validation) if validation else None
    members = inp.shared.get("members")
    if members:
        return run_family(ctx, inp.run, inp.methods, v, members)
    return run(ctx, inp.run, inp.methods, v)


STAGE = Stage(
    "report",
    reads=("target",),
    needs=("profile", "evaluate"),
    optional=("validate",),
    cached=False,
    entry=_entry,
)
"""Not cached: it is rewritten at the end of every run from the artifacts."""

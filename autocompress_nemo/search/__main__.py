"""``python -m autocompress_nemo.search``: the whole pipeline, each stage one call.

    profile -> validate -> rank -> search -> extract -> distill -> export -> evaluate -> report

With no arguments it runs the embedded default (SmolLM2-135M-Instruct, the ``cpu_chat``
llama.cpp target, the standard-library corpus). ``baseline=true`` adds the Minitron++
student at the same budget and recovery tokens; ``search=minitron_pp`` makes the baseline
the main method. ``stages=[rank]`` runs (or reuses) only the named stages and what they
need; ``dry_run=true`` plans without weights. ``search.budgets=[0.45x,0.6x]`` makes a family: one
student per budget from one profile, rank and supernet (``search/family.py``). A stage whose artifact is complete for the
same inputs is skipped; a killed stage resumes from its checkpoint. What each stage reads
(and so what reruns it) is declared in its module under ``autocompress_nemo/stages/``.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from autocompress_nemo.config.entry import hydra_entry
from autocompress_nemo.context import Context
from autocompress_nemo.pipeline import Run
from autocompress_nemo.search.autocompress import ParentMeetsBudget
from autocompress_nemo.search.family import Member, members
from autocompress_nemo.stages import distill, evaluate, export, extract, profile, rank, report, search
from autocompress_nemo.stages.layout import DistillDir, ExtractDir, ProfileDir, RankDir, SearchDir, ValidateDir

TARGET_KEYS = ("target", "model")
LATER = {"rank", "search", "extract", "distill", "evaluate", "export"}


def run_pipeline(cfg: DictConfig) -> dict[str, Any]:
    if cfg.dry_run:
        from autocompress_nemo.plan.dry_run import run_dry_run

        return run_dry_run(cfg)
    cfg = with_profile_settings(cfg)
    run, ctx = Run(cfg), Context(cfg)
    ctx.say = run.say
    with run.session():  # one run per directory (a lock); leftovers of killed stages removed
        return _run_stages(cfg, run, ctx)


def _run_stages(cfg: DictConfig, run: Run, ctx: Context) -> dict[str, Any]:
    wanted = set(cfg.stages)
    out: dict[str, Any] = {"run_dir": str(run.dir)}

    prof = ProfileDir(run.run_stage(profile.STAGE, ctx, profile.run))
    if "validate" in wanted:
        vd: Path | None = run.run_stage(profile.VALIDATE, ctx, lambda c, d: profile.validate(c, d, prof), [prof.dir])
    else:  # not asked for: a complete one from an earlier invocation still counts (the search reads it)
        vd = run.reuse(profile.VALIDATE, [prof.dir])
    validation = ValidateDir(vd) if vd is not None else None
    if not wanted & LATER:
        return out
    ranked = RankDir(run.run_stage(rank.STAGE, ctx, rank.run))

    methods = [str(cfg.search.method)] + (
        ["minitron_pp"] if cfg.baseline and cfg.search.method != "minitron_pp" else []
    )
    family = members(cfg)
    if not family:
        ev = _students(cfg, run, ctx, methods, ranked, prof, validation)
        if ev is not None:
            out["evaluation"] = str(ev / "evaluation.json")
        if "report" in wanted or "evaluate" in wanted:
            out["report"] = str(report.run(ctx.for_stage(report.STAGE.reads), run, methods, validation))
        return out
    # a family (search.budgets): one student per budget from this profile, rank and one supernet
    first: SearchDir | None = None
    done: list[Member] = []
    out["evaluations"] = {}
    for member in family:
        run_b, ctx_b = run.for_budget(member.cfg, member.suffix), Context(member.cfg, run.say)
        ctx_b._shared = ctx._shared  # the parent, the corpus and the process groups are the family's
        run.say(f"[family] budget {member.value} ({'first: trains the supernet' if member.first else 'extra'})")
        try:
            searched: dict[str, SearchDir] = {}
            ev = _students(member.cfg, run_b, ctx_b, methods, ranked, prof, validation, first, searched)
        except ParentMeetsBudget as e:
            if member.first:
                raise
            run.say(f"[family] budget {member.value}: nothing to compress ({e})")
            continue
        if member.first:
            first = searched.get("autocompress")
        done.append(member)
        if ev is not None:
            out["evaluations"][str(member.value)] = str(ev / "evaluation.json")
    if out["evaluations"]:
        out["evaluation"] = next(iter(out["evaluations"].values()))
    if ("report" in wanted or "evaluate" in wanted) and done:
        out["report"] = str(report.run_family(ctx, run, methods, validation, done))
    return out


def _students(
    cfg: DictConfig,
    run: Run,
    ctx: Context,
    methods: list[str],
    ranked: RankDir,
    prof: ProfileDir,
    validation: ValidateDir | None,
    supernet: SearchDir | None = None,
    searched: dict[str, SearchDir] | None = None,
) -> Path | None:
    """search -> extract -> distill -> export of every method, then evaluate; the evaluate artifact
    (``None`` when not asked for). ``supernet``: the first budget's search of a family, whose
    supernet an AutoCompress search of a further budget trains its router on; ``searched`` receives
    every method's search artifact."""
    wanted = set(cfg.stages)
    students: dict[str, Path] = {}
    extracted: dict[str, Path] = {}
    for m in methods:
        if not wanted & (LATER - {"rank"}):
            break
        inputs = [ranked.dir, prof.dir] + ([validation.dir] if validation else [])
        net = supernet if m == "autocompress" else None
        if net is not None:  # the first budget's supernet: its checksums are part of this search's key
            inputs.append(net.dir)
        try:
            found = SearchDir(
                run.run_stage(
                    search.STAGE,
                    ctx,
                    lambda c, d, m=m, i=inputs, n=net: search.run(
                        c, d, m, ranked, prof, validation, run.checkpoint(search.STAGE, i, m), n
                    ),
                    inputs,
                    m,
                )
            )
        except ValueError as e:
            if m == str(cfg.search.method):
                raise
            run.say(f"[search_{m}{run.suffix}] baseline not run: {e}")  # e.g. no uniform architecture meets the budget
            continue
        if searched is not None:
            searched[m] = found
        student = run.run_stage(
            extract.STAGE, ctx, lambda c, d, f=found: extract.run(c, d, ranked, f), [ranked.dir, found.dir], m
        )
        extracted[m] = student
        if "distill" in wanted:
            student = run.run_stage(
                distill.STAGE,
                ctx,
                lambda c, d, s=student, m=m: distill.run(
                    c, d, ranked, ExtractDir(s), run.checkpoint(distill.STAGE, [ranked.dir, s], m)
                ),
                [ranked.dir, student],
                m,
            )
        students[m] = student
    exports: dict[str, Path] = {}
    if "export" in wanted:  # before evaluate: the accuracy of the exported file is measured there
        for m, s in students.items():
            exports[m] = run.run_stage(export.STAGE, ctx, lambda c, d, s=s: export.run(c, d, DistillDir(s)), [s], m)
    if "evaluate" in wanted and students:
        return run.run_stage(
            evaluate.STAGE,
            ctx,
            lambda c, d: evaluate.run(c, d, prof, validation, students, extracted, exports),
            [ranked.dir, prof.dir, *students.values(), *extracted.values(), *exports.values()]
            + ([validation.dir] if validation else []),
        )
    return None


def with_profile_settings(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose ``target.engine.settings`` include the search preset's
    ``profile_settings`` (derived here, once, so every stage sees the same engine settings)."""
    extra = cfg.search.get("profile_settings") or {}
    if not extra:
        return cfg
    out = copy.deepcopy(cfg)
    with open_dict(out.target.engine.settings):  # a free-form dict of the schema: new keys are expected
        for k, v in extra.items():
            out.target.engine.settings[k] = v
    return out


def _task(cfg: DictConfig) -> dict[str, Any]:
    """Bad input (an impossible budget, a missing file, a table for another target) ends with
    its message, not a traceback; ``AUTOCOMPRESS_DEBUG=1`` shows the traceback. A filesystem error
    (not writable, disk full) is one line naming the path. A budget the parent already meets stops
    cleanly (exit status 0, nothing to compress). A student over a budget in the evaluation exits
    with ``fail_exit_code`` (default 3). An engine that crashed, hung past ``target.engine.timeout_s``
    or refused a model exits 4 with the engine's own stderr tail (``costs/engines/worker.py``)."""
    from autocompress_nemo.costs.engines.worker import EngineWorkerError
    from autocompress_nemo.rundir import describe_os_error, disk_error

    try:
        out = run_pipeline(cfg)
    except ParentMeetsBudget as e:
        print(f"autocompress: nothing to compress: {e}", flush=True)
        sys.exit(0)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("AUTOCOMPRESS_DEBUG"):
            raise
        print(f"autocompress: error: {e}\n(run with AUTOCOMPRESS_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
    except EngineWorkerError as e:  # the engine crashed, hung or refused: its own stderr tail, no traceback
        if os.environ.get("AUTOCOMPRESS_DEBUG"):
            raise
        print(f"autocompress: engine error: {e}", file=sys.stderr)
        sys.exit(4)
    except (OSError, RuntimeError) as e:  # not writable, read-only, disk full: the path, not a traceback
        code = disk_error(e)
        if os.environ.get("AUTOCOMPRESS_DEBUG") or not (isinstance(e, OSError) or code):
            raise
        if not isinstance(e, OSError):  # a library's text: the path is the run directory's
            e = OSError(code, os.strerror(code), f"{cfg.run_dir} (writing: {str(e).splitlines()[0][:120]})")
        print(f"autocompress: error: {describe_os_error(e)}", file=sys.stderr)
        sys.exit(2)
    failed = failing_students(out)
    if failed and int(cfg.fail_exit_code):
        print(
            f"autocompress: FAIL: {'; '.join(failed)} (exit status {int(cfg.fail_exit_code)}; "
            "fail_exit_code=0 exits 0)",
            file=sys.stderr,
        )
        sys.exit(int(cfg.fail_exit_code))
    return out


def failing_students(out: dict[str, Any]) -> list[str]:
    """``"<student>: <metric> <measured> > <budget>"`` for every student the evaluation found over a budget."""
    import json

    paths = out.get("evaluations") or ({"": out["evaluation"]} if out.get("evaluation") else {})
    failed: list[str] = []
    for budget, path in paths.items():
        if not Path(path).is_file():
            continue
        models = json.loads(Path(path).read_text()).get("models", {})
        failed += [
            f"{name}{f' (budget {budget})' if budget else ''} misses its budget: "
            + ", ".join(
                f"{k} {c['measured']:.4g} (budget {c['budget']:.4g})" for k, c in checks.items() if not c["pass"]
            )
            for name, r in models.items()
            if name != "parent"
            and (checks := r.get("budget_check") or {})
            and not all(c["pass"] for c in checks.values())
        ]
    return failed


main = hydra_entry(_task, lock_run_dir=True)

if __name__ == "__main__":
    main()

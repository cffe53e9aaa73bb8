"""``python -m autocompress_nemo.search``: the whole pipeline, each stage one call.

    profile -> validate -> rank -> search -> extract -> distill -> export -> evaluate -> report

With no arguments it runs the embedded default (SmolLM2-135M-Instruct, the ``cpu_chat``
llama.cpp target, the standard-library corpus). ``baseline=true`` adds the Minitron++
student at the same budget and recovery tokens; ``search=minitron_pp`` makes the baseline
the main method. ``stages=[rank]`` runs (or reuses) only the named stages and what they
need; ``dry_run=true`` plans without weights. A stage whose artifact is complete for the
same inputs is skipped; a killed stage resumes from its checkpoint.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from autocompress_nemo import stages
from autocompress_nemo.config.entry import hydra_entry
from autocompress_nemo.context import Context
from autocompress_nemo.pipeline import Run

TARGET_KEYS = ("target", "model")


def run_pipeline(cfg: DictConfig) -> dict[str, Any]:
    if cfg.dry_run:
        from autocompress_nemo.plan.dry_run import run_dry_run

        return run_dry_run(cfg)
    cfg = with_profile_settings(cfg)
    run, ctx = Run(cfg), Context(cfg)
    ctx.say = run.say
    wanted = set(cfg.stages)
    out: dict[str, Any] = {"run_dir": str(run.dir)}

    # profile + validate: the cost table of the target and its measured error
    prof = run.stage("profile", lambda d: _profile(cfg, d), ("target", "model", "search.ffn_options"), rank0_only=True)
    table = prof / "cost_table" / "cost_table.json"
    validation = vdir = None
    if "validate" in wanted:
        validation = run.stage(
            "validate", lambda d: _validate(cfg, table, d), ("target", "model", "seed"), [prof], rank0_only=True
        )
        vdir = validation / "validation"
    if not wanted & {"rank", "search", "extract", "distill", "evaluate", "export"}:
        return out

    ranked = run.stage(
        "rank",
        lambda d: stages.rank(ctx, d),
        (
            "model",
            "data",
            "search.calib_sequences",
            "search.seq_len",
            "search.batch_size",
            "search.search_hidden",
            "seed",
        ),
    )
    methods = [str(cfg.search.method)] + (
        ["minitron_pp"] if cfg.baseline and cfg.search.method != "minitron_pp" else []
    )
    students: dict[str, Path] = {}
    extracted: dict[str, Path] = {}
    for m in methods:
        if not wanted & {"search", "extract", "distill", "evaluate", "export"}:
            break
        inputs = [ranked, prof] + ([validation] if validation else [])
        try:
            arch = run.stage(
                f"search_{m}",
                lambda d, m=m: stages.search(ctx, d, m, ranked, table, vdir, run.ckpt_dir(f"search_{m}")),
                ("target", "search", "seed"),
                inputs,
            )
        except ValueError as e:
            if m == str(cfg.search.method):
                raise
            run.say(f"[search_{m}] baseline not run: {e}")  # e.g. no uniform architecture meets the budget
            continue
        student = run.stage(f"extract_{m}", lambda d, a=arch: stages.extract(ctx, d, ranked, a), (), [ranked, arch])
        extracted[m] = student
        if wanted & {"distill", "evaluate", "export"} and "distill" in wanted:
            student = run.stage(
                f"distill_{m}",
                lambda d, s=student, m=m: stages.distill(ctx, d, ranked, s, run.ckpt_dir(f"distill_{m}")),
                ("distill", "data", "seed"),
                [ranked, student],
            )
        students[m] = student
    exports: dict[str, Path] = {}
    if "export" in wanted:  # before evaluate: the accuracy of the exported file is measured there
        for m, s in students.items():
            exports[m] = run.stage(f"export_{m}", lambda d, s=s: stages.export(ctx, d, s), ("target.engine",), [s])
    if "evaluate" in wanted and students:
        ev = run.stage(
            "evaluate",
            lambda d: stages.evaluate(ctx, d, ranked, table, vdir, students, extracted, exports),
            ("target", "evaluate"),
            [ranked, prof, *students.values(), *extracted.values(), *exports.values()]
            + ([validation] if validation else []),
        )
        out["evaluation"] = str(ev / "evaluation.json")
    if "report" in wanted or "evaluate" in wanted:
        out["report"] = str(stages.report(ctx, run, methods, vdir))
    return out


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


def _profile(cfg: DictConfig, d: Path) -> None:
    from autocompress_nemo.profile.stage import run_profile

    run_profile(cfg, d)


def _validate(cfg: DictConfig, table: Path, d: Path) -> None:
    from autocompress_nemo.profile.stage import run_validate

    run_validate(cfg, table, d)


def _task(cfg: DictConfig) -> dict[str, Any]:
    """Bad input (an impossible budget, a missing file, a table for another target) ends with
    its message, not a traceback; ``AUTOCOMPRESS_DEBUG=1`` shows the traceback."""
    try:
        return run_pipeline(cfg)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("AUTOCOMPRESS_DEBUG"):
            raise
        print(f"autocompress: error: {e}\n(run with AUTOCOMPRESS_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)


main = hydra_entry(_task)

if __name__ == "__main__":
    main()

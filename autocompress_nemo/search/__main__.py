"""``python -m autocompress_nemo.search``: the whole pipeline, each stage one call.

    profile -> validate -> rank -> search -> extract -> reconstruct -> distill -> export -> evaluate -> report

(`autocompress --graph` prints the graph the runner walks, read from the stages' declarations.)

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
from autocompress_nemo.runner import walk
from autocompress_nemo.search.autocompress import ParentMeetsBudget

TARGET_KEYS = ("target", "model")


def run_pipeline(cfg: DictConfig) -> dict[str, Any]:
    """Every stage ``cfg.stages`` asks for (and what they need), walked from the stages'
    declarations (``runner.py``); returns the run's outputs and ``record`` (one row per stage)."""
    if cfg.dry_run:
        from autocompress_nemo.plan.dry_run import run_dry_run

        return run_dry_run(cfg)
    cfg = with_profile_settings(cfg)
    run, ctx = Run(cfg), Context(cfg)
    ctx.say = run.say
    with run.session():  # one run per directory (a lock); leftovers of killed stages removed
        return walk(cfg, run, ctx)


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


def print_record(out: dict[str, Any]) -> None:
    """The runner's record, one line per stage: what ran, what was reused, in how long."""
    rows = out.get("record") or []
    if not rows:
        return
    print("autocompress: stages", flush=True)
    for r in rows:
        secs = f"{r['seconds']:.1f} s" if isinstance(r.get("seconds"), float) else ""
        why = f"  ({r['why']})" if r.get("why") and r["status"] in ("passed", "dropped", "failed") else ""
        print(f"  {r['stage']:<28} {r['status']:<8} {secs:>10}{why}", flush=True)


def _main_task(cfg: DictConfig) -> dict[str, Any]:
    out = _task(cfg)
    print_record(out)
    return out


_hydra_main = hydra_entry(_main_task, lock_run_dir=True)


def main() -> None:
    """The pipeline; ``--graph [text|mermaid]`` prints the stage graph instead."""
    if "--graph" in sys.argv[1:]:
        from autocompress_nemo.stages.graph import render

        rest = sys.argv[sys.argv.index("--graph") + 1 :]
        print(render(rest[0] if rest and not rest[0].startswith("-") else "text"))
        return
    _hydra_main()


if __name__ == "__main__":
    main()

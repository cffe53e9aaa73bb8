"""The per-stage console scripts: each is the pipeline (``python -m autocompress_nemo.search``)
restricted to one stage and the stages it reads.

    autocompress-profile [validate] [overrides]   # stages=[profile] / stages=[profile,validate]
    autocompress-rank [overrides]                 # stages=[rank]
    autocompress-extract [overrides]              # stages=[profile,validate,rank,search,extract]
    autocompress-distill [overrides]              # ... + distill
    autocompress-export [overrides]               # ... + distill, export
    autocompress-evaluate [overrides]             # every stage (evaluate reads them all)

``python -m autocompress_nemo.<stage>`` is the same program. Because it *is* the pipeline, a
standalone stage writes its artifact where the pipeline keeps it (``<run_dir>/<stage>``), with
the same manifest and config hash, so a later full run reuses it (``[<stage>] skipped``); what
it reads is reused when complete and computed otherwise. A ``stages=[...]`` given on the
command line replaces the script's list.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from autocompress_nemo.stages import graph

VALIDATE_ARGS = ("validate", "mode=validate", "+mode=validate", "++mode=validate")
"""``autocompress-profile validate`` (or ``mode=validate``) adds the validate stage."""


@dataclass(frozen=True)
class Script:
    stage: str
    stages: tuple[str, ...]
    what: str

    @property
    def name(self) -> str:
        return f"autocompress-{self.stage}"

    def stage_list(self) -> str:
        """``[a,b]`` in the pipeline's order."""
        return "[" + ",".join(self.stages) + "]"

    def help_line(self, stages: str | None = None) -> str:
        what = "profile and validate stages" if stages == "[profile,validate]" else f"{self.stage} stage"
        return (
            f"{self.name} (python -m autocompress_nemo.{self.stage}): runs the pipeline's {what} "
            f"(python -m autocompress_nemo.search stages={stages or self.stage_list()} [overrides]): {self.what}"
        )

    def upstream_line(self, stages: str | None = None) -> str:
        """What the script runs before its own stage (each reused when complete, computed otherwise)."""
        chosen = (stages or self.stage_list()).strip("[]").split(",")
        run = [s for s in graph.closure(chosen) if graph.by_name()[s].cached]
        at = run.index(self.stage) if self.stage in run else len(run)
        before, rest = run[:at], run[at:] or [self.stage]
        if not before:
            return f"{self.name}: runs {', '.join(rest)}" + (" only" if len(rest) == 1 else "")
        return (
            f"{self.name}: runs {', '.join(before)} first (each reused when its artifact is complete for the same "
            f"inputs, computed otherwise), then {', '.join(rest)}"
        )


def _scripts() -> dict[str, Script]:
    """One script per declared stage with a ``script`` text: its stage, everything it needs and
    what those read when present (``validate``, which the search reads)."""
    out = {}
    for s in graph.stages():
        if not s.script:
            continue
        need = graph.with_optional([s.name])
        out[s.name] = Script(s.name, tuple(n for n in need if graph.by_name()[n].cached), s.script)
    return out


SCRIPTS: dict[str, Script] = _scripts()


def argv_for(script: Script, argv: list[str]) -> list[str]:
    """The pipeline's command line for ``script`` called with ``argv`` (``argv[0]`` is the program).

    Adds ``stages=[...]`` unless the user chose stages, and names the Hydra job (the log file in
    the run directory) after the stage. For ``profile`` the word ``validate`` adds the validate stage.
    """
    args = list(argv[1:])
    stages = script.stage_list()
    if script.stage == "profile" and any(a in VALIDATE_ARGS for a in args):
        args = [a for a in args if a not in VALIDATE_ARGS]
        stages = "[profile,validate]"
    if not any(a.lstrip("+").startswith("stages=") for a in args):
        args.append(f"stages={stages}")
    if not any(a.lstrip("+").startswith("hydra.job.name=") for a in args):
        args.append(f"hydra.job.name={script.stage}")
    return [argv[0], *args]


def run_script(stage: str) -> None:
    """Run the pipeline for ``stage``'s script with the current ``sys.argv``. Returns None, so
    that the console script's ``sys.exit(main())`` exits 0 (bad input exits 2 in the pipeline)."""
    from autocompress_nemo.search.__main__ import main as pipeline_main

    script = SCRIPTS[stage]
    chosen = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.lstrip("+").startswith("stages=")), None)
    validate = stage == "profile" and any(a in VALIDATE_ARGS for a in sys.argv[1:])
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(script.help_line(chosen or ("[profile,validate]" if validate else None)))
        print()
    else:  # never start upstream stages silently
        print(script.upstream_line(chosen or ("[profile,validate]" if validate else None)), flush=True)
    sys.argv = argv_for(script, sys.argv)
    pipeline_main()


def _entry(stage: str) -> Callable[[], None]:
    def main() -> None:
        run_script(stage)

    main.__name__ = f"{stage}_main"
    main.__doc__ = SCRIPTS[stage].help_line()
    return main


profile_main = _entry("profile")
rank_main = _entry("rank")
extract_main = _entry("extract")
distill_main = _entry("distill")
export_main = _entry("export")
evaluate_main = _entry("evaluate")

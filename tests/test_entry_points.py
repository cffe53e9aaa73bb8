"""Every console script runs: each ``[project.scripts]`` entry of ``pyproject.toml`` (read from the
file, so a new entry is covered without touching this test) resolves to a callable and ``--help``
exits 0 saying what it runs; a standalone stage writes the artifact the full pipeline reuses."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from autocompress_nemo.cli import SCRIPTS, VALIDATE_ARGS, argv_for
from tests.cfg_utils import TINY_ROOFLINE, recorded, statuses

ROOT = Path(__file__).resolve().parents[1]
PROJECT_SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
HYDRA_HELP = "--cfg job prints the composed config"  # the footer of the pipeline's help (conf/run.yaml)
TINY = TINY_ROOFLINE  # as tests/test_pipeline.py: an analytic cost model, so no engine is needed


def _call(target: str, prog: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Call ``module:attr`` as the console script wrapper does: ``sys.exit(main())``."""
    module, attr = target.split(":")
    code = (
        "import sys\n"
        f"from {module} import {attr} as main\n"
        "assert callable(main), main\n"
        f"sys.argv = [{prog!r}, *sys.argv[1:]]\n"
        "sys.exit(main())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_every_stage_script_is_declared() -> None:
    for stage in SCRIPTS:
        assert PROJECT_SCRIPTS[f"autocompress-{stage}"] == f"autocompress_nemo.{stage}.__main__:main"
    assert PROJECT_SCRIPTS["autocompress"] == "autocompress_nemo.search.__main__:main"


@pytest.mark.parametrize("name", sorted(PROJECT_SCRIPTS))
def test_script_resolves_and_help_exits_0(name: str) -> None:
    r = _call(PROJECT_SCRIPTS[name], name, ["--help"], timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    first = r.stdout.splitlines()[0] if r.stdout else ""
    stage = name.removeprefix("autocompress-")
    if stage in SCRIPTS:  # the line says which stage and which pipeline command it runs
        assert first.startswith(f"{name} (python -m autocompress_nemo.{stage}): runs the pipeline's {stage} stage")
        assert f"stages={SCRIPTS[stage].stage_list()}" in first
        assert HYDRA_HELP in r.stdout  # then the pipeline's own help: every group and override
    elif name == "autocompress":
        assert first.startswith("autocompress-nemo:"), first
        assert HYDRA_HELP in r.stdout
    else:
        assert name in r.stdout, r.stdout[:500]


def test_script_stage_lists() -> None:
    """A standalone stage runs what the full pipeline would have run before it (the search reads the
    validation, so every student includes it), in the pipeline's order; the user's stages win."""
    assert argv_for(SCRIPTS["rank"], ["p", "seed=1"]) == ["p", "seed=1", "stages=[rank]", "hydra.job.name=rank"]
    assert argv_for(SCRIPTS["export"], ["p"])[1] == (
        "stages=[profile,validate,rank,search,extract,reconstruct,distill,export]"
    )
    assert argv_for(SCRIPTS["evaluate"], ["p"])[1] == (
        "stages=[profile,validate,rank,search,extract,reconstruct,distill,export,evaluate]"
    )
    assert argv_for(SCRIPTS["distill"], ["p", "stages=[distill]"])[1:2] == ["stages=[distill]"]
    for word in VALIDATE_ARGS:  # ``autocompress-profile validate`` is taken off before Hydra sees it
        assert argv_for(SCRIPTS["profile"], ["p", word, "seed=1"]) == [
            "p",
            "seed=1",
            "stages=[profile,validate]",
            "hydra.job.name=profile",
        ]
    assert argv_for(SCRIPTS["profile"], ["p"])[1] == "stages=[profile]"
    assert "runs the pipeline's profile and validate stages" in SCRIPTS["profile"].help_line("[profile,validate]")


@pytest.mark.slow  # ~40 s: two processes (profile + validate, rank) and the pipeline
def test_standalone_profile_and_rank_are_what_the_pipeline_reuses(tmp_path, capsys) -> None:
    """``autocompress-profile validate`` then ``python -m autocompress_nemo.rank`` on the tiny model,
    each in its own process: the artifacts land in ``<run_dir>/{profile,validate,rank}`` and the
    pipeline on the same run directory skips all three."""
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    run_dir = tmp_path / "run"
    common = [*TINY, f"run_dir={run_dir}"]
    prof = _call(PROJECT_SCRIPTS["autocompress-profile"], "autocompress-profile", ["validate", *common])
    assert prof.returncode == 0, (prof.stdout[-3000:], prof.stderr[-3000:])
    assert statuses(recorded(run_dir)) == {"profile": "ran", "validate": "ran"}, prof.stdout
    assert (run_dir / "profile" / "cost_table" / "cost_table.json").is_file()
    assert (run_dir / "validate" / "validation" / "validation.json").is_file()

    rank = subprocess.run(
        [sys.executable, "-m", "autocompress_nemo.rank", *common],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert rank.returncode == 0, (rank.stdout[-3000:], rank.stderr[-3000:])
    assert statuses(recorded(run_dir)) == {"rank": "ran"}, rank.stdout  # rank needs no profile
    assert (run_dir / "rank" / "model.safetensors").is_file()
    assert not any(p.name.startswith("search") for p in run_dir.iterdir())

    out = run_pipeline(compose([*common, "stages=[profile,validate,rank]"]))
    assert statuses(out) == dict.fromkeys(("profile", "validate", "rank"), "skipped")


def test_a_stage_script_says_what_it_runs_first() -> None:
    """``autocompress-export`` on an empty run directory never starts the pipeline silently: its first
    line names the stages it runs before its own (read from the graph), each reused when complete."""
    line = SCRIPTS["export"].upstream_line()
    assert line.startswith(
        "autocompress-export: runs profile, validate, rank, search, extract, reconstruct, distill first"
    )
    assert line.endswith("then export") and "reused when its artifact is complete" in line
    assert SCRIPTS["rank"].upstream_line() == "autocompress-rank: runs rank only"
    assert SCRIPTS["profile"].upstream_line("[profile,validate]") == "autocompress-profile: runs profile, validate"

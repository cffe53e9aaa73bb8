"""The pipeline's bookkeeping on a tiny model (analytic cost model, so no engine is needed):
a rerun with the same inputs skips every stage; a truncated artifact is detected by its
checksum and recomputed (with everything downstream), never used; an impossible budget
stops before any training with the smallest reachable cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from autocompress_nemo.config.entry import compose
from tests.cfg_utils import TINY_ROOFLINE, statuses, why

TINY = [
    *TINY_ROOFLINE,
    "search.steps=4",
    "stages=[profile,rank,search,extract]",
]


def _run(tmp_path, capsys, extra=()):
    from autocompress_nemo.search.__main__ import run_pipeline

    cfg = compose([*TINY, f"run_dir={tmp_path}/run", *extra])
    out = run_pipeline(cfg)
    return out, capsys.readouterr().out


STAGES = ("profile", "rank", "search_autocompress", "extract_autocompress")


def test_rerun_skips_and_corruption_recomputes(tmp_path, capsys) -> None:
    first, _ = _run(tmp_path, capsys)
    assert statuses(first) == dict.fromkeys(STAGES, "ran")  # exactly these, in the record
    assert [r["stage"] for r in first["record"]] == list(STAGES)
    second, _ = _run(tmp_path, capsys)
    assert statuses(second) == dict.fromkeys(STAGES, "skipped")
    # truncate the sorted parent: the checksum catches it, rank reruns, and so does what reads it
    from autocompress_nemo.utils.artifacts import sha256_file

    weights = tmp_path / "run" / "rank" / "model.safetensors"
    good = sha256_file(weights)
    weights.write_bytes(weights.read_bytes()[:100])
    third, _ = _run(tmp_path, capsys)
    assert statuses(third)["profile"] == "skipped"
    assert statuses(third)["rank"] == "ran" and "checksum mismatch (truncated or corrupted)" in why(third, "rank")
    # rank is deterministic: the recomputed sorted parent is byte-identical, so what reads it is still valid
    assert sha256_file(weights) == good
    assert statuses(third)["search_autocompress"] == "skipped"
    # a truncated search artifact is recomputed too, and what reads it (its content changed: new manifest) as well
    arch = tmp_path / "run" / "search_autocompress" / "arch.json"
    arch.write_text(arch.read_text()[:50])
    fourth, _ = _run(tmp_path, capsys)
    assert statuses(fourth)["search_autocompress"] == "ran" and "arch.json: checksum mismatch" in why(
        fourth, "search_autocompress"
    )
    assert statuses(fourth)["rank"] == "skipped"
    # the record is also in the run directory
    import json

    assert json.loads((tmp_path / "run" / "record.json").read_text())["stages"] == fourth["record"]


def test_changed_config_reruns_downstream_only(tmp_path, capsys) -> None:
    _run(tmp_path, capsys)
    out, _ = _run(tmp_path, capsys, ["search.slack=0.1"])
    assert statuses(out)["profile"] == "skipped" and statuses(out)["rank"] == "skipped"
    assert statuses(out)["search_autocompress"] == "ran" and "config changed" in why(out, "search_autocompress")


def test_impossible_budget_stops_before_training(tmp_path, capsys) -> None:
    from autocompress_nemo.search.__main__ import run_pipeline

    cfg = compose(
        [
            *TINY,
            f"run_dir={tmp_path}/run",
            "budget@target.budget=decode_0.6x",
            "target.budget.constraints.0.value=0.0001",
        ]
    )
    with pytest.raises(
        ValueError, match=r"infeasible budget: the smallest architecture in the search space costs decode_ms="
    ):
        run_pipeline(cfg)
    assert not (tmp_path / "run" / "search_autocompress").exists()
    assert not (tmp_path / "run" / "search_autocompress.ckpt" / "checkpoints").exists()  # no router step ran


def test_quick_preset_lightens_profiling_only_through_a_copy() -> None:
    from autocompress_nemo.search.__main__ import with_profile_settings

    cfg = compose(["search=quick"])
    quick = with_profile_settings(cfg)
    assert quick.target.engine.settings.rounds == 1 and quick.target.engine.settings.validate_random == 3
    assert cfg.target.engine.settings.rounds != 1  # the composed config is not mutated
    default = compose([])
    assert with_profile_settings(default) is default


def test_artifact_version_bump_recomputes_that_stage(tmp_path, capsys, monkeypatch) -> None:
    """A rank artifact written by code with another artifact layout is recomputed, not read."""
    from autocompress_nemo import pipeline

    _run(tmp_path, capsys)
    monkeypatch.setitem(pipeline.ARTIFACT_VERSIONS, "rank", pipeline.ARTIFACT_VERSIONS["rank"] + 1)
    again, _ = _run(tmp_path, capsys)
    assert statuses(again)["profile"] == "skipped"
    assert statuses(again)["rank"] == "ran" and "config changed" in why(again, "rank")


def _stage_on_rank(rank: int, world: int, run_dir: str, late: bool = False) -> dict:
    from omegaconf import OmegaConf

    from autocompress_nemo.pipeline import Run

    run = Run(OmegaConf.create({"run_dir": run_dir, "x": 1}), say=lambda s: None)
    calls = []

    def fn(d):  # noqa: ANN001, ANN202
        calls.append(rank)
        (d / "out.txt").write_text("done")

    if rank == 1 and late:  # rank 0 has written the artifact by the time this rank looks
        import time

        deadline = time.monotonic() + 3
        while not (Path(run_dir) / "profile" / "out.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    final = run.stage("profile", fn, ("x",), rank0_only=True)
    return {"calls": calls, "written": (final / "out.txt").read_text()}


@pytest.mark.distributed
def test_rank0_only_stage_runs_once_and_every_rank_sees_it(tmp_path) -> None:
    """Engine profiling runs on rank 0 alone; the other ranks wait and then read its artifact."""
    from autocompress_nemo.distributed.spawn import spawn

    out = spawn(_stage_on_rank, 2, str(tmp_path / "run"))
    assert [o["calls"] for o in out] == [[0], []]
    assert all(o["written"] == "done" for o in out)


@pytest.mark.distributed
def test_a_rank_that_looks_after_rank0_wrote_still_meets_it_at_the_barrier(tmp_path) -> None:
    """Whether a stage is skipped is rank 0's decision: a rank that arrived after rank 0 had written
    the artifact used to see it complete, skip the barrier and leave rank 0 waiting on a closed
    connection (a CI failure of test_rank0_only_stage_runs_once_and_every_rank_sees_it)."""
    from autocompress_nemo.distributed.spawn import spawn

    out = spawn(_stage_on_rank, 2, str(tmp_path / "run"), True)
    assert [o["calls"] for o in out] == [[0], []]
    assert all(o["written"] == "done" for o in out)


def test_a_stage_alone_runs_without_the_optional_inputs_it_cannot_reuse(tmp_path) -> None:
    """``stages=[rank]`` on an empty run directory: rank runs; validate (an optional input of later
    stages) is neither run nor demanded (it failed with "its input profile did not run" before)."""
    from autocompress_nemo.search.__main__ import run_pipeline

    out = run_pipeline(compose([*TINY_ROOFLINE, "stages=[rank]", f"run_dir={tmp_path}/run"]))
    assert statuses(out) == {"rank": "ran"}

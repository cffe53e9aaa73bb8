"""A run directory that never lies (issue 19): one run at a time (a lock naming its holder; a dead
holder's lock is taken over), leftovers of killed stages removed on start, a finished run's config
record never overwritten by a later (rejected) command, everything the run writes under
``run_dir``, filesystem errors as one line naming the path, a FAIL verdict in the exit status, and
a budget the parent already meets stopping cleanly."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autocompress_nemo.config.entry import compose
from autocompress_nemo.rundir import LOCK, RunDirError, acquire_lock, clean_leftovers, release_lock
from tests.cfg_utils import TINY_ROOFLINE, recorded, run_cli, statuses

PROFILE_ONLY = [*TINY_ROOFLINE, "stages=[profile]"]
HOLD = (
    "import sys, time; from autocompress_nemo.rundir import acquire_lock; "
    "acquire_lock(sys.argv[1]); print('held', flush=True); time.sleep(60)"
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/run``'s lock (the real locking code, in another process)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    yield run_dir, p.pid
    p.kill()
    p.wait()


def test_a_second_run_on_a_directory_refuses_naming_the_holder(holder) -> None:
    from autocompress_nemo.search.__main__ import run_pipeline

    run_dir, pid = holder
    with pytest.raises(RunDirError, match=rf"is in use by another run \(pid {pid}, started"):
        run_pipeline(compose([*PROFILE_ONLY, f"run_dir={run_dir}"]))
    assert not (run_dir / "profile").exists()
    assert json.loads((run_dir / LOCK).read_text())["pid"] == pid  # the holder's lock is untouched


def test_a_second_run_refuses_on_the_command_line_before_writing_its_config(holder) -> None:
    run_dir, pid = holder
    r = run_cli(*PROFILE_ONLY, f"run_dir={run_dir}", cwd=run_dir.parent)
    assert r.returncode == 2, r.stderr
    assert f"is in use by another run (pid {pid}" in r.stderr and "Traceback" not in r.stderr
    assert not (run_dir / ".hydra").exists() and not (run_dir / "profile").exists()


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "earlier"}))
    said: list[str] = []
    acquire_lock(run_dir, say=said.append)
    try:
        assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
        assert said == [f"[run] taking over the stale lock of pid {dead.pid} (no such process): {run_dir / LOCK}"]
    finally:
        release_lock(run_dir)
    assert not (run_dir / LOCK).exists()


def test_leftovers_of_killed_stages_are_removed_on_start_and_the_run_writes_only_under_run_dir(
    tmp_path, capsys
) -> None:
    from autocompress_nemo.search.__main__ import run_pipeline

    run_dir = tmp_path / "run"
    (run_dir / "rank.tmp-999999").mkdir(parents=True)  # a killed stage's artifact in the making
    (run_dir / "rank.tmp-999999" / "model.safetensors").write_bytes(b"half")
    (run_dir / "search_autocompress.ckpt").mkdir()
    (run_dir / "search_autocompress.ckpt" / ".router.pt.tmp-999998").write_bytes(b"half")
    (run_dir / "keep.tmp-notapid").write_text("not ours")  # not a leftover's name: kept
    run_pipeline(compose([*TINY_ROOFLINE, "search.steps=2", "stages=[profile,rank]", f"run_dir={run_dir}"]))
    out = capsys.readouterr().out
    assert "[run] removed 2 leftover(s) of killed stages: rank.tmp-999999" in out, out
    assert not (run_dir / "rank.tmp-999999").exists()
    assert not (run_dir / "search_autocompress.ckpt" / ".router.pt.tmp-999998").exists()
    assert (run_dir / "keep.tmp-notapid").exists()
    assert not (run_dir / LOCK).exists()  # released at the end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing beside the run directory
    assert any((run_dir / ".cache" / "tokens").iterdir())  # the token cache lives in it


def test_clean_leftovers_keeps_those_of_live_processes(tmp_path) -> None:
    """A live process's temporary may be another rank of this job writing: only the dead's go."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine, theirs = tmp_path / f"x.tmp-{os.getpid()}", tmp_path / f"z.tmp-{other.pid}"
        mine.mkdir()
        theirs.write_text("being written")
        (tmp_path / "y.old-123456789").mkdir()
        gone = clean_leftovers(tmp_path, say=lambda s: None)
        assert gone == [tmp_path / "y.old-123456789"] and mine.exists() and theirs.exists()
    finally:
        other.kill()
        other.wait()


@pytest.mark.slow
def test_a_rejected_command_leaves_a_finished_runs_config_record(tmp_path) -> None:
    run_dir = tmp_path / "run"
    r = run_cli(*PROFILE_ONLY, f"run_dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    record = run_dir / ".hydra" / "config.yaml"
    before = record.read_bytes()
    for bad in (["distill.lr=nan"], ["+search.stepz=3"], ["model=nope"]):
        r = run_cli(*PROFILE_ONLY, f"run_dir={run_dir}", *bad, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert record.read_bytes() == before, bad
    # an accepted command writes its own record; the previous one is kept in .hydra/history
    r = run_cli(*PROFILE_ONLY, f"run_dir={run_dir}", "seed=7", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert b"seed: 7" in record.read_bytes()
    (old,) = (run_dir / ".hydra" / "history").iterdir()
    assert (old / "config.yaml").read_bytes() == before


def test_cfg_job_and_help_work_wherever_they_are_placed(tmp_path) -> None:
    r = run_cli("model=tiny_llama", "--cfg", "job", "seed=5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "name: tiny_llama" in r.stdout and "seed: 5" in r.stdout
    r = run_cli("model=tiny_llama", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "autocompress-nemo: hardware-guided compression" in r.stdout, r.stderr
    assert not any(tmp_path.iterdir())  # printing writes nothing


def test_flags_first_keeps_flag_values_and_overrides() -> None:
    from autocompress_nemo.config.entry import flags_first

    assert flags_first(["a=1", "--cfg", "job", "b=2", "--info", "defaults", "~c", "-m"]) == [
        "--cfg",
        "job",
        "--info",
        "defaults",
        "-m",
        "a=1",
        "b=2",
        "~c",
    ]
    assert flags_first(["x=1", "--info"]) == ["--info", "x=1"]


# -- exit status, filesystem errors, a budget the parent meets --------------------------------------------
def _evaluation(path: Path, student_pass: bool) -> dict:
    """An ``evaluation.json`` as the evaluate stage writes it (``stages/evaluate.py``: budget_check)."""
    check = lambda ok: {"decode_ms": {"budget": 1.0, "measured": 0.9 if ok else 1.2, "predicted": 0.95, "pass": ok}}  # noqa: E731
    path.write_text(
        json.dumps(
            {
                "models": {
                    "parent": {"budget_check": check(False)},
                    "autocompress": {"budget_check": check(student_pass)},
                }
            }
        )
    )
    return {"evaluation": str(path)}


@pytest.mark.parametrize(
    ("student_pass", "extra", "code"),
    [(False, [], 3), (False, ["fail_exit_code=5"], 5), (False, ["fail_exit_code=0"], None), (True, [], None)],
)
def test_a_fail_verdict_sets_the_exit_status(tmp_path, monkeypatch, capsys, student_pass, extra, code) -> None:
    import autocompress_nemo.search.__main__ as pipeline

    out = _evaluation(tmp_path / "evaluation.json", student_pass)
    monkeypatch.setattr(pipeline, "run_pipeline", lambda cfg: out)
    cfg = compose([*PROFILE_ONLY, f"run_dir={tmp_path}/run", *extra])
    if code is None:
        assert pipeline._task(cfg) == out
        return
    with pytest.raises(SystemExit) as e:
        pipeline._task(cfg)
    assert e.value.code == code
    err = capsys.readouterr().err
    assert "autocompress: FAIL: autocompress misses its budget: decode_ms 1.2 (budget 1)" in err
    assert "parent" not in err.split("FAIL:")[1]  # the parent's own verdict is not the student's


FULL_DISK = {
    "OSError": (
        lambda out: OSError(errno.ENOSPC, "No space left on device", str(out / "cost_table" / "cost_table.json")),
        "cost_table.json; free space on that disk",
    ),
    "torch's RuntimeError": (
        lambda out: RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: file write failed"
        ),
        "(writing: [enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0",
    ),
}


@pytest.mark.parametrize("kind", sorted(FULL_DISK))
def test_a_full_disk_mid_stage_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys, kind) -> None:
    import autocompress_nemo.search.__main__ as pipeline
    from autocompress_nemo.stages import profile

    error, expected = FULL_DISK[kind]

    def full(ctx, out):
        (out / "part.bin").write_bytes(b"x")
        raise error(out)

    monkeypatch.setattr(profile, "run", full)
    with pytest.raises(SystemExit) as e:
        pipeline._task(compose([*PROFILE_ONLY, f"run_dir={tmp_path}/run"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autocompress: error: No space left on device (ENOSPC): ") and "\n" not in err, err
    assert expected in err, err
    assert [p.name for p in (tmp_path / "run").iterdir() if "tmp" in p.name] == []  # the partial artifact is gone


def test_an_unrelated_runtime_error_keeps_its_traceback(tmp_path, monkeypatch) -> None:
    import autocompress_nemo.search.__main__ as pipeline
    from autocompress_nemo.stages import profile

    def bug(ctx, out):
        raise RuntimeError("shape mismatch in some kernel")

    monkeypatch.setattr(profile, "run", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        pipeline._task(compose([*PROFILE_ONLY, f"run_dir={tmp_path}/run"]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_parent_is_named_up_front(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run_cli(*PROFILE_ONLY, f"run_dir={ro}/run", cwd=tmp_path)
    finally:
        ro.chmod(0o755)
    assert r.returncode == 2 and "is not writable" in r.stderr and "Traceback" not in r.stderr


def test_a_budget_the_parent_already_meets_stops_cleanly(tmp_path, capsys) -> None:
    import autocompress_nemo.search.__main__ as pipeline

    run_dir = tmp_path / "run"
    cfg = compose(
        [*TINY_ROOFLINE, "target.budget.constraints.0.value=2.0x", "stages=[profile,rank,search,extract]"]
        + [f"run_dir={run_dir}"]
    )
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        pipeline._task(cfg)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "autocompress: nothing to compress: the parent 4 x [A4h2kv F192]" in out, out
    assert "already meets every budget (decode_ms " in out and "tighten target.budget" in out
    assert statuses(recorded(run_dir)).get("search_autocompress") == "failed", out  # stopped before training
    assert "search step" not in out
    assert not (run_dir / "search_autocompress").exists() and not (run_dir / "extract_autocompress").exists()
    assert time.time() - t0 < 120


def test_an_unwritable_parent_is_named_up_front(tmp_path, monkeypatch, capsys) -> None:
    """What a non-root user sees for a read-only parent (``os.access`` says so; root writes anyway)."""
    import autocompress_nemo.rundir as rundir
    from autocompress_nemo.search.__main__ import main

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(rundir.os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    monkeypatch.setattr(sys, "argv", ["autocompress_nemo.search", *PROFILE_ONLY, f"run_dir={ro}/run"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"run_dir={ro}/run: {ro} (where {ro}/run would be created) is not writable" in err, err
    assert "Traceback" not in err and not (ro / "run").exists()

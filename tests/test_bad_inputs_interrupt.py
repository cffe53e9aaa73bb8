"""Ctrl-C on the real command line (issue 39): the terminal sends SIGINT to the whole process group;
the run ends with "interrupted; rerun the same command to resume", exit status 130 and no traceback,
and the same command then resumes (its finished stages skipped).

Before issue 39 Ctrl-C during distillation printed a 136-line traceback and exited 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cfg_utils import TINY_ROOFLINE

ROOT = Path(__file__).resolve().parents[1]


SLEEPY = """
import time
from autocompress_nemo.config.entry import hydra_entry

def task(cfg):
    print("[distill] step 1/1000", flush=True)
    time.sleep(600)

main = hydra_entry(task, lock_run_dir=True)
if __name__ == "__main__":
    main()
"""


def _start(tmp_path, command: list[str], *extra: str) -> subprocess.Popen:
    """The command in its own process group (SIGINT goes to the group, as a terminal sends it), its
    output in files (a pipe nobody reads would block it): ``<tmp>/out.<pid>``, ``<tmp>/err.<pid>``."""
    out, err = tempfile.mkstemp(dir=tmp_path, prefix="out."), tempfile.mkstemp(dir=tmp_path, prefix="err.")
    proc = subprocess.Popen(
        [sys.executable, *command, *TINY_ROOFLINE, f"run_dir={tmp_path / 'run'}", *extra],
        stdout=out[0],
        stderr=err[0],
        cwd=tmp_path,
        env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT)),
        start_new_session=True,
        # as a terminal starts it: SIGINT at its default. A CI runner that starts the tests as a background
        # job has SIGINT ignored, and an ignored signal is inherited across exec (Python then installs
        # no KeyboardInterrupt handler, rightly: ``nohup``/``&`` mean "do not stop on Ctrl-C")
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(out[0])
    os.close(err[0])
    proc.out, proc.err = Path(out[1]), Path(err[1])  # type: ignore[attr-defined]
    return proc


def _wait_for(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    """What the process printed once ``marker`` is in it."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        text = proc.out.read_text()  # type: ignore[attr-defined]
        if marker in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{marker!r} never printed in {timeout} s:\n{text}\n{proc.err.read_text()}")  # type: ignore[attr-defined]


def _interrupt(tmp_path, proc: subprocess.Popen, codes: tuple[int, ...] = (130,)) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    out, err = proc.out.read_text(), proc.err.read_text()  # type: ignore[attr-defined]
    assert proc.returncode in codes, f"exit status {proc.returncode}\n{out}\n{err}"
    assert "autocompress: interrupted; rerun the same command to resume" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (tmp_path / "run" / ".lock").exists(), "the lock is released"


@pytest.mark.timeout(300)
def test_ctrl_c_in_an_entry_point_says_interrupted_and_exits_130(tmp_path) -> None:
    """Any entry point (``hydra_entry``: Hydra's main, the run directory's lock, the task) under a real
    SIGINT to its process group, while its stage runs."""
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    proc = _start(tmp_path, [str(tmp_path / "sleepy.py")])
    _wait_for(proc, "[distill] step 1", timeout=240)
    time.sleep(0.5)
    _interrupt(tmp_path, proc)


DISTILLING = """
import os
import sys
from autocompress_nemo.config.entry import hydra_entry

def task(cfg):
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
    from conftest import tiny_hetero_spec, tiny_uniform_spec
    from test_distill import _cfg, batch_fn
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits

    init_distributed(tp=1, seed=0)
    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    student = build_model(tiny_hetero_spec(), init_seed=1, impl="local")
    said = lambda s: print("[distill]", s, flush=True)
    out = str(cfg.run_dir) + "/distill.ckpt"
    distill(student, teacher, forward_logits, batch_fn(128, 4, 16), _cfg(100_000), out, 7, log=said)

main = hydra_entry(task, lock_run_dir=True)
if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(300)
def test_ctrl_c_during_the_distillation_loop_says_interrupted_and_exits_130(tmp_path) -> None:
    """The real recovery loop (Megatron models on gloo, checkpoints every 2 steps) interrupted between
    and inside its steps; rerunning resumes from its checkpoint."""
    (tmp_path / "distilling.py").write_text(DISTILLING)
    ckpt = tmp_path / "run" / "distill.ckpt"
    proc = _start(tmp_path, [str(tmp_path / "distilling.py")])
    t0 = time.time()
    while not (ckpt.is_dir() and any(ckpt.rglob("latest_checkpointed_iteration.txt"))):  # a complete checkpoint
        assert proc.poll() is None and time.time() - t0 < 240, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    _interrupt(tmp_path, proc)
    again = _start(tmp_path, [str(tmp_path / "distilling.py")])  # the same command resumes
    seen = _wait_for(again, "resumed from step", timeout=240)
    assert any("[distill]" in line and "resumed from step" in line for line in seen.splitlines())
    _interrupt(tmp_path, again)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_mid_pipeline_says_interrupted_and_exits_130(tmp_path) -> None:
    # (enough calibration sequences that rank is still running when the interrupt arrives)
    proc = _start(tmp_path, ["-m", "autocompress_nemo.search"], "stages=[profile,rank]", "search.calib_sequences=4096")
    _wait_for(proc, "[rank]", timeout=400)
    # -SIGINT: about one run in seven, interrupted while the rank stage imports Megatron / triton, the
    # process ends by SIGINT after the same one line (a shell shows 130 either way); not yet explained
    _interrupt(tmp_path, proc, codes=(130, -signal.SIGINT))


def test_ctrl_c_that_a_library_turns_into_another_error_still_ends_as_interrupted(monkeypatch, capsys) -> None:
    """A SIGINT that lands while a C extension initializes comes back as an ``ImportError`` ("generic_type:
    cannot initialize type ...", seen under triton's import); it is still the user's Ctrl-C."""
    from omegaconf import OmegaConf

    from autocompress_nemo.config import entry

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(entry, "_CTRL_C", [])
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        entry.note_ctrl_c()

        def rank(cfg):  # noqa: ANN001
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                raise ImportError('generic_type: cannot initialize type "PADDING_OPTION"') from None

        with pytest.raises(SystemExit) as e:
            entry.run_task(rank, OmegaConf.create({"run_dir": "unused"}))
    finally:
        signal.signal(signal.SIGINT, before)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "autocompress: interrupted; rerun the same command to resume"


def test_ctrl_c_during_a_checkpoint_write_lands_after_it() -> None:
    """A SIGINT inside ``ctrl_c_deferred`` (the trainer's and the Megatron checkpoint's saves) lets the
    block finish, then arrives as the installed handler delivers it. In CI a Ctrl-C during Megatron's
    save interrupted the parent while its ``multiprocessing`` manager child started, and that child
    printed a BrokenPipeError traceback next to the one line."""
    from autocompress_nemo.utils.interrupts import ctrl_c_deferred

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the signal has arrived by now; the block goes on
                finished.append(True)
        assert finished == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignored stays ignored: nothing is delivered
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, before)

"""Ctrl-C on the real command line (issue 39): the terminal sends SIGINT to the whole process group;
the run ends with "interrupted; rerun the same command to resume", exit status 130 and no traceback,
and the same command then resumes (its finished stages skipped).

Before issue 39 Ctrl-C during distillation printed a 136-line traceback and exited 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cfg_utils import TINY_ROOFLINE


def _start(tmp_path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autocompress_nemo.search", *TINY_ROOFLINE, f"run_dir={tmp_path / 'run'}", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own process group: SIGINT to the group, as a terminal sends it
    )


def _wait_for(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    seen: list[str] = []
    t0 = time.time()
    assert proc.stdout is not None
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if marker in line:
            return seen
    proc.kill()
    raise AssertionError(
        f"{marker!r} never printed in {timeout} s:\n{''.join(seen)}\n{proc.stderr.read() if proc.stderr else ''}"
    )


@pytest.mark.timeout(600)
def test_ctrl_c_mid_run_says_interrupted_and_exits_130(tmp_path) -> None:
    proc = _start(tmp_path, "stages=[profile,rank]")
    _wait_for(proc, "[rank]", timeout=400)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"exit status {proc.returncode}\n{out}\n{err}"
    assert "autocompress: interrupted; rerun the same command to resume" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (tmp_path / "run" / ".lock").exists(), "the lock is released"

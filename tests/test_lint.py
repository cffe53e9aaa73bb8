"""``make lint`` in the suite (so CI runs it): ruff's lint and format check on the code, and mypy on
the package (the ``[tool.mypy]`` section of pyproject.toml) find no error. mypy's full run takes
about two minutes on two cores (less with its cache)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


PATHS = ["autocompress_nemo", "launchers", "tests", "bench"]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the dev extra")
@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_no_error(check: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", *check, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff {' '.join(check)} exit {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is in the dev extra")
def test_mypy_finds_no_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "autocompress_nemo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, f"mypy exit {r.returncode}:\n" + "\n".join(out.splitlines()[-60:])

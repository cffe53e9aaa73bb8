"""``make lint``'s type check: mypy on the package (the ``[tool.mypy]`` section of pyproject.toml)
finds no error. A full run takes about two minutes on two cores (less with mypy's cache)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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

"""Config sections for tests built from the real schema (``autocompress_nemo.config.schema``), never
hand-written stand-ins: a field renamed or removed in the schema fails here (``TypeError`` from the
dataclass), and a value of the wrong type fails at assignment, instead of a test passing on a
config the code never sees."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from autocompress_nemo.config.schema import SearchConfig

TINY_ROOFLINE = [
    "model=tiny_llama",
    "+target=tiny_cpu",
    "engine@target.engine=roofline",
    "target.hardware.peak_tflops=0.2",
    "target.hardware.mem_bandwidth_gbs=20",
    "search=quick",
]
"""Overrides of the tiny pipeline tests: the tiny Llama on an analytic cost model (no engine)."""

ROUTER = dict(
    router_lr=0.1,
    weight_lr=1e-4,
    train_weights=False,
    tau_start=2.0,
    tau_end=0.2,
    penalty_over=20.0,
    penalty_under=2.0,
    slack=0.05,
    kd_temperature=1.0,
)
"""The router settings the tiny method tests share (fast convergence on a 3-layer model)."""


def search_cfg(**fields: Any) -> DictConfig:
    """The ``search`` section as the stages read it: ``SearchConfig(**fields)``, typed."""
    return OmegaConf.structured(SearchConfig(**fields))


def run_cli(*args: str, cwd: Any, timeout: int = 300) -> Any:
    """``python -m autocompress_nemo.search ARGS`` in ``cwd`` as a user runs it (a ``CompletedProcess``
    with text output; Hydra's own tracebacks off, so what the user sees is what is checked)."""
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "autocompress_nemo.search", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
        timeout=timeout,
    )


def statuses(out: dict[str, Any]) -> dict[str, str]:
    """``{stage directory: status}`` from the runner's record (``runner.py``): ``ran``, ``skipped``,
    ``reused``, ``failed``, ``passed``, ``dropped`` — what ran, read from the record, not the log."""
    return {r["stage"]: r["status"] for r in out["record"]}


def why(out: dict[str, Any], stage: str) -> str:
    """Why the record says ``stage`` ran again (``recomputing: ...``), or ``""``."""
    return next((str(r.get("why") or "") for r in out["record"] if r["stage"] == stage), "")


def recorded(run_dir: Any) -> dict[str, Any]:
    """The last invocation's record read back from ``<run_dir>/record.json`` as ``{"record": rows}``
    (for :func:`statuses` / :func:`why`): what a run over a subprocess or a CLI did."""
    import json
    from pathlib import Path

    return {"record": json.loads((Path(run_dir) / "record.json").read_text())["stages"]}

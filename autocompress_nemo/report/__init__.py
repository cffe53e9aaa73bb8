"""The run report: ``report.md``, ``report.json`` and PNG plots in the run directory.

``write_report(run_dir, results) -> dict[str, Path]`` — every key below is optional unless
marked *required*; a missing section (no baseline, no lm-eval tasks, no engine measurement)
is shown as "not run" and its plot is skipped with the reason recorded.

``results`` schema::

    {
      "run": {"name": str, "command": str, "created": str, "seed": int},
      "target": {                                   # the deployment the budgets belong to
        "name": str, "description": str,
        "hardware": {"device": str, ...},            # target.hardware as a dict
        "engine": {"name": str, "version": str, "dtype": str, ...},
        "workload": {"batch": int, "input_len": int, "output_len": int, "context_len": int},
        "budgets": [{"metric": str, "value": str | float,  # as configured ("0.6x" or absolute)
                     "absolute": float | None}],   # resolved against the parent measured the same way
      },
      "models": {                                   # *required*: at least "parent" or one student
        "parent" | "autocompress" | "minitron_pp": {
          "arch": dict,                            # ArchSpec.to_dict(): per-block widths and params
          "params": int,                           # default: counted from "arch"
          "predicted": {metric: float, "memory": {part: bytes}, "source": str},
          "engine_check": dict,                    # evaluate.engine_check(...) output, which gives
                                                   #   measured (+ source), checks, pass; or give
          "measured": {metric: float, "memory": {...}, "source": str},   # ... these three directly
          "checks": [{"metric", "value", "budget", "measured", "predicted", "pass"}],
          "pass": bool | None,
          "accuracy": {"perplexity": float, "perplexity_tokens": int, "heldout": str,
                       "lm_eval": {task: {metric: float}}},
          "recovery_tokens": int,
          "distill": {"first_loss": float, "final_loss": float, "steps": int, "tokens_per_s": float},
        },
      },
      "cost_model_validation": {"errors": {metric: {"mape": %, "max_ape": %, "bias": %, "n": int}},
                                "source": str, "n_models": int},
      "tokens": {"search": int, "minitron_scoring": int, "recovery": int},
      "wall_time_s": {stage: seconds},
      "search_trajectory": [{"step", "tau", "kd", "penalty", "entropy",
                             "expected_<metric>", "budget_<metric>"}],   # as the search writes it
      "notes": [str],
    }

The layout the pipeline's ``stages.report.collect_results`` writes (``methods``, ``budgets``,
``measured_by``, ``budget_check``, ``stages_wall_s``...) is also accepted: ``report/compat.py``
maps it onto this schema.

Metrics: ``prefill_ms``, ``decode_ms``, ``response_latency_ms``, ``throughput_tps``,
``memory_bytes`` (and the aliases ``ttft_ms``/``tpot_ms``). Provenance: every cost figure is
printed with its ``source`` — ``"measured in <engine> <version> on <device>"`` or
``"estimated, not measured"``; a figure without a source is printed as "source not recorded".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autocompress_nemo.report.plots import write_plots
from autocompress_nemo.report.sections import render_markdown
from autocompress_nemo.report.tables import MODEL_ORDER, normalize
from autocompress_nemo.utils.artifacts import write_json_atomic, write_text_atomic


def write_report(run_dir: str | os.PathLike[str], results: dict[str, Any]) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and the PNG plots into ``run_dir``; return their paths.

    ``results`` follows the schema in the module docstring. Raises ``ValueError`` naming the
    problem when ``results`` has no model at all.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    res = normalize(results)
    if not res["models"]:
        raise ValueError(
            f"write_report: results['models'] has none of {MODEL_ORDER}; nothing to report "
            "(give at least the parent or one student)"
        )
    plots, skipped = write_plots(run, res)
    res["plots"] = {k: p.name for k, p in plots.items()}
    res["plots_skipped"] = skipped
    write_text_atomic(run / "report.md", render_markdown(res))
    write_json_atomic(run / "report.json", res)
    return {"report.md": run / "report.md", "report.json": run / "report.json", **plots}


__all__ = ["write_report"]

"""Evaluate a student (or the parent): held-out perplexity, lm-eval tasks, and the
measurement in the target's engine against each budget.

- ``perplexity(model, forward, token_batches) -> float``
- ``TorchLM(model, forward, tokenizer)``: an ``lm_eval`` ``LM``; ``run_lm_eval(...)`` runs tasks
- ``engine_check(spec, target, ...)``: measured costs vs budgets, next to the prediction

``lm_eval`` is imported only when the adapter is used.
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.evaluate.engine_check import budget_checks, engine_check, measured_figures
from autocompress_nemo.evaluate.perplexity import nll_sum, perplexity


def __getattr__(name: str) -> Any:
    if name in ("TorchLM", "run_lm_eval"):
        from autocompress_nemo.evaluate import lm_eval_adapter

        return getattr(lm_eval_adapter, name)
    raise AttributeError(f"module 'autocompress_nemo.evaluate' has no attribute {name!r}")


__all__ = ["TorchLM", "budget_checks", "engine_check", "measured_figures", "nll_sum", "perplexity", "run_lm_eval"]

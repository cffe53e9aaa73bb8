"""Steps that were silent for minutes now say where they are, with a count that never passes its total:
Minitron++ candidate retraining and scoring (``search/minitron.steps_logged``) and lm-eval scoring
(``evaluate/lm_eval_adapter._Progress``). The guard and repair judges: ``tests/test_judge_batched.py``;
profile / validate: ``tests/test_profile_progress.py``."""

from __future__ import annotations

import re

import pytest

from autocompress_nemo.search.minitron import steps_logged

COUNT = re.compile(r"(\d+)/(\d+)")


def _counts(lines: list[str]) -> list[tuple[int, int]]:
    return [tuple(map(int, COUNT.findall(ln)[-1])) for ln in lines]  # type: ignore[misc]


def test_minitron_steps_are_logged_up_to_their_total() -> None:
    lines: list[str] = []
    got = list(steps_logged(range(24), 24, "[minitron++ candidate 1/3] retraining step", lines.append))
    assert got == list(range(24))
    assert _counts(lines) == [(6, 24), (12, 24), (18, 24), (24, 24)]
    lines.clear()
    list(steps_logged(range(7), 5, "scoring batch", lines.append))  # more items than announced
    assert all(d <= t for d, t in _counts(lines)) and _counts(lines)[-1] == (5, 5)


def test_lm_eval_progress_counts_up_to_its_total() -> None:
    pytest.importorskip("lm_eval")
    from autocompress_nemo.evaluate.lm_eval_adapter import _Progress

    lines: list[str] = []
    p = _Progress("lm-eval parent", "sequences scored", 40, lines.append)
    for done in range(8, 57, 8):  # batches of 8, the last call past the total
        p(done)
    assert _counts(lines) == [(16, 40), (24, 40), (32, 40), (40, 40)]
    quiet: list[str] = []
    _Progress("lm-eval parent", "sequences scored", 10, quiet.append)(10)  # a short call says nothing
    assert not quiet

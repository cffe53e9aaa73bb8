"""The generated stdlib_next_line lm-eval task: items are well formed and lm-eval scores the
true line (a model that knows the text picks it)."""

from __future__ import annotations

import json

import pytest

from autocompress_nemo.evaluate.stdlib_task import TASK, make_items, write_task

TEXTS = ["\n".join(f"line_{d}_{i} = compute({i}, {d}) + offset" for i in range(40)) for d in range(5)]


def test_items_have_the_true_next_line() -> None:
    items = make_items(TEXTS, 10, seed=0)
    assert len(items) == 10
    for it in items:
        last = it["context"].splitlines()[-1]
        d, i = (int(x) for x in last.split(" = ")[0].split("_")[1:])
        assert it["choices"][it["label"]] == f"line_{d}_{i + 1} = compute({i + 1}, {d}) + offset"
        assert len(set(it["choices"])) == 4
    assert make_items(TEXTS, 10, seed=0) == items  # deterministic


def test_short_held_out_documents_are_refused_by_name() -> None:
    """Documents of at most ``context_lines`` lines give no item: said with the fix, never an empty
    task file that lm-eval fails on (``StopIteration`` deep inside ``datasets``)."""
    short = ["\n".join(f"x_{d}_{i} = compute({i})" for i in range(12)) for d in range(8)]
    with pytest.raises(ValueError, match=r"no held-out document is longer than 12 lines.*lm_eval_tasks=\[\]"):
        make_items(short, 10, seed=0)


def test_lm_eval_scores_an_oracle(tmp_path) -> None:
    """An oracle LM that gives the true continuation the highest likelihood scores acc 1.0,
    so the task's fields (context, choices, label) reach lm-eval as intended."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.model import LM

    from autocompress_nemo.evaluate.lm_eval_adapter import task_manager

    d = write_task(tmp_path / "tasks", TEXTS, n_items=12, seed=1)
    truth = {}
    for line in open(d / f"{TASK}.jsonl"):
        it = json.loads(line)
        truth[it["context"]] = it["choices"][it["label"]]

    class Oracle(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            return [(0.0 if truth.get(r.args[0]) == r.args[1] else -10.0, False) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise AssertionError("not used")

        def generate_until(self, requests, disable_tqdm=False):
            raise AssertionError("not used")

    tm = task_manager(str(d), [TASK])
    assert set(tm.all_tasks) == {TASK}  # only the local directory indexed, not lm-eval's own ~14k entries
    res = lm_eval.simple_evaluate(model=Oracle(), tasks=[TASK], task_manager=tm, bootstrap_iters=0)
    assert res["results"][TASK]["acc,none"] == 1.0


def test_a_task_that_is_not_local_gets_lm_evals_own_index(tmp_path) -> None:
    pytest.importorskip("lm_eval")
    from autocompress_nemo.evaluate.lm_eval_adapter import task_manager

    d = write_task(tmp_path / "tasks", TEXTS, n_items=12, seed=1)
    known = set(task_manager(str(d), [TASK, "arc_easy"]).all_tasks)
    assert {TASK, "arc_easy"} <= known

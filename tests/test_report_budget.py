"""What the user reads tells the truth at a glance (issue 37, item 5).

- ``accuracy_vs_cost.png`` draws the budget PASS / FAIL was decided on: as a ratio to the parent
  measured in the same rounds when the engine check recorded one (the case of the issue: a profile-time
  budget of 7.835 ms, an evaluate-time budget of 7.991 ms, a passing student at 7.984 ms that sat to
  the right of the old line), else the evaluate-time absolute budget, never the profile-time one.
- The parent is the budgets' reference: its check rows read "reference", not FAIL.
- The search's first line names a uniform parent as ``30 x [A9h3kv F1536]``, not thirty strings.
"""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import compact_runs, describe
from autocompress_nemo.report import write_report
from autocompress_nemo.report.plots import accuracy_points
from autocompress_nemo.report.sections import render_markdown
from autocompress_nemo.report.tables import normalize

PARENT = ArchSpec.llama(hidden=576, vocab=49152, layers=30, heads=9, kv_groups=3, ffn=1536, name="smollm2")
PROFILE_TIME_BUDGET = 7.835
EVALUATE_TIME_BUDGET = 7.991
PARENT_NOW = EVALUATE_TIME_BUDGET / 0.6
MEASURED = "measured in llama-cpp-python 0.3.36 on CPU x86_64, 2 cores"


def _check(measured: float, ratios: bool) -> dict:
    c = {
        "budget": EVALUATE_TIME_BUDGET,
        "measured": measured,
        "predicted": measured * 0.99,
        "pass": measured <= EVALUATE_TIME_BUDGET,
    }
    if ratios:
        c.update(ratio=measured / PARENT_NOW, budget_ratio=EVALUATE_TIME_BUDGET / PARENT_NOW)
    return c


def _results(ratios: bool = True) -> dict:
    """The layout ``stages.report.collect_results`` writes (``report/compat.py``)."""

    def model(measured: float, ppl: float) -> dict:
        return {
            "spec": PARENT.to_dict(),
            "params": 134_515_008,
            "accuracy": {"heldout_ppl": ppl},
            "predicted": {"decode_ms": measured * 0.99},
            "measured": {"decode_ms": measured},
            "measured_by": "llama-cpp-python 0.3.36 on CPU x86_64, 2 cores",
            "budget_check": {"decode_ms": _check(measured, ratios)},
        }

    return {
        "target": {"name": "cpu_chat", "engine": "llama_cpp"},
        "budgets": {"decode_ms": PROFILE_TIME_BUDGET},
        "budget_reference": "0.6x",
        "models": {"parent": model(PARENT_NOW, 20.4), "autocompress": model(7.984, 31.0)},
        "stages_wall_s": {"rank": 1.0},
    }


def test_the_plot_draws_the_budget_pass_was_decided_on_as_a_ratio_to_the_parent(tmp_path: Path) -> None:
    res = normalize(_results())
    metric, axis, budget, _, pts = accuracy_points(res)
    x = {k: v for k, _, v, _, _ in pts}
    assert (metric, axis) == ("decode_ms", "ratio")
    assert budget is not None and abs(budget - 0.6) < 1e-12
    assert x["parent"] == 1.0
    assert x["autocompress"] <= budget  # the passing student sits left of its budget line
    assert res["models"]["autocompress"]["pass"] is True
    paths = write_report(tmp_path, _results())
    assert paths["accuracy_vs_cost"].stat().st_size > 0


def test_without_ratios_the_plot_draws_the_evaluate_time_budget_not_the_profile_time_one() -> None:
    metric, axis, budget, where, pts = accuracy_points(normalize(_results(ratios=False)))
    x = {k: v for k, _, v, _, _ in pts}
    assert axis == "absolute" and budget == EVALUATE_TIME_BUDGET != PROFILE_TIME_BUDGET
    assert x["autocompress"] <= budget < PROFILE_TIME_BUDGET + 1  # 7.984 <= 7.991 (the old line: 7.835)
    assert "engine check" in where


def test_the_parent_is_the_reference_not_a_fail() -> None:
    res = normalize(_results())
    parent = res["models"]["parent"]
    assert parent["pass"] is None
    assert all(c["pass"] is None and c.get("reference") for c in parent["checks"])
    md = render_markdown(res)
    rows = [ln for ln in md.splitlines() if ln.startswith("| Parent |") and "≤" in ln]
    assert rows and all("FAIL" not in r and "reference" in r for r in rows), rows
    student = [ln for ln in md.splitlines() if ln.startswith("| AutoCompress |") and "≤" in ln]
    assert student and all("PASS" in r for r in student), student


def test_a_uniform_parent_is_described_once_with_its_count() -> None:
    assert describe(PARENT) == "30 x [A9h3kv F1536]"
    child = PARENT.replace_block(5, PARENT.blocks[5].__class__(512))
    assert describe(child) == "2 x [A9h3kv F1536] A9h3kv F512 27 x [A9h3kv F1536]"
    assert compact_runs(["M", "E", "M", "E", "*", "E"]) == "2 x [M E] * E"
    assert compact_runs(["a"]) == "a" and compact_runs([]) == ""

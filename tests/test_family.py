"""A family from one search (``search.budgets``, issue 17): one profile, one rank, one supernet, one
student per budget — each searched, extracted, recovered, measured and reported side by side; every
budget after the first trains only its own router on the first budget's supernet (fewer tokens);
adding a budget reuses the others' artifacts; a bad list is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autocompress_nemo.config.entry import compose
from tests.cfg_utils import TINY_ROOFLINE, statuses, why

FAMILY = [
    *TINY_ROOFLINE,
    "search.steps=8",
    "search.train_weights=true",
    "distill.tokens=1024",
    "evaluate.lm_eval_tasks=[]",
    "evaluate.heldout_batches=1",
    "evaluate.seq_len=64",
    "stages=[profile,rank,search,extract,distill,evaluate]",
]
BUDGETS = ["0.45x", "0.75x"]


def _run(run_dir: Path, capsys, *extra: str) -> tuple[dict, str]:
    from autocompress_nemo.search.__main__ import run_pipeline

    out = run_pipeline(compose([*FAMILY, f"run_dir={run_dir}", *extra]))
    return out, capsys.readouterr().out


def _arch(run_dir: Path, budget: str) -> dict:
    return json.loads((run_dir / f"search_autocompress@{budget}" / "arch.json").read_text())


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[Path, dict]:
    """One family run of two budgets (shared by the tests below: about half a minute)."""
    from autocompress_nemo.search.__main__ import run_pipeline

    run_dir = tmp_path_factory.mktemp("family") / "run"
    out = run_pipeline(compose([*FAMILY, f"run_dir={run_dir}", f"search.budgets=[{','.join(BUDGETS)}]"]))
    return run_dir, out


def test_one_student_per_budget_on_one_supernet(family) -> None:
    run_dir, out = family
    names = {p.name for p in run_dir.iterdir()}
    assert {"profile", "rank"} <= names  # one profile, one rank
    for b in BUDGETS:  # one student per budget: searched, extracted, recovered, measured
        for stage in ("search_autocompress", "extract_autocompress", "distill_autocompress", "evaluate"):
            assert f"{stage}@{b}" in names
    assert not {"search_autocompress", "evaluate"} & names
    first, extra = _arch(run_dir, BUDGETS[0]), _arch(run_dir, BUDGETS[1])
    # the first budget trains the supernet and keeps it; the further one reads it and trains its router only
    assert first["family"]["first"] and first["family"]["supernet_trained"]
    supernet = run_dir / f"search_autocompress@{BUDGETS[0]}" / "supernet.safetensors"
    assert supernet.is_file()
    fam = extra["family"]
    assert fam["supernet_read"] and fam["supernet_from"] == str(supernet) and not fam["supernet_trained"]
    from autocompress_nemo.utils.artifacts import sha256_file

    assert fam["supernet_sha256"] == sha256_file(supernet)
    assert fam["router_steps"] == 8  # as many router steps as the first budget (search.steps)
    assert 0 < fam["search_tokens"] == first["family"]["search_tokens"]
    # each student's predicted cost meets its own budget; a larger budget keeps at least as many parameters
    params = []
    for b in BUDGETS:
        rec = _arch(run_dir, b)
        for metric, budget in rec["budgets"].items():
            assert rec["predicted"][metric] <= budget * (1 + 1e-9), (b, metric)
        ev = json.loads((run_dir / f"evaluate@{b}" / "evaluation.json").read_text())
        check = ev["models"]["autocompress"]["budget_check"]
        assert check and all(c["pass"] for c in check.values())
        params.append(ev["models"]["autocompress"]["params"])
        # settle judged the child on the sorted parent's weights, the ones extract slices (not the trained supernet)
        guard = json.loads((run_dir / f"extract_autocompress@{b}" / "arch.json").read_text())["quality_guard"]
        assert guard["sliced_kd"] == pytest.approx(guard["final_kd"], rel=1e-3, abs=1e-5)
    assert params == sorted(params) and params[0] < params[-1]
    a, b = (_arch(run_dir, x)["budgets"]["decode_ms"] for x in BUDGETS)
    assert a < b
    # the report: a family table, each budget's own report, the extra search cost
    report = (run_dir / "report.md").read_text()
    assert "## Family: one student per budget" in report and "Extra search cost per added budget:" in report
    assert "| budget when measured | measured | measured / parent |" in report  # the PASS is on the ratio
    for b in BUDGETS:
        assert (run_dir / f"report@{b}" / "report.md").is_file()
    rows = json.loads((run_dir / "report.json").read_text())["family"]
    assert [r["budget"] for r in rows] == BUDGETS and all(r["pass"] for r in rows)
    assert set(out["evaluations"]) == set(BUDGETS)


def test_adding_a_budget_runs_only_the_new_one(family, tmp_path, capsys) -> None:
    src, _ = family
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    out, _ = _run(run_dir, capsys, f"search.budgets=[{','.join(BUDGETS)},0.6x]")
    st = statuses(out)
    for b in BUDGETS:
        for stage in ("search_autocompress", "extract_autocompress", "distill_autocompress", "evaluate"):
            assert st[f"{stage}@{b}"] == "skipped", st
    for stage in ("search_autocompress", "extract_autocompress", "distill_autocompress", "evaluate"):
        assert st[f"{stage}@0.6x"] == "ran", st
    assert st["profile"] == "skipped" and st["rank"] == "skipped"
    new = _arch(run_dir, "0.6x")["family"]
    assert new["supernet_read"] and not new["first"]
    # changing only the router steps of the further budgets keeps the first budget (the supernet)
    out, _ = _run(run_dir, capsys, f"search.budgets=[{','.join(BUDGETS)}]", "search.family_steps=3")
    assert statuses(out)[f"search_autocompress@{BUDGETS[0]}"] == "skipped"
    assert statuses(out)[f"search_autocompress@{BUDGETS[1]}"] == "ran"
    assert "config changed" in why(out, f"search_autocompress@{BUDGETS[1]}")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["search.budgets=[0.45x,abc]"], "search.budgets[1]='abc'"),
        (["search.budgets=[0.45x,1.5x]"], "a factor of 1x or more"),
        (["search.budgets=[0.45x,0.45x]"], "repeats search.budgets[0]"),
        (["search.budgets=[0.45x,40GB]"], "search.budgets[1]='40GB'"),
        (["search.budgets=[0.5x]", "search.family_steps=-1"], "search.family_steps=-1"),
        (
            [
                "search.budgets=[0.5x]",
                "target.budget.constraints=[{metric:decode_ms,value:0.6x},{metric:memory_bytes,value:0.8x}]",
            ],
            "search.budgets needs exactly one constraint",
        ),
    ],
)
def test_bad_budgets_are_refused_naming_the_field(overrides, expected) -> None:
    from autocompress_nemo.config.validate import ConfigError, validate

    try:
        cfg = compose([*TINY_ROOFLINE, *overrides])
    except ConfigError as e:  # a composition error is a ConfigError as well
        assert expected in str(e)
        return
    with pytest.raises(ConfigError, match="search") as err:
        validate(cfg)
    assert expected in str(err.value)


def test_no_budgets_keeps_the_single_student_layout(tmp_path, capsys) -> None:
    """Without ``search.budgets`` the stage directories and cache keys are those of a run before it."""
    from autocompress_nemo.pipeline import Run
    from autocompress_nemo.search.family import members

    cfg = compose([*TINY_ROOFLINE, f"run_dir={tmp_path}/run"])
    assert members(cfg) == []
    section = Run(cfg).section("search")["search"]
    assert "budgets" not in section and "family_steps" not in section  # the key a run before the field had
    from autocompress_nemo.search.__main__ import run_pipeline

    run_pipeline(compose([*TINY_ROOFLINE, "search.steps=2", "stages=[profile,rank,search]", f"run_dir={tmp_path}/run"]))
    names = {p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")}
    assert {"profile", "rank", "search_autocompress"} <= names
    assert not [n for n in names if "@" in n]
    assert "family" not in json.loads((tmp_path / "run" / "search_autocompress" / "arch.json").read_text())
    assert not (tmp_path / "run" / "search_autocompress" / "supernet.safetensors").exists()


def test_a_failing_budget_is_named_for_the_exit_status(tmp_path) -> None:
    from autocompress_nemo.search.__main__ import failing_students

    paths = {}
    for b, ok in (("0.45x", True), ("0.75x", False)):
        check = {"decode_ms": {"measured": 2.0 if not ok else 1.0, "budget": 1.5, "pass": ok}}
        p = tmp_path / f"evaluate@{b}.json"
        p.write_text(json.dumps({"models": {"parent": {}, "autocompress": {"budget_check": check}}}))
        paths[b] = str(p)
    failed = failing_students({"evaluations": paths, "evaluation": paths["0.45x"]})
    assert failed == ["autocompress (budget 0.75x) misses its budget: decode_ms 2 (budget 1.5)"]

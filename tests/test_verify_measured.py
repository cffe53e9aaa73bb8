"""Extraction closes the loop on the engine: a chosen architecture that the table calls feasible
but the engine measures over budget is repaired again until the measurement meets the budget."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from autocompress_nemo import stages
from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.extract.repair import repair
from autocompress_nemo.search.space import apply_choices, build_space
from tests.method_utils import CAPS, tiny_parent

WL = {"batch": 1, "input_len": 16, "output_len": 4, "context_len": 32}


class TableCost:
    """The cost table's view: decode time proportional to parameters."""

    def predict(self, spec):  # noqa: ANN001, ANN201
        return {"decode_ms": param_count(spec) / 1e4}


class SlowerEngine:
    """The engine: 8% slower than the table says on every model (a table error)."""

    name, estimated, measured = "fake", False, 0

    def measure_many(self, specs, wl):  # noqa: ANN001, ANN201
        SlowerEngine.measured += len(specs)
        return [SimpleNamespace(prefill_ms=1.0, decode_ms=1.08 * param_count(s) / 1e4, memory_bytes=0.0) for s in specs]


def _ctx(rounds: int) -> SimpleNamespace:
    cfg = OmegaConf.create({"search": {"verify_rounds": rounds}, "target": {"workload": WL}})
    return SimpleNamespace(cfg=cfg, say=print)


def test_over_budget_measurement_is_repaired_until_it_passes(tmp_path, monkeypatch) -> None:
    import autocompress_nemo.costs.engines as engines

    monkeypatch.setattr(engines, "get_engine", lambda target, workdir=None: SlowerEngine())
    spec, _ = tiny_parent()
    decisions = build_space(spec, CAPS, ffn_options=4)
    imps = [[float(k) for k in range(len(d.options))] for d in decisions]
    cost = TableCost()
    budget = {"decode_ms": 0.7 * cost.predict(spec)["decode_ms"]}
    start, _ = repair(spec, decisions, [d.parent_option for d in decisions], cost.predict, budget, imps)
    child = apply_choices(spec, decisions, start)
    assert cost.predict(child)["decode_ms"] <= budget["decode_ms"] < 1.08 * cost.predict(child)["decode_ms"], (
        "the test needs a child the table calls feasible and the engine measures over budget"
    )
    final, history = stages.verify_measured(_ctx(2), tmp_path, spec, decisions, start, cost, budget, imps)
    assert history[0]["pass"] is False and history[-1]["pass"] is True
    assert history[-1]["measured"]["decode_ms"] <= budget["decode_ms"]
    assert 1.08 * cost.predict(apply_choices(spec, decisions, final))["decode_ms"] <= budget["decode_ms"]
    assert history[1]["predicted_target"]["decode_ms"] < budget["decode_ms"]  # the table's error taken out


def test_off_or_estimated_engine_changes_nothing(tmp_path, monkeypatch) -> None:
    import autocompress_nemo.costs.engines as engines

    spec, _ = tiny_parent()
    decisions = build_space(spec, CAPS, ffn_options=4)
    choices = [d.parent_option for d in decisions]
    monkeypatch.setattr(engines, "get_engine", lambda target, workdir=None: SlowerEngine())
    SlowerEngine.measured = 0
    assert stages.verify_measured(_ctx(0), tmp_path, spec, decisions, choices, TableCost(), {"decode_ms": 1.0}, []) == (
        choices,
        [],
    )
    estimated = SlowerEngine()
    estimated.estimated = True
    monkeypatch.setattr(engines, "get_engine", lambda target, workdir=None: estimated)
    assert stages.verify_measured(_ctx(2), tmp_path, spec, decisions, choices, TableCost(), {"decode_ms": 1.0}, []) == (
        choices,
        [],
    )
    assert SlowerEngine.measured == 0

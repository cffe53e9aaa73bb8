"""The router's stopping rule (issue 37, item 2): ``search.settle_steps`` ends the router once its
hard choice has been the same for that many steps and is within the slack of the budget, never in the anneal's first
half; the early search is the full one's prefix, and a resumed search stops at the same step."""

from __future__ import annotations

import json

import pytest
import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.search.autocompress import run_router_search
from autocompress_nemo.search.router import settled
from autocompress_nemo.search.space import build_space
from tests.cfg_utils import ROUTER, search_cfg
from tests.method_utils import CAPS, ParamCost, megatron_from_hf, tiny_parent


def _rows(*choices: int, fits: bool = True) -> list[dict]:
    return [{"choice": [c], "choice_fits": fits} for c in choices]


def test_the_rule_on_trajectories() -> None:
    steps = 10
    assert settled(_rows(1, 1, 1, 1), steps, 3) is None  # not before half of the steps
    assert "same for 3 steps" in settled(_rows(2, 2, 1, 1, 1), steps, 3)
    assert settled(_rows(1, 1, 1, 2, 2), steps, 3) is None  # changed within the last 3
    assert settled(_rows(1, 1, 1, 1, 1, fits=False), steps, 3) is None  # over budget + slack by the table
    assert settled(_rows(*[1] * 9), steps, 0) is None  # off
    assert settled(_rows(*[1] * 10), steps, 3) is None  # all steps done: nothing to stop
    assert settled(_rows(1, 1, 1, 1, 1, 1), steps, 6) is not None  # patience larger than half


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)
    yield


def test_the_router_stops_when_its_choice_has_settled_and_a_resume_stops_there_too(tmp_path) -> None:
    spec, sd = tiny_parent()
    decisions = build_space(spec, CAPS, ffn_options=4)
    budget = {"params": 0.75 * param_count(spec)}
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, spec.vocab, (2, 16), generator=g) for _ in range(6)]
    steps = 40

    def run(settle: int, ckpt: str | None = None):
        cfg = search_cfg(**{**ROUTER, "router_lr": 0.3, "steps": steps, "checkpoint_every": 5, "settle_steps": settle})
        return run_router_search(
            megatron_from_hf(spec, sd),
            spec,
            decisions,
            ParamCost(),
            budget,
            lambda i: batches[i % len(batches)],
            forward_logits,
            cfg,
            seed=0,
            checkpoint=ckpt,
            log=lambda s: None,
        )

    full = run(0)
    assert len(full.trajectory) == steps and full.stopped is None
    early = run(5, str(tmp_path / "search"))
    stop = len(early.trajectory)
    assert steps // 2 <= stop < steps, stop
    assert early.stopped and "same for 5 steps" in early.stopped
    last = early.trajectory[-5:]
    assert all(r["choice"] == early.choices and r["choice_fits"] for r in last)
    # the early search is the full one's prefix: same batches, same Gumbel draws, same router steps
    assert [r["choice"] for r in early.trajectory] == [r["choice"] for r in full.trajectory[:stop]]
    assert [r["kd"] for r in early.trajectory] == pytest.approx([r["kd"] for r in full.trajectory[:stop]], abs=1e-6)
    assert early.choices == full.trajectory[stop - 1]["choice"]
    # the checkpoint written at the stop: a resumed search runs no step and returns the same choice
    assert json.loads((tmp_path / "search" / "checkpoints" / "latest.json").read_text())["step"] == stop
    again = run(5, str(tmp_path / "search"))
    assert again.choices == early.choices and len(again.trajectory) == stop and again.stopped == early.stopped
    assert again.tokens == early.tokens

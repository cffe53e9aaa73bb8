"""dry_run=true for the case study (Nemotron 3 Super -> one B200 at 128K) against the hand
calculation in docs/nemotron_super_b200.md, and the plan files it writes."""

from __future__ import annotations

import json
import os
import time

import pytest
from hydra import compose, initialize_config_dir

import autocompress_nemo
from autocompress_nemo.config.store import register_configs
from autocompress_nemo.plan.dry_run import run_dry_run

CONF = os.path.join(os.path.dirname(autocompress_nemo.__file__), "conf")

# Hand calculation from the published config (docs/nemotron_super_b200.md, section 1).
EMBED = 131072 * 4096 * 2 + 4096  # embedding + untied LM head + final norm
ATTN = 4096 * 32 * 128 * 2 + 2 * 4096 * 2 * 128 + 4096  # Q, O; K, V; norm
MAMBA = 4096 * (2 * 8192 + 2 * 8 * 128 + 128) + 10240 * 5 + 3 * 128 + 8192 + 8192 * 4096 + 4096
MOE = 4096 * 512 + 512 * 2 * 1024 * 2688 + 2 * 4096 * 1024 + 2 * 4096 * 5376 + 4096
HAND_PARAMS = EMBED + 8 * ATTN + 40 * MAMBA + 40 * MOE
HAND_WEIGHTS_BF16 = 2 * HAND_PARAMS
HAND_KV_128K = 8 * 2 * 2 * 128 * 2 * 131072  # 8 attention blocks, K+V, 2 groups, d=128, bf16
HAND_SSM_FP32 = 40 * (128 * 64 * 128 + 10240 * 3) * 4  # per sequence, float32 cache


def compose_run(overrides: list[str]):
    register_configs()
    with initialize_config_dir(CONF, version_base=None):
        return compose("run", overrides)


def test_hand_calculation_matches_published_totals():
    """The hand figures themselves agree with NVIDIA's published 120.6B total."""
    assert HAND_PARAMS == 120_668_687_360
    assert HAND_KV_128K == 2**30
    assert HAND_SSM_FP32 == 172_687_360


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plan")
    cfg = compose_run(["+target=b200_128k", "+experiment=nemotron_super_b200", "dry_run=true", f"run_dir={run_dir}"])
    t0 = time.perf_counter()
    p = run_dry_run(cfg)
    p["_elapsed"] = time.perf_counter() - t0
    p["_dir"] = run_dir
    return p


def test_parent_figures_agree_with_hand_calculation(plan):
    m, parent = plan["model"], plan["serving"]["parent"]
    assert m["params"] == HAND_PARAMS
    assert parent["weights"] == HAND_WEIGHTS_BF16
    assert parent["kv_cache"] == HAND_KV_128K
    assert parent["ssm_state"] == HAND_SSM_FP32
    assert m["kv_bytes_per_token"] == 8192


def test_parent_does_not_fit_and_student_does(plan):
    sv = plan["serving"]
    assert sv["memory_per_instance_bytes"] == 180_000_000_000
    assert sv["parent_fits"] is False and sv["parent"]["weights"] > 180e9
    assert sv["student_fits"] is True
    assert 70e9 <= sv["student_params"] <= 74e9
    assert sv["budget_reachable"] is True
    assert "routed experts" in sv["student_how"]


def test_stages_have_layouts_and_memory(plan):
    for stage in ("rank", "search", "distill"):
        e = plan["stages"][stage]
        assert e["problems"] == [], e["problems"]
        mem = e["memory"]
        assert mem["label"] == "estimated, not measured"
        assert mem["fits"] is True
    d = plan["stages"]["distill"]["memory"]["breakdown_bytes"]
    for part in ("weights", "gradients", "optimizer", "activations", "teacher_weights"):
        assert d[part] > 0
    assert "gradients" not in plan["stages"]["rank"]["memory"]["breakdown_bytes"]


def test_plan_files_written_and_fast(plan):
    run_dir = plan["_dir"]
    saved = json.loads((run_dir / "plan.json").read_text())
    assert saved["model"]["params"] == HAND_PARAMS
    md = (run_dir / "plan.md").read_text()
    assert "estimated, not measured" in md
    assert "Why the parent does not fit" in md and "| parent | 120.67 B | 241.34 GB |" in md
    assert plan["_elapsed"] < 60


def test_one_node_distill_does_not_fit(tmp_path):
    """Teacher + student with fp32 Adam exceed one 8 x B200 node: the plan says so."""
    cfg = compose_run(
        [
            "+target=b200_128k",
            "+experiment=nemotron_super_b200",
            "dry_run=true",
            f"run_dir={tmp_path}",
            "cluster.stage_layouts.distill={nodes:1,tp:1,sequence_parallel:false,ep:8,etp:1}",
        ]
    )
    p = run_dry_run(cfg)
    assert p["stages"]["distill"]["memory"]["fits"] is False
    assert "DOES NOT FIT" in (tmp_path / "plan.md").read_text()


def test_bad_layout_reported_not_raised(tmp_path):
    cfg = compose_run(
        ["+target=b200_128k", "+experiment=nemotron_super_b200", "dry_run=true", f"run_dir={tmp_path}", "cluster.tp=3"]
    )
    p = run_dry_run(cfg)
    assert any("tp=3 does not divide attention num_heads=32" in x for x in p["stages"]["search"]["problems"])

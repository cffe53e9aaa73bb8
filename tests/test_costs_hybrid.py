"""Cost tables and memory of MoE / Mamba blocks (issue 6, item 4).

- MoE latency depends on tokens per expert ``B * k / E``: the table's MoE entries are measured at
  the workload's batch (the roofline engine prices decode by the experts ``B`` tokens touch; the
  profiler must hand the workload through and the predictor must use those entries), and
  transformers' eager MoE really routes ``B * k`` token slots per decode step in torch_eager.
- Mamba state per sequence is constant in context length, unlike KV: checked on the formulas,
  the predictor and the tensors transformers' cache actually holds.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from autocompress_nemo.arch.spec import MoeBlock
from autocompress_nemo.blocks.moe import moe_parts
from autocompress_nemo.config.schema import BudgetConstraint, TargetConfig
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines import get_engine
from autocompress_nemo.costs.engines.base import Workload
from autocompress_nemo.costs.engines.roofline import expected_experts_touched
from autocompress_nemo.costs.predictor import Predictor
from autocompress_nemo.costs.profile import build_table
from autocompress_nemo.costs.profile.differences import spread_copies
from autocompress_nemo.costs.table import CostTable, ProvenanceMismatch
from tests.hybrid_utils import conf_spec, hetero_hybrid_spec, requires_mamba

KINDS = ["attention", "mlp", "moe", "mamba"]


def roofline_target(batch: int) -> TargetConfig:
    t = OmegaConf.structured(TargetConfig)
    t.name = "hybrid_roofline"
    t.hardware.name, t.hardware.kind, t.hardware.device = "gpu_x", "gpu", "some GPU"
    t.hardware.peak_tflops, t.hardware.mem_bandwidth_gbs = 100.0, 1000.0
    t.engine.name, t.engine.dtype, t.engine.kv_dtype = "roofline", "bf16", "bf16"
    c = t.engine.capabilities
    c.block_kinds = KINDS
    for f in (
        "vary_query_heads",
        "vary_kv_groups",
        "vary_ffn",
        "remove_mlp",
        "vary_experts",
        "vary_expert_ffn",
        "vary_shared_ffn",
        "vary_mamba_heads",
        "remove_mamba",
        "remove_moe",
    ):
        setattr(c, f, True)
    t.workload.name = "w"
    t.workload.batch, t.workload.input_len, t.workload.output_len, t.workload.context_len = batch, 16, 8, 128
    t.budget.name = "b"
    t.budget.constraints = [BudgetConstraint(metric="decode_ms", value="0.6x")]
    return t


def table_at(batch: int) -> CostTable:
    t = roofline_target(batch)
    return build_table(
        get_engine(t), conf_spec("tiny_hybrid"), Workload.from_config(t.workload), ffn_points=4, log=lambda s: None
    )


def test_spread_copies_puts_each_copy_between_parent_blocks() -> None:
    assert spread_copies(tuple("MAEMEF"), "x", 4) == tuple("MxAxEMxExF")
    assert spread_copies(tuple("ab"), "x", 1) == tuple("axb")
    assert spread_copies((), "x", 2) == ("x", "x")


@pytest.mark.parametrize("batch", [1, 16])
def test_moe_entries_are_profiled_at_the_workload_batch(batch: int) -> None:
    """The routed part's decode entry is the engine's cost at the workload's batch; the predictor
    reproduces the (additive) engine on models it never profiled."""
    t = roofline_target(batch)
    eng, wl = get_engine(t), Workload.from_config(t.workload)
    table = table_at(batch)
    hybrid = conf_spec("tiny_hybrid")
    routed = moe_parts(next(b for b in hybrid.blocks if isinstance(b, MoeBlock)))[0]
    entry = next(e for e in table.blocks if e["block"] == routed.__dict__)
    assert entry["decode_ms"] == pytest.approx(eng.block_ms(routed, hybrid.hidden, wl)[1], rel=1e-9)
    pred = Predictor(table, t)
    child = hybrid.replace(
        blocks=tuple(MoeBlock(2, 32, 2, 16, 0, "relu2") if isinstance(b, MoeBlock) else b for b in hybrid.blocks),
        name="child",
    )
    assert pred.predict(child)["decode_ms"] == pytest.approx(eng.measure(child, wl).decode_ms, rel=1e-9)


def test_moe_decode_cost_follows_tokens_per_expert() -> None:
    """Decode reads the experts that ``B`` tokens touch, ``E(1 - (1 - k/E)^B)``: at batch 1 a routed
    part costs the same for 2 or 4 experts (top-2 reads 2 either way); at batch 16 fewer experts
    (more tokens per expert) cost less — while a dense MLP's decode cost does not depend on B."""
    assert expected_experts_touched(4, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(4, 2, 16) == pytest.approx(4 * (1 - 0.5**16))
    t1, t16 = table_at(1), table_at(16)
    r4, r2 = MoeBlock(4, 64, 2, 0, 0, "relu2"), MoeBlock(2, 64, 2, 0, 0, "relu2")
    assert t1.block_latency(r4, "decode_ms") == pytest.approx(t1.block_latency(r2, "decode_ms"), rel=0.02)
    assert t16.block_latency(r4, "decode_ms") > 1.5 * t16.block_latency(r2, "decode_ms")
    mlp = next(b for b in conf_spec("tiny_hybrid").blocks if b.kind == "mlp")
    assert t16.block_latency(mlp, "decode_ms") == pytest.approx(t1.block_latency(mlp, "decode_ms"), rel=1e-9)


def test_table_profiled_at_another_batch_is_refused(tmp_path) -> None:
    path = table_at(1).save(tmp_path / "t.json")
    want = table_at(16).provenance
    with pytest.raises(ProvenanceMismatch, match="workload"):
        CostTable.load(path, expected={k: v for k, v in want.items() if k not in ("date", "label")})


def test_mamba_state_is_constant_in_context_kv_is_linear() -> None:
    spec = hetero_hybrid_spec()
    mamba = [b for b in spec.blocks if b.kind == "mamba" and not b.removed]
    for c1, c2 in ((128, 4096), (1000, 131072)):
        assert mem.ssm_state_bytes(spec, 2, "f32") == sum(mem.block_state_bytes(b, 2, "f32") for b in mamba)
        assert mem.kv_cache_bytes(spec, c2, 2, "f16") == pytest.approx(c2 / c1 * mem.kv_cache_bytes(spec, c1, 2, "f16"))
    t = roofline_target(1)
    pred_short = Predictor(table_at(1), t)
    long = table_at(1)
    long.provenance["workload"] = {**long.provenance["workload"], "context_len": 8192}
    long.memory["kv_tokens"] = 8192
    pred_long = Predictor(long, t)
    a, b = pred_short.memory_parts(spec), pred_long.memory_parts(spec)
    assert a["state"] == b["state"] > 0
    assert b["kv"] == pytest.approx(a["kv"] * 8192 / 128)
    m = mamba[0]
    assert pred_long.block_cost(m, "memory_bytes") == pred_short.block_cost(m, "memory_bytes")


def _eager_target(batch: int, context: int) -> TargetConfig:
    from autocompress_nemo.config.entry import compose

    cfg = compose(["+target=tiny_hybrid_eager_cpu", "model=tiny_hybrid"])
    t = cfg.target
    t.workload.batch, t.workload.input_len, t.workload.output_len, t.workload.context_len = batch, 8, 4, context
    t.engine.settings.decode_steps, t.engine.settings.decode_warmup, t.engine.repeats = 2, 1, 1
    return t


@requires_mamba
def test_torch_eager_cache_holds_constant_mamba_state_and_growing_kv() -> None:
    """What transformers' cache really holds: Mamba conv + SSM state bytes equal the formula and do
    not change with context; attention KV bytes grow as ``2 * G * d * C * B * 4``."""
    spec = conf_spec("tiny_hybrid")
    seen = {}
    for ctx in (32, 96):
        t = _eager_target(2, ctx)
        m = get_engine(t).measure_many([spec], Workload.from_config(t.workload), rounds=1, timing=False)[0]
        seen[ctx] = (m.memory["state"], m.raw["memory_kv_at_decode_context"][0])
    # transformers keeps K conv columns (one more than the K-1 past inputs): conv_extra = 1
    assert seen[32][0] == seen[96][0] == mem.ssm_state_bytes(spec, 2, "f32", conv_extra=1)
    assert mem.conv_extra_columns(spec, 2, "f32", seen[96][0]) == 1
    c32, c96 = (Workload(2, 8, 4, c).decode_context() for c in (32, 96))
    per_token = mem.kv_cache_bytes(spec, 1, 2, "f32")
    assert (seen[32][1], seen[96][1]) == (per_token * c32, per_token * c96)


@requires_mamba
def test_torch_eager_routes_batch_times_top_k_tokens_per_decode_step() -> None:
    """The engine times MoE blocks at the workload's batch: every decode step sends ``B`` tokens x
    top-``k`` slots through each MoE block (so ``B*k/E`` tokens per expert on average)."""
    import transformers.models.nemotron_h.modeling_nemotron_h as mn

    spec = conf_spec("tiny_hybrid")
    moe = next(b for b in spec.blocks if isinstance(b, MoeBlock))
    for batch in (1, 3):
        slots: list[tuple[int, ...]] = []

        def record(mod: torch.nn.Module, args: tuple, out: object, slots: list = slots) -> None:
            if isinstance(mod, mn.NemotronHExperts):
                slots.append(tuple(args[1].shape))  # top_k_index: [tokens, k]

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            t = _eager_target(batch, 32)
            eng = get_engine(t)
            eng.in_worker = True  # time in this process (not the engine's worker), where the hook sees the experts
            eng.measure_many([spec], Workload.from_config(t.workload), rounds=1)
        finally:
            handle.remove()
        decode = [s for s in slots if s[0] == batch]  # one token per sequence
        assert decode and all(s == (batch, moe.top_k) for s in decode)
        assert any(s[0] == batch * 8 for s in slots)  # the timed prefills: B x input_len tokens


# -- least-squares hybrid tables (profile_method: fit) -------------------------------------------
def test_balanced_design_uses_every_option_equally_often() -> None:
    from autocompress_nemo.costs.profile.fit import balanced_choices

    ch = balanced_choices([3, 17, 5], 40, seed=0)
    assert len(ch) == 40 and len({tuple(c) for c in ch}) > 30
    for d, k in enumerate((3, 17, 5)):
        counts = [sum(c[d] == j for c in ch) for j in range(k)]
        assert min(counts) >= 40 // k and max(counts) <= -(-40 // k), (d, counts)


def test_fit_recovers_costs_and_reports_leave_one_out_residuals() -> None:
    """Synthetic additive data with 1 % relative noise: the weighted NNLS fit recovers the constant and
    the costs (including a true zero, kept >= 0), and its residuals are about the noise."""
    import numpy as np

    from autocompress_nemo.costs.profile.fit import fit_costs

    rng = np.random.default_rng(0)
    x_true = np.array([0.0, 0.5, 1.0, 2.0, 3.0])
    counts = rng.integers(0, 3, size=(60, 5)).astype(float)
    y_clean = 1.5 + counts @ x_true
    fit = fit_costs(counts, y_clean * (1 + 0.01 * rng.standard_normal(60)))
    assert fit.intercept == pytest.approx(1.5, abs=0.15)
    assert np.all(fit.costs >= 0) and np.allclose(fit.costs, x_true, atol=0.1)
    s = fit.summary()
    assert 0.5 < s["rms_pct"] < 1.5 and s["loo_rms_pct"] >= s["rms_pct"]
    exact = fit_costs(counts, y_clean)
    assert exact.summary()["loo_max_pct"] < 1e-4 and exact.rank == 6
    with pytest.raises(ValueError, match="profile_models"):
        fit_costs(counts[:4], y_clean[:4])


def test_fit_table_predicts_unprofiled_children_and_marks_its_models() -> None:
    """profile_method=fit on the (nearly additive) roofline engine: children never profiled are
    predicted within 0.1 %; the table lists its profiling models, validation treats exactly those as
    references, and the fit's residuals are in the provenance."""
    import random

    from autocompress_nemo.profile.validate import is_reference, profiled_time
    from autocompress_nemo.search.space import apply_choices, build_space

    t = roofline_target(4)
    t.engine.settings.profile_method, t.engine.settings.profile_models_per_unknown = "fit", 2
    eng, wl = get_engine(t), Workload.from_config(t.workload)
    parent = conf_spec("tiny_hybrid")
    table = build_table(eng, parent, wl, ffn_points=4, log=lambda s: None)
    prov = table.provenance
    assert prov["profile"]["method"] == "hybrid_fit" and prov["profile_models"] == len(table.runs)
    assert prov["fit"]["decode_ms"]["loo_max_pct"] < 0.1 and prov["fit"]["models"] >= 2 * prov["fit"]["unknowns"] - 1
    assert all(e["source"] == "fit" and e["appearances"] > 0 for e in table.blocks)
    pred = Predictor(table, t)
    decisions = build_space(parent, t.engine.capabilities, 4)
    rng = random.Random(7)
    checked = 0
    for _ in range(30):
        child = apply_choices(parent, decisions, [rng.randrange(len(d.options)) for d in decisions])
        if is_reference(child, table):
            continue
        m = eng.measure(child, wl)
        for p in ("prefill_ms", "decode_ms"):
            assert pred.predict(child)[p] == pytest.approx(getattr(m, p), rel=1e-3)
        checked += 1
    assert checked >= 20
    assert is_reference(parent, table) and profiled_time(parent, table) == {
        p: table.runs[0][p] for p in ("prefill_ms", "decode_ms")
    }


def test_drift_scale_uses_the_reference_time_measured_at_profiling() -> None:
    from autocompress_nemo.profile.validate import drift_scale

    ref = {
        "meas_prefill_ms": 11.0,
        "meas_decode_ms": 2.2,
        "pred_prefill_ms": 9.0,
        "pred_decode_ms": 1.9,
        "table_prefill_ms": 10.0,
        "table_decode_ms": 2.0,
    }
    s = drift_scale(ref, output_len=5)
    assert s["prefill_ms"] == pytest.approx(1.1) and s["decode_ms"] == pytest.approx(1.1)
    assert s["response_latency_ms"] == pytest.approx(1.1) and s["memory_bytes"] == 1.0
    del ref["table_prefill_ms"], ref["table_decode_ms"]
    assert drift_scale(ref, 5)["prefill_ms"] == pytest.approx(11.0 / 9.0)

"""Timing as a ratio to a reference measured in the same rounds (issue 14): an engine whose speed
changes mid-run keeps its ratios, loses its absolute times; spread ratios are repeated then flagged."""

from __future__ import annotations

import numpy as np
import pytest

from autocompress_nemo.costs.engines.paired import Schedule, all_flags, measure_interleaved
from tests.hybrid_utils import requires_mamba


class FakeClock:
    """A machine that runs ``slow`` times slower after ``after`` timed samples (any model)."""

    def __init__(self, after: int, slow: float = 1.2, jitter: float = 0.0, seed: int = 0) -> None:
        self.samples, self.after, self.slow, self.jitter = 0, after, slow, jitter
        self.rng = np.random.default_rng(seed)

    def take(self, cost: float) -> tuple[float, float]:
        self.samples += 1
        f = self.slow if self.samples > self.after else 1.0
        t = cost * f * (1.0 + self.jitter * float(self.rng.standard_normal()))
        return t, t


class FakeLive:
    def __init__(self, clock: FakeClock, prefill_ms: float, decode_ms: float, opened: list[str], name: str) -> None:
        self.clock, self.p, self.d = clock, prefill_ms, decode_ms
        self.memory = {"weights": 100.0 * decode_ms}
        opened.append(name)

    def prefill(self, n: int) -> list[tuple[float, float]]:
        return [self.clock.take(self.p) for _ in range(n)]

    def decode(self, n: int) -> list[tuple[float, float]]:
        return [self.clock.take(self.d) for _ in range(n)]

    def close(self) -> None:
        """Nothing to free: a fake model holds no engine memory."""


COSTS = [(300.0, 20.0), (150.0, 12.0), (60.0, 5.0)]  # (prefill, decode) ms of three models
REF = (280.0, 18.0)


def run(clock: FakeClock, reference: bool = True, rounds: int = 4, **kw) -> list:
    opened: list[str] = []
    sched = Schedule(rounds=rounds, prefills=3, steps=32, chunk=8, tolerance=0.1, percentile=10.0)
    return measure_interleaved(
        len(COSTS),
        lambda i: FakeLive(clock, *COSTS[i], opened, f"m{i}"),
        sched,
        open_reference=(lambda: FakeLive(clock, *REF, opened, "ref")) if reference else None,
        names=[f"m{i}" for i in range(len(COSTS))],
        **kw,
    )


def test_ratios_hold_when_the_machine_slows_by_20_percent_mid_run():
    quiet = run(FakeClock(after=10**9))
    total = sum(len(m.raw["decode_ms"]) + len(m.raw["prefill_ms"]) for m in quiet) * 2
    slowed = run(FakeClock(after=total // 3))  # 20 % slower after the first third of the samples
    for i, (p, d) in enumerate(COSTS):
        for phase, cost, ref in (("prefill_ms", p, REF[0]), ("decode_ms", d, REF[1])):
            assert quiet[i].ratio[phase] == pytest.approx(cost / ref, rel=1e-9)
            assert slowed[i].ratio[phase] == pytest.approx(cost / ref, rel=0.01)  # within 1 %
            # the stored cost is the ratio x the reference's time in the same call
            assert getattr(slowed[i], phase) == pytest.approx(slowed[i].ratio[phase] * slowed[i].scale[phase])
    # absolute times (the old method's median over samples) do not hold: the late model is off by ~20 %
    late_abs = run(FakeClock(after=0))  # slow from the start
    for i, (_, d) in enumerate(COSTS):
        assert late_abs[i].absolute["decode_ms"] == pytest.approx(1.2 * d, rel=1e-6)
        assert abs(late_abs[i].absolute["decode_ms"] / quiet[i].absolute["decode_ms"] - 1) > 0.19
        assert late_abs[i].ratio["decode_ms"] == pytest.approx(d / REF[1], rel=1e-9)


def test_scale_expresses_ratios_in_the_tables_reference_times():
    scale = {"prefill_ms": 250.0, "decode_ms": 15.0}
    out = run(FakeClock(after=0, slow=1.5), scale=scale)  # everything 50 % slower than at profiling
    for i, (p, d) in enumerate(COSTS):
        assert out[i].decode_ms == pytest.approx(d / REF[1] * 15.0, rel=1e-9)
        assert out[i].prefill_ms == pytest.approx(p / REF[0] * 250.0, rel=1e-9)
        assert out[i].reference["decode_ms"] == pytest.approx(1.5 * REF[1])  # the reference now


def test_reference_variation_between_rounds_is_flagged():
    total = 2 * (3 + 1 + 32 + 8) * len(COSTS) * 4
    out = run(FakeClock(after=total // 2, slow=1.3))
    ref = out[0].reference
    assert ref["decode_ms_variation"] == pytest.approx(0.3, rel=0.05)
    assert any("varied" in f and "between rounds" in f for f in out[0].reference["flags"])
    assert not out[0].flags  # the model's own ratios did not spread: the reference's flag is the call's
    assert all_flags(out) == out[0].reference["flags"]  # once, not once per model
    assert ref["load_avg"] and len(ref["load_avg"]) == 2


def test_a_spread_ratio_gets_one_more_turn_then_a_flag():
    opened: list[str] = []
    clock = FakeClock(after=10**9, jitter=0.4, seed=3)
    sched = Schedule(rounds=2, prefills=2, steps=16, chunk=4, tolerance=0.05)
    out = measure_interleaved(
        1,
        lambda i: FakeLive(clock, 100.0, 10.0, opened, "m0"),
        sched,
        open_reference=lambda: FakeLive(clock, 100.0, 10.0, opened, "ref"),
        names=["m0"],
    )
    assert opened.count("m0") == 3  # two rounds and one more turn
    assert any("m0: its" in f and "spread" in f for f in out[0].flags)


def test_without_a_reference_the_measurement_is_absolute():
    out = run(FakeClock(after=10**9), reference=False)
    assert out[0].ratio == {} and out[0].decode_ms == pytest.approx(COSTS[0][1])


def test_llama_cpp_times_against_the_reference(tmp_path):
    """The real engine: a tiny model against itself is ~1, a model half as deep is below it."""
    pytest.importorskip("llama_cpp")
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.profile.stage import parent_spec

    cfg = compose(["+target=tiny_cpu", "model=tiny_llama"])
    parent = parent_spec(cfg)
    eng = get_engine(cfg.target, workdir=tmp_path)
    wl = Workload(batch=1, input_len=32, output_len=8, context_len=64)
    half = parent.replace(blocks=parent.blocks[: len(parent.blocks) // 2], name="half")
    m_self, m_half = eng.measure_many([parent.replace(name="same"), half], wl, reference=parent, rounds=2)
    for m in (m_self, m_half):
        assert set(m.ratio) == {"prefill_ms", "decode_ms"}
        assert m.reference["name"] == "parent" and m.reference["decode_ms"] > 0
        assert m.absolute["decode_ms"] > 0
    assert 0.7 < m_self.ratio["decode_ms"] < 1.4
    assert m_half.ratio["prefill_ms"] < m_self.ratio["prefill_ms"]


@requires_mamba
def test_torch_eager_times_hybrids_against_the_reference():
    """PyTorch eager (the hybrid measurement engine) through the same scheduler: ratios and the reference."""
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.profile.stage import parent_spec

    cfg = compose(["+target=tiny_hybrid_eager_cpu", "model=tiny_hybrid"])
    t = cfg.target
    t.workload.batch, t.workload.input_len, t.workload.output_len, t.workload.context_len = 1, 8, 4, 32
    t.engine.settings.decode_steps, t.engine.settings.decode_warmup, t.engine.repeats = 8, 1, 2
    t.engine.settings.reference_chunk = 2
    parent = parent_spec(cfg)
    (m,) = get_engine(t).measure_many([parent.replace(name="same")], Workload.from_config(t.workload), reference=parent)
    assert set(m.ratio) == {"prefill_ms", "decode_ms"} and 0.5 < m.ratio["decode_ms"] < 2.0
    assert m.reference["name"] == "parent" and m.memory["state"] > 0 and "memory_kv_at_decode_context" in m.raw

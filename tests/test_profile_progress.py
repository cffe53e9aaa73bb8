"""Profile / validate progress never counts past its total (issue 37: the vLLM profile printed
``[profile 10/7] ... (-3 runs remain, ~-143 s left)``: 7 models planned, 3 reference runs not).

- ``planned_runs`` counts every progress call ``measure_many`` makes: for vLLM / TensorRT-LLM the
  reference's own runs too (checked against ``HfLlmEngine.measure_many`` itself, its worker replaced
  by a stub); for the engines timed in interleaved rounds a model's extra round raises the total
  before it is counted (checked against ``paired.measure_interleaved`` with stub models).
- Whatever the plan says, a line never reads ``done > total`` or a negative number left.
"""

from __future__ import annotations

import random
import re

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import Measurement, Workload
from autocompress_nemo.costs.engines.paired import Schedule, measure_interleaved
from autocompress_nemo.costs.profile.provenance import Progress, planned_runs

LINE = re.compile(r"^\[(\w+) (\d+)/(\d+)\].*\((-?\d+) runs remain, ~(-?\d+) s left\)$")


def _parse(lines: list[str]) -> list[tuple[int, int, int]]:
    out = []
    for ln in lines:
        m = LINE.match(ln)
        assert m, ln
        out.append((int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return out


def _specs(n: int) -> list[ArchSpec]:
    return [
        ArchSpec.llama(hidden=64, vocab=128, layers=2 + i, heads=4, kv_groups=2, ffn=96, name=f"m{i}") for i in range(n)
    ]


def test_vllm_reference_runs_are_counted(tmp_path, monkeypatch) -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines import get_engine

    target = compose(["+target=tiny_vllm_cpu", "model=tiny_llama", "target.engine.python=python3"]).target
    engine = get_engine(target, tmp_path)

    def stub(spec, workload, weights=None, *, timing=True):
        engine.last_report = {"load_s": 0.0}
        return Measurement(prefill_ms=1.0, decode_ms=0.1, memory={"weights": 1.0})

    monkeypatch.setattr(engine, "measure", stub)
    parent = _specs(1)[0].replace(name="parent")
    wl = Workload(1, 8, 2, 16)
    for n in (1, 3, 4, 5, 7, 9):
        specs = _specs(n)
        for with_parent in (False, True):
            sp = [parent, *specs] if with_parent else specs  # validate lists the parent among its models
            lines: list[str] = []
            total = planned_runs(engine, sp, parent)
            engine.measure_many(sp, wl, log=Progress(lines.append, total, 0.0), reference=parent)
            got = _parse(lines)
            assert len(got) == total, (n, with_parent, lines)  # the plan is exact
            assert got[-1][:3] == (total, total, 0)
            assert all(d <= t and left >= 0 for d, t, left in got), lines


def test_an_extra_round_raises_the_total_before_it_is_counted() -> None:
    class Live:
        def __init__(self, t: float, jitter: bool) -> None:
            self.t, self.jitter, self.i, self.memory = t, jitter, 0, {"weights": 1.0}
            self.rng = random.Random(int(t))

        def _time(self) -> float:
            self.i += 1
            return self.t * (1.0 + 2.0 * self.rng.random() if self.jitter else 1.0)

        def prefill(self, n: int) -> list[tuple[float, float]]:
            return [(self._time(), self._time()) for _ in range(n)]

        def decode(self, n: int) -> list[tuple[float, float]]:
            return [(self._time(), self._time()) for _ in range(n)]

        def close(self) -> None:
            pass

    n, rounds = 4, 2
    lines: list[str] = []
    progress = Progress(lines.append, n * rounds, 0.0, detail=True)
    measure_interleaved(
        n,
        lambda i: Live(1.0 + i, jitter=i in (1, 3)),  # two models whose ratios spread: one more round each
        Schedule(rounds=rounds, prefills=2, steps=4, chunk=2, tolerance=0.1),
        open_reference=lambda: Live(1.0, jitter=False),
        log=progress,
    )
    got = _parse(lines)
    assert len(got) == n * rounds + 2 and sum("one more round" in ln for ln in lines) == 2
    assert got[-1][:3] == (n * rounds + 2, n * rounds + 2, 0)
    assert all(d <= t and left >= 0 for d, t, left in got), lines


def test_a_line_never_passes_its_total_whatever_the_plan() -> None:
    lines: list[str] = []
    p = Progress(lines.append, 7, 0.0)
    for i in range(10):
        p(f"m{i}: prefill 1 ms")  # 3 runs more than planned
    got = _parse(lines)
    assert [d for d, _, _ in got] == list(range(1, 11))
    assert all(d <= t and left >= 0 for d, t, left in got), lines


def test_vllm_runtime_is_fitted_on_the_weights_only_where_they_explain_it() -> None:
    """``pairs._runtime_fit``: runtime = a + b x weights when the weights explain it, else the median
    (measured in vLLM on SmolLM2: 878-1019 MiB across models, not ordered by their weights)."""
    from types import SimpleNamespace

    from autocompress_nemo.costs.profile.pairs import _runtime_fit

    def m(w: float, o: float) -> Measurement:
        return Measurement(prefill_ms=1.0, decode_ms=1.0, memory={"weights": w, "output": o})

    vllm = SimpleNamespace(name="vllm")
    lin = [m(w, 600.0 + 0.5 * w) for w in (10.0, 20.0, 40.0, 80.0)]
    got = _runtime_fit(vllm, lin, lin[0])
    assert abs(got["runtime_per_weight_byte"] - 0.5) < 1e-9 and abs(got["output_bytes"] - 600.0) < 1e-6
    noisy = [m(w, o) for w, o in ((10.0, 900.0), (20.0, 700.0), (40.0, 950.0), (80.0, 800.0))]
    got = _runtime_fit(vllm, noisy, noisy[0])
    assert got["runtime_per_weight_byte"] == 0.0 and got["output_bytes"] == 850.0
    assert _runtime_fit(SimpleNamespace(name="llama_cpp"), noisy, noisy[0]) == {"output_bytes": 900.0}

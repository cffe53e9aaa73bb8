"""Engines measure in a process of their own (``costs/engines/worker.py``): a crash, a hang or a refusal
in the engine is a failed measurement whose error carries the engine's own stderr, never a dead or hung
pipeline; the pipeline stops with that message (exit status 4)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.worker import (
    EngineWorkerError,
    engine_python,
    launch_prefix,
    run_worker,
    script_command,
)

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**kw):  # noqa: ANN202
    return OmegaConf.create(
        {"name": "test", "python": "", "container": "", "container_mounts": "", "timeout_s": 60, **kw}
    )


def _script(tmp_path: Path, body: str) -> list[str]:
    p = tmp_path / "w.py"
    p.write_text(body)
    return [sys.executable, str(p)]


def test_a_worker_that_dies_on_a_signal_is_an_error_with_its_stderr(tmp_path) -> None:
    cmd = _script(
        tmp_path,
        "import os, sys, signal\nprint('engine: loading model.gguf', file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGABRT)\n",
    )
    with pytest.raises(
        EngineWorkerError, match=r"failed on model.gguf: killed by SIGABRT[\s\S]*engine: loading model.gguf"
    ):
        run_worker(_cfg(), cmd, {"task": "measure"}, tmp_path, what="model.gguf")


def test_a_hung_worker_is_killed_with_its_children_at_the_timeout(tmp_path) -> None:
    pidfile = tmp_path / "child.pid"
    cmd = _script(
        tmp_path,
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "print('engine: warming up', file=sys.stderr, flush=True)\ntime.sleep(600)\n",
    )
    t0 = time.time()
    with pytest.raises(EngineWorkerError, match=r"did not finish in 2 s \(target.engine.timeout_s\)[\s\S]*warming up"):
        run_worker(_cfg(timeout_s=2), cmd, {"task": "measure"}, tmp_path, what="m")
    assert time.time() - t0 < 30
    child = int(pidfile.read_text())
    time.sleep(0.5)
    assert not _alive(child)  # the engine's own child went with it (its process group was killed)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_worker_error_response_names_the_engine_message(tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    cmd = script_command(_cfg(), "vllm_worker.py", tmp_path)  # runs here without vllm: a clean error response
    with pytest.raises(EngineWorkerError, match=r"test failed on x: (ModuleNotFoundError|KeyError)"):
        run_worker(_cfg(), cmd, {"task": "measure", "model": str(tmp_path)}, tmp_path, what="x")


def test_engine_placement_errors_say_what_to_set(monkeypatch) -> None:
    with pytest.raises(
        EngineWorkerError, match=r"target.engine.python='/nope/bin/python' does not exist.*make vllm-cpu"
    ):
        engine_python(_cfg(name="vllm", python="/nope/bin/python"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(EngineWorkerError, match="needs a Slurm allocation"):
        launch_prefix(_cfg(container="nvcr.io/nvidia/tensorrt-llm/release:1.0"))
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    cmd = launch_prefix(_cfg(container="img:1", container_mounts="/runs:/runs"))
    assert cmd[0] == "srun" and "--container-image=img:1" in cmd and "--container-mounts=/runs:/runs" in cmd


@pytest.mark.engine
def test_a_corrupted_gguf_fails_in_the_llama_cpp_worker_not_in_the_pipeline(tmp_path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: engines)")
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines import Workload, get_engine

    t = compose(["+target=tiny_cpu", "model=tiny_llama", "target.engine.settings.reference=none"]).target
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    spec = ArchSpec.llama(hidden=64, vocab=512, layers=2, heads=4, kv_groups=2, ffn=128)
    eng = get_engine(t, tmp_path / "w")
    with pytest.raises(EngineWorkerError, match=r"llama_cpp failed on .*: [\s\S]*"):
        eng.measure(spec, Workload(1, 8, 4, 64), gguf_path=bad)
    m = eng.measure(spec, Workload(1, 8, 4, 64))  # the engine still works: the failure stayed in its process
    assert m.decode_ms > 0 and m.memory["weights"] > 0


@pytest.mark.engine
@pytest.mark.slow
def test_the_pipeline_stops_with_the_engine_message(tmp_path) -> None:
    """A hung engine (timeout 0.5 s) ends the run with exit status 4 and the worker's message, no traceback."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: engines)")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "autocompress_nemo.search",
            "model=tiny_llama",
            "+target=tiny_cpu",
            f"run_dir={tmp_path}/run",
            "target.engine.timeout_s=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert p.returncode == 4, p.stderr[-3000:]
    assert "autocompress: engine error: llama_cpp worker on" in p.stderr and "did not finish in 0 s" in p.stderr
    assert "Traceback" not in p.stderr.split("autocompress: engine error")[1]


def test_one_model_per_process_engines_time_against_a_bracketing_reference(tmp_path, monkeypatch) -> None:
    """vLLM / TensorRT-LLM (one model per worker process): with a reference, the reference is measured
    first, after every REFERENCE_EVERY models and last; each model is its ratio to the reference's time
    interpolated between the two measurements around it, so a machine that slows down steadily during
    the call leaves the ratios right (here 0.5 within 1 %), and the reference itself is not measured as
    a model. The engine's clock is a fake one that the fake worker advances, so the drift is linear in
    the clock the engine reads whatever the load on the machine running the test (with a real clock,
    a busy CI machine spaced the calls unevenly and the ratio came out 0.508)."""
    import types

    from autocompress_nemo.costs.engines import hf_llm
    from autocompress_nemo.costs.engines.base import Measurement, Workload
    from autocompress_nemo.costs.engines.hf_llm import REFERENCE_EVERY, HfLlmEngine

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(hf_llm, "time", types.SimpleNamespace(monotonic=lambda: clock.now))

    class Drifting(HfLlmEngine):
        name = "vllm"

        def __init__(self) -> None:
            super().__init__({"name": "vllm", "settings": {"reference": "parent"}}, None, tmp_path)
            self.order: list[str] = []

        def measure(self, spec, workload, weights=None, *, timing=True):  # noqa: ANN001, ANN202
            self.order.append(spec.name)
            clock.now += 0.5  # each worker call takes one unit of the fake clock; this is its middle
            slow = 1.0 + 0.2 * clock.now  # 20 % slower per worker call
            clock.now += 0.5
            base = 10.0 if spec.name in ("reference", "parent") else 5.0
            return Measurement(prefill_ms=2 * base * slow, decode_ms=base * slow, memory={"weights": 1.0})

    parent = ArchSpec.llama(hidden=64, vocab=512, layers=2, heads=2, kv_groups=1, ffn=128, head_dim=32)
    kids = [parent.replace(name="parent")] + [parent.replace(name=f"m{i}", blocks=parent.blocks[:2]) for i in range(6)]
    eng = Drifting()
    out = eng.measure_many(kids, Workload(), reference=parent)
    assert eng.order == ["reference"] + [f"m{i}" for i in range(REFERENCE_EVERY)] + [
        "reference",
        "m4",
        "m5",
        "reference",
    ]
    assert out[0].ratio["decode_ms"] == 1.0
    for m in out[1:]:
        assert abs(m.ratio["decode_ms"] - 0.5) < 0.005 and abs(m.ratio["prefill_ms"] - 0.5) < 0.005, m.ratio
        assert m.reference["name"] == "parent" and m.absolute["decode_ms"] > 0

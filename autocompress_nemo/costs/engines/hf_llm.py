"""Shared pieces of the engines with an ``LLM(...).generate`` API (vLLM on CPU or GPU, TensorRT-LLM):
a Hugging Face config directory for an ArchSpec, timed with dummy weights in the engine's own
process (``worker.py``; the timing loop is the worker script's, ``workers/<engine>_worker.py``).

Uniform models are written as ``LlamaForCausalLM``; heterogeneous ones as DeciLM
(``DeciLMForCausalLM``, ``block_configs`` per layer), in the form this engine's loader reads
(``export/hf_config.py``: vLLM gets exact ``intermediate_size`` widths, TensorRT-LLM ``ffn_mult`` on
the 256 grid; neither gets per-layer query heads).

Timing (in the worker): prefill = the time of ``generate(max_tokens=1)`` for ``batch`` prompts of
``input_len`` tokens (time to first token); decode step = ``(T(max_tokens = 1 + n) - T(max_tokens =
1)) / n`` paired per repeat, with ``n = output_len`` unless ``settings.decode_steps`` says otherwise:
the timed steps then see the KV lengths ``input_len .. input_len + output_len``, whose mean is the
workload's decode context.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload
from autocompress_nemo.costs.engines.worker import run_worker, script_command
from autocompress_nemo.costs.gguf_types import GPU_ROW_ALIGN


class HfLlmEngine(Engine):
    """An engine timed by its worker script (``workers/<worker>``) in its own interpreter."""

    worker = ""
    """The worker script's file name in ``workers/``."""

    @classmethod
    def ffn_align(cls, dtype: str) -> int:
        """``GPU_ROW_ALIGN`` (FP8 / NVFP4: 16 elements, estimated)."""
        return GPU_ROW_ALIGN.get(dtype, 1)

    def __init__(self, cfg: Any, hardware: Any = None, workdir: str | Path | None = None) -> None:
        super().__init__(cfg, hardware)
        import tempfile

        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"acn-{self.name}-"))
        self.runs = 0
        self._version = ""
        self._device = ""
        self.last_report: dict[str, Any] = {}
        """What the worker said of its last measurement besides timings and memory (how memory was read)."""

    def write_config(self, spec: ArchSpec, out_dir: Path) -> Path:
        """The Hugging Face config directory (no weights) the engine loads with dummy weights, written as
        this engine's loader reads it (``export/hf_config.py``)."""
        from autocompress_nemo.export.hf_config import write_hf_config_dir

        return write_hf_config_dir(spec, out_dir, self.hf_loader, str(self.cfg.dtype))

    def call(self, request: dict[str, Any], what: str, log: Any = None) -> dict[str, Any]:
        """One worker call (``worker.run_worker``); remembers the engine version and device it reports."""
        resp = run_worker(
            self.cfg, script_command(self.cfg, self.worker, self.workdir), request, self.workdir, what=what, log=log
        )
        self._version = str(resp.get("version") or self._version)
        self._device = str(resp.get("device") or self._device)
        return resp

    def engine_dict(self) -> dict[str, Any]:
        """``target.engine`` as plain data for the worker."""
        import dataclasses

        return dataclasses.asdict(self.cfg)

    def version(self) -> str:
        if not self._version:
            try:
                self.call({"task": "version"}, "its version")
            except Exception as e:  # noqa: BLE001 -- provenance of an engine that cannot start
                return f"{self.name} (not runnable: {str(e).splitlines()[0]})"
        return self._version

    def device(self) -> str:
        return self._device or super().device()

    def measure(
        self, spec: ArchSpec, workload: Workload, weights: dict[str, np.ndarray] | None = None, *, timing: bool = True
    ) -> Measurement:
        """One model in one worker process; ``timing=False``: load and read the memory only."""
        self.require_servable(spec)
        if weights is not None:
            raise ValueError(f"{self.name} profiling uses dummy weights; export real weights through the export stage")
        d = self.write_config(spec, self.workdir / f"m{self.runs}_{spec.name or 'model'}")
        n = self.settings.decode_steps or max(1, workload.output_len)
        kv = mem.kv_cache_bytes(spec, workload.context_len, workload.batch, str(self.cfg.kv_dtype))
        req = {
            "task": "measure",
            "model": str(d),
            "vocab": spec.vocab,
            "engine": self.engine_dict(),
            "workload": {
                "batch": workload.batch,
                "input_len": workload.input_len,
                "output_len": workload.output_len,
                "context_len": workload.context_len,
            },
            "timing": {"repeats": max(1, int(self.cfg.repeats)) if timing else 0, "decode_steps": n, "warmup": 1},
            # CPU: a KV pool of what the workload needs (and some), not the machine's memory
            "kv_cache_bytes": int(max(2 * kv, 64 * 2**20)),
        }
        resp = self.call(req, spec.name or "the model")
        self.runs += 1
        samples = resp["samples"]
        m = Measurement.from_samples(
            {"prefill_ms": samples["prefill_ms"], "decode_ms": samples["decode_ms"]} if timing else {},
            float(self.cfg.percentile),
            {k: float(v) for k, v in resp["memory"].items()},
            {"generate_ms": samples.get("generate_ms", [])},
            float(resp.get("wall_s", 0.0)),
        )
        self.last_report = {k: resp.get(k) for k in ("memory_source", "engine_report", "load_s", "version", "device")}
        return m

    def measure_many(
        self,
        specs: list[ArchSpec],
        workload: Workload,
        *,
        rounds: int | None = None,
        log: Any = None,
        reference: ArchSpec | None = None,
        scale: dict[str, float] | None = None,
        timing: bool = True,
    ) -> list[Measurement]:
        """One worker process per model, one after the other; ``log`` hears of each as it ends.
        ``timing=False``: memory only.

        With a ``reference`` (``settings.reference: parent``), every model is timed as its ratio to the
        reference measured around it: the reference runs first and again after every
        ``REFERENCE_EVERY`` models (and last), and a model's ratio is to the mean of the reference's two
        measurements that bracket it, so the machine's drift over a long call cancels (a model that is
        the reference itself is not measured twice). ``prefill_ms`` / ``decode_ms`` are then ``ratio x
        scale`` (``scale``: the table's reference times; else the reference's own), the model's own
        times kept as ``absolute``, as in ``paired.py``."""
        from autocompress_nemo.costs.table import spec_hash

        use_ref = reference is not None and timing and str(self.settings.reference) == "parent"
        ref_hash = spec_hash(reference) if use_ref and reference is not None else None
        refs: list[tuple[float, Measurement]] = []  # (when, the reference's measurement)
        when: list[float] = [0.0] * len(specs)
        out: list[Measurement | None] = [None] * len(specs)
        done = 0

        def take_reference() -> None:
            assert reference is not None
            t = time.monotonic()
            m = self.measure(reference.replace(name="reference"), workload)
            refs.append((0.5 * (t + time.monotonic()), m))
            if log is not None:
                log(f"reference: prefill {m.prefill_ms:.2f} ms, decode {m.decode_ms:.3f} ms")

        if use_ref:
            take_reference()
        for i, s in enumerate(specs):
            if use_ref and spec_hash(s) == ref_hash:
                continue  # the reference's own measurements stand for it
            t = time.monotonic()
            m = self.measure(s, workload, timing=timing)
            when[i], out[i] = 0.5 * (t + time.monotonic()), m
            done += 1
            if log is not None:
                log(
                    f"{s.name or 'model'}: prefill {m.prefill_ms:.2f} ms, decode {m.decode_ms:.3f} ms, "
                    f"load {float(self.last_report.get('load_s') or 0):.0f} s"
                )
            if use_ref and done % REFERENCE_EVERY == 0 and i < len(specs) - 1:
                take_reference()
        if not use_ref:
            return [m for m in out if m is not None]
        if done % REFERENCE_EVERY:
            take_reference()
        for i in range(len(specs)):
            if out[i] is None:  # the reference itself: its median measurement, ratio 1
                out[i], when[i] = _median_measurement([m for _, m in refs]), -1.0
            _apply_reference(out[i], refs, when[i], scale)  # type: ignore[arg-type]
        return [m for m in out if m is not None]

    def prompt_logprobs(self, model_dir: str | Path, tokens: list[int], top_k: int = 20) -> list[dict[int, float]]:
        """The engine's top-``top_k`` log-probabilities at every prompt position of ``tokens`` for the model
        in ``model_dir`` with its real weights (row ``p`` predicts ``tokens[p]``; row 0 is empty)."""
        req = {
            "task": "logits",
            "model": str(model_dir),
            "engine": self.engine_dict(),
            "workload": {"batch": 1, "input_len": len(tokens), "output_len": 1, "context_len": len(tokens) + 16},
            "tokens": [int(t) for t in tokens],
            "top_k": int(top_k),
        }
        rows = self.call(req, f"the exported {Path(model_dir).name}")["prompt_logprobs"]
        return [{int(t): float(v) for t, v in r.items()} for r in rows]


REFERENCE_EVERY = 4
"""Models timed between two measurements of the reference (each is one worker process: ~30 s for
SmolLM2 in vLLM on this CPU)."""


def _median_measurement(ms: list[Measurement]) -> Measurement:
    """The reference's own row: its measurement with the median decode time."""
    return sorted(ms, key=lambda m: m.decode_ms)[len(ms) // 2]


def _apply_reference(
    m: Measurement, refs: list[tuple[float, Measurement]], at: float, scale: dict[str, float] | None
) -> None:
    """``m``'s times as ratios to the reference's time at ``at``, interpolated linearly between its two
    measurements that bracket ``at`` (``at < 0``: ``m`` is the reference, ratio 1)."""
    before = max((r for r in refs if r[0] <= at), key=lambda r: r[0], default=refs[0])
    after = min((r for r in refs if r[0] >= at), key=lambda r: r[0], default=refs[-1])
    w = (at - before[0]) / (after[0] - before[0]) if after[0] > before[0] else 0.0
    ref: dict[str, Any] = {"name": "parent", "memory": dict(before[1].memory), "measurements": len(refs)}
    m.absolute = {p: getattr(m, p) for p in ("prefill_ms", "decode_ms")}
    for p in ("prefill_ms", "decode_ms"):
        a, b = getattr(before[1], p), getattr(after[1], p)
        ref[p] = m.absolute[p] if at < 0 else a + w * (b - a)
        times = [getattr(r, p) for _, r in refs]
        ref[f"{p}_variation"] = (max(times) / min(times) - 1.0) if min(times) > 0 else 0.0
        ratio = 1.0 if at < 0 else (m.absolute[p] / ref[p] if ref[p] else float("nan"))
        m.ratio[p] = ratio
        m.scale[p] = float((scale or {}).get(p) or ref[p])
        setattr(m, p, ratio * m.scale[p])
    m.reference = ref

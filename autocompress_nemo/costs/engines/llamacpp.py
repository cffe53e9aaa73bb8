"""llama.cpp through llama-cpp-python's low-level C API (the embedded default engine; runs on CPU).

A model is written as GGUF (``export/gguf.py``: ``llama`` when uniform, ``deci`` when
heterogeneous), loaded with ``llama_model_load_from_file`` and served by one context of
``n_ctx = context_len``, ``n_seq_max = batch``, flash attention on (with it off the V cache
is padded to the widest layer), a fixed thread count.

Timing (each timed call is ``llama_decode`` + ``llama_synchronize``, on the clock below):

- prefill: clear the cache, decode ``batch`` prompts of ``input_len`` random tokens in
  one batch (logits for the last token of each); one warm-up, then ``repeats`` timed runs.
- decode: fill sequence 0 to the decode context ``C`` (copied to the other sequences),
  then repeatedly decode one token per sequence at position ``C`` and remove it again, so
  every timed step sees exactly ``C`` cached tokens; a few warm-up steps, then
  ``decode_steps`` timed ones.

Several models are measured in interleaved rounds (``measure_many``, ``engine.settings.rounds``,
default 2): every round loads each model in turn and takes ``ceil(repeats / rounds)``
prefills and ``ceil(decode_steps / rounds)`` decode steps.

Clock: with one thread llama.cpp computes on the calling thread, so the thread's CPU time
(``time.thread_time``) is the latency the model would have on an unloaded core, while wall
time also counts the time other processes held the core. On this shared 2-core machine, at
load 12, one 256-token prefill read 1000-1120 ms wall but 333-339 ms thread CPU. The default
clock ``auto`` uses thread CPU time at 1 thread and wall time otherwise; both are recorded
(``*_wall_ms`` raw samples) and the provenance names the clock.

The statistic is a low percentile (``engine.percentile``, default 10th): interference only
adds time, so medians drift and low percentiles do not. Raw samples and their spread are kept.

Memory is what llama.cpp logs while loading and creating the context (captured through
``llama_log_set``): ``model buffer size`` (weights, summed over buffers), ``KV buffer size``
with its ``K (...)`` and ``V (...)`` parts, ``output buffer size`` and ``compute buffer size``.
"""

from __future__ import annotations

import ctypes
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import CpuTimedEngine, Measurement, Workload

_MIB = 1024.0 * 1024.0
_LOG: list[str] = []
_CALLBACK: Any = None


def _install_log_capture() -> None:
    """Route llama.cpp's C-level log into ``_LOG`` (replaces llama-cpp-python's printer)."""
    global _CALLBACK
    import llama_cpp

    if _CALLBACK is not None:
        return

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # noqa: ARG001
        _LOG.append(text.decode("utf-8", errors="replace"))

    _CALLBACK = _cb
    llama_cpp.llama_log_set(_CALLBACK, ctypes.c_void_p(0))


def parse_memory_log(text: str) -> dict[str, float]:
    """Bytes by part from llama.cpp's log: weights, kv (= k + v), k, v, output, compute.

    Sums every ``... model buffer size = X MiB`` (mapped, repacked ...), and likewise for
    compute and output buffers; ``K (type): X MiB, V (type): Y MiB`` gives the KV parts.
    """

    def total(pattern: str) -> float:
        return sum(float(x) for x in re.findall(pattern, text)) * _MIB

    out = {
        "weights": total(r"model buffer size\s*=\s*([0-9.]+) MiB"),
        "kv": total(r"KV buffer size\s*=\s*([0-9.]+) MiB"),
        "output": total(r"output buffer size\s*=\s*([0-9.]+) MiB"),
        "compute": total(r"compute buffer size\s*=\s*([0-9.]+) MiB"),
    }
    k = re.findall(r"K \([a-z0-9_]+\):\s*([0-9.]+) MiB", text)
    v = re.findall(r"V \([a-z0-9_]+\):\s*([0-9.]+) MiB", text)
    if k and v:
        out["k"] = sum(float(x) for x in k) * _MIB
        out["v"] = sum(float(x) for x in v) * _MIB
    return out


class LlamaCppEngine(CpuTimedEngine):
    name = "llama_cpp"
    decode_steps = 160

    def __init__(self, cfg: Any, hardware: Any = None, workdir: str | Path | None = None) -> None:
        super().__init__(cfg, hardware)
        self._workdir = Path(workdir) if workdir else None
        self.runs = 0

    @property
    def workdir(self) -> Path:
        """Where GGUF files are written while measuring (a temporary directory unless given)."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="acn-llamacpp-"))
        self._workdir.mkdir(parents=True, exist_ok=True)
        return self._workdir

    # -- provenance -----------------------------------------------------------
    def version(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        out = super().check_servable(spec, parent)
        if not spec.is_dense_layered():
            out.append(f"llama.cpp (llama/deci GGUF) serves (attention, mlp) layer stacks only, got {spec.pattern!r}")
        return out

    # -- measurement ------------------------------------------------------------
    def measure(
        self,
        spec: ArchSpec,
        workload: Workload,
        weights: dict[str, np.ndarray] | None = None,
        *,
        gguf_path: str | Path | None = None,
        timing: bool = True,
    ) -> Measurement:
        """Write (or use ``gguf_path``), load, time and read the memory of one model (one round)."""
        return self.measure_many([spec], workload, weights=[weights], gguf_paths=[gguf_path], rounds=1, timing=timing)[
            0
        ]

    def measure_many(
        self,
        specs: list[ArchSpec],
        workload: Workload,
        *,
        rounds: int | None = None,
        weights: list[dict[str, np.ndarray] | None] | None = None,
        gguf_paths: list[str | Path | None] | None = None,
        timing: bool = True,
        log: Any = None,
    ) -> list[Measurement]:
        """Measure several models in interleaved rounds.

        Each round loads every model in turn and takes a few samples; the statistic is taken
        over all rounds. Load on a shared machine comes in bursts: spreading one model's
        samples over time (and over the same windows as the others') keeps a burst from
        biasing one model against another.
        """
        from autocompress_nemo.export.gguf import write_gguf

        rounds = int(rounds or self.settings.rounds)
        weights = weights or [None] * len(specs)
        given = gguf_paths or [None] * len(specs)
        paths: list[Path] = []
        t0 = time.time()
        for i, spec in enumerate(specs):
            self.require_servable(spec)
            if given[i] is not None:
                paths.append(Path(given[i]))  # type: ignore[arg-type]
                continue
            p = self.workdir / f"m{i}_{spec.name or 'model'}.gguf"
            write_gguf(spec, p, weights[i], dtype=str(self.cfg.dtype), context_length=workload.context_len)
            paths.append(p)
        raws: list[dict[str, list[float]]] = [{} for _ in specs]
        mems: list[dict[str, float]] = [{} for _ in specs]
        walls = [0.0] * len(specs)
        per_round_p = max(1, -(-int(self.cfg.repeats) // rounds))
        per_round_d = max(4, -(-self.timed_decode_steps() // rounds))
        try:
            for r in range(rounds):
                order = list(range(len(specs)))
                if r % 2:
                    order.reverse()
                for i in order:
                    if log and rounds > 1:
                        log(f"    round {r + 1}/{rounds}: {specs[i].name}")
                    t = time.time()
                    mem, raw = self._run(paths[i], specs[i].vocab, workload, timing, per_round_p, per_round_d)
                    walls[i] += time.time() - t
                    mems[i] = mems[i] or mem
                    for k, v in raw.items():
                        raws[i].setdefault(k, []).extend(v)
                    self.runs += 1
        finally:
            for i, p in enumerate(paths):
                if given[i] is None:
                    p.unlink(missing_ok=True)
        pct = float(self.cfg.percentile)
        out = []
        for i in range(len(specs)):
            raw = raws[i] if timing else {}
            mem = {k: mems[i].get(k, 0.0) for k in ("weights", "kv", "compute", "output")}
            extra = {f"memory_{k}": [mems[i][k]] for k in ("k", "v") if k in mems[i]}
            wall = walls[i] + (time.time() - t0 - sum(walls)) / len(specs)
            out.append(Measurement.from_samples(raw, pct, mem, extra, wall))
        return out

    def _run(
        self, path: Path, vocab: int, wl: Workload, timing: bool, prefill_repeats: int, decode_steps: int
    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        import llama_cpp as L

        _install_log_capture()
        L.llama_backend_init()
        _LOG.clear()
        mp = L.llama_model_default_params()
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp failed to load {path}:\n{''.join(_LOG)[-2000:]}")
        cp = L.llama_context_default_params()
        cp.n_ctx = wl.context_len * wl.batch  # llama.cpp shares n_ctx cells among the sequences
        cp.n_seq_max = wl.batch
        cp.n_batch = max(self.settings.n_batch, wl.input_len * wl.batch)
        cp.n_ubatch = self.settings.n_ubatch
        cp.n_threads = cp.n_threads_batch = self.threads()
        cp.flash_attn_type = 1 if self.cfg.flash_attn else 0
        cp.type_k = cp.type_v = _ggml_type(str(self.cfg.kv_dtype))
        cp.no_perf = True
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            L.llama_model_free(model)
            raise RuntimeError(f"llama.cpp failed to create a context for {path}:\n{''.join(_LOG)[-2000:]}")
        memory = parse_memory_log("".join(_LOG))
        raw: dict[str, list[float]] = {}
        try:
            if timing:
                raw = self._time(L, ctx, vocab, wl, prefill_repeats, decode_steps)
        finally:
            L.llama_free(ctx)
            L.llama_model_free(model)
        return memory, raw

    def _time(self, L: Any, ctx: Any, vocab: int, wl: Workload, repeats: int, steps: int) -> dict[str, list[float]]:
        rng = np.random.default_rng(0)
        mem = L.llama_get_memory(ctx)
        n_batch = max(self.settings.n_batch, wl.input_len * wl.batch)
        batch = L.llama_batch_init(n_batch, 0, wl.batch)

        wall: dict[str, list[float]] = {"prefill_ms": [], "decode_ms": []}
        cpu_clock = self.clock() == "thread_cpu"

        def run(tokens: list[tuple[int, int, int, bool]], key: str | None = None) -> float:
            batch.n_tokens = len(tokens)
            for j, (tok, pos, seq, logit) in enumerate(tokens):
                batch.token[j] = tok
                batch.pos[j] = pos
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = logit
            c = time.thread_time()
            t = time.perf_counter()
            rc = L.llama_decode(ctx, batch)
            L.llama_synchronize(ctx)
            dt = (time.perf_counter() - t) * 1e3
            dc = (time.thread_time() - c) * 1e3
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}:\n{''.join(_LOG)[-1500:]}")
            if key:
                wall[key].append(dt)
            return dc if cpu_clock else dt

        def prompt(n: int, start: int = 0, seqs: int = 1) -> list[tuple[int, int, int, bool]]:
            toks = rng.integers(0, vocab, size=n)
            return [
                (int(toks[p - start]), p, s, p == start + n - 1) for s in range(seqs) for p in range(start, start + n)
            ]

        try:
            prefill: list[float] = []
            for r in range(repeats + 1):
                L.llama_memory_clear(mem, True)
                dt = run(prompt(wl.input_len, 0, wl.batch), "prefill_ms" if r else None)
                if r:
                    prefill.append(dt)
            # fill to the decode context C, then time steps at position C
            c = self.decode_context(wl)
            L.llama_memory_clear(mem, True)
            for start in range(0, c, n_batch):
                run(prompt(min(n_batch, c - start), start, 1))
            for s in range(1, wl.batch):
                L.llama_memory_seq_cp(mem, 0, s, -1, -1)
            warm = self.settings.decode_warmup
            decode: list[float] = []
            for step in range(steps + warm):
                toks = rng.integers(0, vocab, size=wl.batch)
                dt = run([(int(toks[s]), c, s, True) for s in range(wl.batch)], "decode_ms" if step >= warm else None)
                for s in range(wl.batch):
                    L.llama_memory_seq_rm(mem, s, c, -1)
                if step >= warm:
                    decode.append(dt)
        finally:
            L.llama_batch_free(batch)
        return {
            "prefill_ms": prefill,
            "decode_ms": decode,
            "prefill_wall_ms": wall["prefill_ms"],
            "decode_wall_ms": wall["decode_ms"],
        }


def _ggml_type(name: str) -> int:
    """ggml type id of a KV cache dtype (f32, f16, bf16, q8_0, q4_0)."""
    ids = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "bf16": 30}
    if name not in ids:
        raise ValueError(f"engine.kv_dtype {name!r} not supported by llama.cpp here; use one of {sorted(ids)}")
    return ids[name]

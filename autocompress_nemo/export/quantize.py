"""Quantize an F16 GGUF with llama.cpp's own quantizer and read back what it wrote.

``quantize_gguf(src, dst, dtype)`` runs ``llama_model_quantize`` (llama-cpp-python) at the
``llama_ftype`` of ``dtype`` (``costs/gguf_types.LLAMA_CPP_DTYPES``) and returns the file's
per-tensor type table; ``quant_record`` compares it with what the dtype asks for each role and
flags every fallback (a tensor whose type differs from the requested one because its row length
is off the type's block), with the effective bits per weight.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from autocompress_nemo.costs.gguf_types import LLAMA_CPP_DTYPES, check_dtype, gguf_tensors


def read_tensor_types(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"type", "shape", "n_elements", "n_bytes"}}`` of every tensor in a GGUF (its tensor
    table, read with ``gguf.GGUFReader``; ``shape`` is ``(ne[0], ne[1], ...)``, rows first)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {
        t.name: {
            "type": t.tensor_type.name.lower(),
            "shape": [int(x) for x in t.shape],
            "n_elements": int(t.n_elements),
            "n_bytes": int(t.n_bytes),
        }
        for t in r.tensors
    }


def quantize_gguf(src: str | Path, dst: str | Path, dtype: str, *, threads: int = 1) -> dict[str, dict[str, Any]]:
    """Quantize the F16 GGUF ``src`` to ``dst`` at ``dtype`` with llama.cpp's quantizer; returns
    ``read_tensor_types(dst)``. f16 / f32 copy the file's tensors as they are (``only_copy``
    is not used: the writer already wrote them in that type, so ``src`` is copied)."""
    import shutil

    import llama_cpp as L

    check_dtype(dtype)
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dtype in ("f16", "f32"):
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
        return read_tensor_types(dst)
    p = L.llama_model_quantize_default_params()
    p.ftype = LLAMA_CPP_DTYPES[dtype]
    p.nthread = int(threads)
    tmp = dst.with_name(dst.name + ".tmp")
    rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {dtype}) returned {rc}")
    tmp.replace(dst)
    return read_tensor_types(dst)


def quant_record(spec: Any, types: dict[str, dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The export record of a quantized GGUF: each tensor's type, the type the dtype asks for its
    role (``costs/gguf_types``), the fallbacks (tensors whose type differs from that because of
    their row length) and the effective bits per weight of the matrices and of the whole file.

    ``predicted_bytes`` is the memory model's weight bytes (``costs/memory.weight_bytes``) and
    ``file_bytes`` the file's tensor bytes; ``predicted_exact`` says whether they agree."""
    from autocompress_nemo.costs.memory import weight_bytes

    want = {t.name: t for t in gguf_tensors(spec, dtype)}
    tensors, fallbacks = [], []
    mat_el = mat_bytes = 0
    for name, t in types.items():
        w = want.get(name)
        role = w.role if w else "?"
        asked = w.intended if w else None
        row = {
            "name": name,
            "role": role,
            "type": t["type"],
            "asked": asked,
            "shape": t["shape"],
            "bpw": 8.0 * t["n_bytes"] / max(1, t["n_elements"]),
        }
        tensors.append(row)
        if len(t["shape"]) >= 2 and t["shape"][1] > 1:
            mat_el += t["n_elements"]
            mat_bytes += t["n_bytes"]
        if asked is not None and asked != t["type"]:
            fallbacks.append(
                {
                    "name": name,
                    "asked": asked,
                    "got": t["type"],
                    "row": t["shape"][0],
                    "bpw": row["bpw"],
                    "why": f"row {t['shape'][0]} is not a multiple of the {asked} block",
                }
            )
    total_el = sum(t["n_elements"] for t in types.values())
    total_bytes = sum(t["n_bytes"] for t in types.values())
    predicted = weight_bytes(spec, dtype)
    return {
        "dtype": dtype,
        "tensors": tensors,
        "fallbacks": fallbacks,
        "bpw_matrices": 8.0 * mat_bytes / max(1, mat_el),
        "bpw": 8.0 * total_bytes / max(1, total_el),
        "file_bytes": total_bytes,
        "predicted_bytes": predicted,
        "predicted_exact": int(predicted) == total_bytes,
    }

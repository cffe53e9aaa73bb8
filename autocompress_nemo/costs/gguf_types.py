"""The storage type llama.cpp's quantizer gives every tensor of a GGUF, and what it costs.

``engine.dtype`` of the llama.cpp engine names a llama.cpp quantization (``llama_ftype``): models
are written F16 (``export/gguf.write_gguf``) and quantized by llama.cpp itself
(``export/quantize.quantize_gguf``). The quantizer does not give every tensor the requested type:

- **row blocks**: a quantized row is a whole number of blocks: 32 elements for Q8_0 / Q4_0 /
  Q4_1 / Q5_0 / Q5_1, 256 (``QK_K``) for the k-quants (Q4_K, Q5_K, Q6_K). A tensor whose row
  length (``ne[0]``, the *input* width of the matrix) is not a multiple falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 when the row is not a multiple of 32 either
  (the quantizer logs ``ncols N not divisible by 256 (required for type q4_K) -> falling back to
  q5_0``). The row a searched width feeds: hidden ``h`` for q / k / v / gate / up / token_embd /
  output, ``H*d`` (query heads x head dim) for attn_output, ffn ``F`` for ffn_down.
- **output / tied embedding**: ``output.weight`` (and ``token_embd.weight`` when the embedding is
  tied, since it is the output too) is Q8_0 if its row is off the requested type's block,
  else Q6_K unless Q8_0 was requested (so a Q4_0 / Q4_1 model still has a Q6_K or Q8_0 LM head).
  An untied ``token_embd`` keeps the requested type.
- **Q4_K_M more bits**: ``attn_v`` and ``ffn_down`` of some layers are Q6_K: counting the
  tensors of that name present in layer order (``i`` of ``n``; a layer without attention has no
  attn_v and does not count), those with ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``.
- norms (1-D) stay F32.

These are llama.cpp's ``llama_tensor_get_type`` (``src/llama-quant.cpp`` upstream; the installed
llama-cpp-python 0.3.36 ships only the compiled library, not the sources), read here by
measurement: tiny F16 models (uniform and heterogeneous, hidden 64 / 256 / 576, tied and untied,
a removed attention, ffn widths 200 / 256 / 384 / 512 / 768 / 1536) quantized with
``llama_model_quantize`` to each supported dtype and their tensor types read back with
``gguf.GGUFReader``; ``tests/test_quantized.py`` checks the rule against the file for every dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autocompress_nemo.arch.spec import ArchSpec

LLAMA_CPP_DTYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": 7, "q4_1": 3, "q4_0": 2, "q4_k_m": 15}
"""``engine.dtype`` values of the llama.cpp engine -> ``llama_ftype`` (LLAMA_FTYPE_ALL_F32,
MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_Q4_1, MOSTLY_Q4_0, MOSTLY_Q4_K_M)."""

BASE_TYPE: dict[str, str] = {
    "f32": "f32",
    "f16": "f16",
    "q8_0": "q8_0",
    "q4_1": "q4_1",
    "q4_0": "q4_0",
    "q4_k_m": "q4_k",
}
"""The tensor type a dtype asks for (before the per-tensor rules)."""

GGML_BLOCK: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),  # 32 int8 + one f16 scale
    "q4_0": (32, 18),  # 32 4-bit + one f16 scale
    "q4_1": (32, 20),  # 32 4-bit + f16 scale + f16 min
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "fp8": (1, 1),
    "int8": (1, 1),
    "nvfp4": (16, 9),  # 16 FP4 (E2M1) values + one FP8 (E4M3) scale (per-tensor FP32 scale ignored)
}
"""(elements per block, bytes per block) of the storage types (GGML's as ggml-common.h defines them)."""
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
MORE_BITS_ROLES = ("attn_v", "ffn_down")
"""The roles Q4_K_M raises to Q6_K on some layers."""


def check_dtype(dtype: str) -> str:
    """``dtype`` if the llama.cpp engine supports it, else a ValueError naming those it does."""
    if dtype not in LLAMA_CPP_DTYPES:
        raise ValueError(f"llama.cpp engine.dtype {dtype!r} is not supported; use one of {', '.join(LLAMA_CPP_DTYPES)}")
    return dtype


def is_quantized(dtype: str) -> bool:
    """A dtype llama.cpp's quantizer produces from an F16 file (not f16 / f32)."""
    return dtype in LLAMA_CPP_DTYPES and dtype not in ("f16", "f32")


def row_block(type_: str) -> int:
    """Elements per block of a GGML storage type: the row length it needs a multiple of."""
    return GGML_BLOCK[type_][0]


def row_align(dtype: str, role: str = "ffn_down") -> int:
    """The row-length multiple every tensor of ``role`` needs to get the type ``dtype`` asks for
    (no fallback): the block of Q6_K as well for the Q4_K_M more-bits roles (both 256)."""
    return row_block(BASE_TYPE[check_dtype(dtype)])


def use_more_bits(i: int, n: int) -> bool:
    """Q4_K_M's layers of more bits: ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fallback(type_: str, row: int) -> str:
    """The type a tensor of row length ``row`` really gets when ``type_`` is asked."""
    if row % row_block(type_):
        type_ = _FALLBACK.get(type_, type_)
        if row % row_block(type_):
            type_ = "f16"
    return type_


def intended_type(dtype: str, role: str, row: int, *, more_bits: bool = False, tied: bool = False) -> str:
    """The type llama.cpp chooses for a matrix of ``role`` before the row-block fallback."""
    base = BASE_TYPE[check_dtype(dtype)]
    if not is_quantized(dtype):
        return base
    if role == "output" or (role == "token_embd" and tied):
        if row % row_block(base):
            return "q8_0"
        return base if base == "q8_0" else "q6_k"
    if dtype == "q4_k_m" and role in MORE_BITS_ROLES and more_bits:
        return "q6_k"
    return base


def tensor_type(dtype: str, role: str, row: int, *, more_bits: bool = False, tied: bool = False) -> str:
    """The type llama.cpp writes for a matrix of ``role`` with rows of ``row`` elements."""
    return fallback(intended_type(dtype, role, row, more_bits=more_bits, tied=tied), row)


def type_bytes(n_elements: int, type_: str) -> int:
    n, b = GGML_BLOCK[type_]
    return math.ceil(n_elements / n) * b


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a llama / deci GGUF: its name, role, ``(row, rows)`` shape (``ne[0], ne[1]``),
    the type llama.cpp asks for the role and the type it writes."""

    name: str
    role: str
    shape: tuple[int, ...]
    intended: str
    type: str

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        return type_bytes(self.n_elements, self.type)

    @property
    def fallback(self) -> bool:
        return self.type != self.intended


def gguf_tensors(spec: ArchSpec, dtype: str) -> list[GgufTensor]:
    """Every tensor ``write_gguf`` writes for ``spec`` (in file order) with the type llama.cpp's
    quantizer gives it at ``dtype``."""
    check_dtype(dtype)
    h = spec.hidden
    layers = spec.layers()
    out: list[GgufTensor] = []

    def add(name: str, role: str, shape: tuple[int, ...], more_bits: bool = False) -> None:
        if len(shape) == 1:
            out.append(GgufTensor(name, role, shape, "f32", "f32"))
            return
        want = intended_type(dtype, role, shape[0], more_bits=more_bits, tied=spec.tied_embeddings)
        out.append(GgufTensor(name, role, shape, want, fallback(want, shape[0])))

    add("token_embd.weight", "token_embd", (h, spec.vocab))
    add("output_norm.weight", "norm", (h,))
    if not spec.tied_embeddings:
        add("output.weight", "output", (h, spec.vocab))
    n_v = sum(1 for a, _ in layers if not a.removed)
    n_down = sum(1 for _, m in layers if not m.removed)
    i_v = i_down = 0
    for i, (a, m) in enumerate(layers):
        if not a.removed:
            q, kv = a.num_heads * a.head_dim, a.num_kv_groups * a.head_dim
            add(f"blk.{i}.attn_norm.weight", "norm", (h,))
            add(f"blk.{i}.attn_q.weight", "attn_q", (h, q))
            add(f"blk.{i}.attn_k.weight", "attn_k", (h, kv))
            add(f"blk.{i}.attn_v.weight", "attn_v", (h, kv), use_more_bits(i_v, n_v))
            add(f"blk.{i}.attn_output.weight", "attn_output", (q, h))
            i_v += 1
        if not m.removed:
            add(f"blk.{i}.ffn_norm.weight", "norm", (h,))
            add(f"blk.{i}.ffn_gate.weight", "ffn_gate", (h, m.ffn))
            add(f"blk.{i}.ffn_up.weight", "ffn_up", (h, m.ffn))
            add(f"blk.{i}.ffn_down.weight", "ffn_down", (m.ffn, h), use_more_bits(i_down, n_down))
            i_down += 1
    return out


def gguf_weight_bytes(spec: ArchSpec, dtype: str) -> int:
    """Bytes of all tensors of ``spec``'s GGUF at ``dtype`` (the file's tensor data, unpadded)."""
    return sum(t.n_bytes for t in gguf_tensors(spec, dtype))


MORE_BITS_SHARE = 0.5
"""Q4_K_M: the share of attn_v / ffn_down tensors raised to Q6_K as the layer count grows
(``1/8 + 1/8 + (6/8)/3``); a block priced without its position gets this mix."""


def role_bytes(dtype: str, role: str, shape: tuple[int, int], *, more_bits: float | bool = False) -> float:
    """Bytes of one matrix of ``role``; ``more_bits`` a share in [0, 1] prices the Q4_K_M more-bits
    roles as that mix of their Q6_K and Q4_K types (a block whose position is not known)."""
    n = shape[0] * shape[1]
    lo = type_bytes(n, tensor_type(dtype, role, shape[0], more_bits=False))
    share = float(more_bits)
    if share and dtype == "q4_k_m" and role in MORE_BITS_ROLES:
        hi = type_bytes(n, tensor_type(dtype, role, shape[0], more_bits=True))
        return (1 - share) * lo + share * hi
    return float(lo)


GPU_ROW_ALIGN: dict[str, int] = {"fp8": 16, "nvfp4": 16}
"""TensorRT-LLM / vLLM weight dtypes -> the multiple a GEMM's input width (``in_features``: the
ffn width for down_proj) must be, **estimated, not measured** (no GPU engine was run for this):
NVFP4 scales blocks of 16 inputs and asserts ``in_features % scaling_vector_size == 0`` with
``scaling_vector_size = 16`` (TensorRT-LLM ``tensorrt_llm/_torch/modules/linear.py``, NVFP4 linear;
``tensorrt_llm/quantization/layers.py`` ``FP4Linear``: "Input features must be a multiple of 16
for FP4 GEMM"); FP8 (per-tensor scales) runs cuBLASLt / CUTLASS FP8 GEMMs whose 16-byte operand
alignment is 16 FP8 elements."""

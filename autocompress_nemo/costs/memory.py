"""Serving memory as small pure functions: weights, KV cache, SSM state, workspace, buffers.

Legend as in ``arch/counts.py`` (h hidden, V vocab, H/G/d heads/KV groups/head dim, F ffn,
Hm/Pm/N/Gm/K Mamba). ``B`` batch (concurrent sequences), ``C`` context length, ``b(t)``
bytes per element of dtype ``t``.

Total serving memory (what a memory budget constrains)::

    M = W (weights) + KV (B*C tokens) + S (SSM state, B sequences) + workspace + buffers

W and KV/S follow from the shapes; workspace (the engine's activation peak, llama.cpp's
"compute buffer") and runtime buffers (llama.cpp's "output buffer": logits for B
sequences) are engine constants, calibrated from what the engine reports while profiling
(``costs/profile/``) and stored in the cost table.
"""

from __future__ import annotations

import math

from autocompress_nemo.arch.counts import block_params, kv_bytes_per_token, state_elements
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.costs.gguf_types import (
    GGML_BLOCK,
    MORE_BITS_SHARE,
    gguf_weight_bytes,
    is_quantized,
    role_bytes,
    tensor_type,
    type_bytes,
)


def bytes_per_element(dtype: str) -> float:
    """``bytes_per_block / elements_per_block``: f16 2, f32 4, q8_0 34/32, q4_0 18/32, q4_1 20/32."""
    key = dtype.lower()
    if key not in GGML_BLOCK:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(GGML_BLOCK)}")
    n, nbytes = GGML_BLOCK[key]
    return nbytes / n


def tensor_bytes(n_elements: int, dtype: str) -> int:
    """Storage of one tensor: ``ceil(n / block) * block_bytes`` (rows are whole blocks in GGUF)."""
    n, nbytes = GGML_BLOCK[dtype.lower()]
    return math.ceil(n_elements / n) * nbytes


def small_params(b: Block, hidden: int) -> int:
    """Parameters kept in F32 by GGUF writers: norm vectors and Mamba's per-head scalars.

    attention / mlp / moe: ``h`` (input norm); mamba: ``h + Hm*Pm (gated norm) + 3*Hm
    (dt_bias, A_log, D) + conv_dim (conv bias)``. 0 when removed.
    """
    return 0 if b.removed else kind_of(b).small_params(b, hidden)


def _gguf_priced(dtype: str, kinds: set[str]) -> bool:
    """Weights priced tensor by tensor with llama.cpp's quantizer rules (``costs/gguf_types.py``):
    a llama.cpp quantization (q8_0, q4_0, q4_1, q4_k_m) of attention / mlp blocks."""
    return is_quantized(dtype) and kinds <= {"attention", "mlp"}


def block_weight_bytes(b: Block, hidden: int, dtype: str, norm_dtype: str = "f32", active: bool = False) -> float:
    """Weights of one block: ``(P - p_small) * b(dtype) + p_small * b(norm_dtype)``.

    ``P = block_params`` (arch/counts.py), ``p_small = small_params`` (norms and scalars,
    stored F32 in GGUF; pass ``norm_dtype=dtype`` for engines that store all in one dtype).

    A llama.cpp quantization (q8_0, q4_0, q4_1, q4_k_m) prices an attention / mlp block tensor by
    tensor with the type llama.cpp's quantizer gives it (``costs/gguf_types.py``: row-block
    fallbacks; Q4_K_M's Q6_K attn_v / ffn_down priced as the ``MORE_BITS_SHARE`` mix since a block
    alone has no position; ``weight_bytes`` of a whole model is exact).
    """
    if not b.removed and _gguf_priced(dtype, {b.kind}):
        s = small_params(b, hidden)
        shapes = kind_of(b).gguf_matrices(b, hidden)
        return sum(role_bytes(dtype, r, sh, more_bits=MORE_BITS_SHARE) for r, sh in shapes) + s * 4
    p = block_params(b, hidden, active=active)
    s = small_params(b, hidden)
    return (p - s) * bytes_per_element(dtype) + s * bytes_per_element(norm_dtype)


def embedding_weight_bytes(spec: ArchSpec, dtype: str, norm_dtype: str = "f32") -> float:
    """Embedding ``V*h``, LM head ``V*h`` when untied, final norm ``h``:
    ``V*h*(1 or 2)*b(dtype) + h*b(norm_dtype)``; a llama.cpp quantization with the types its
    quantizer gives the embedding and the LM head (``costs/gguf_types.py``)."""
    if _gguf_priced(dtype, set()):
        tied = spec.tied_embeddings
        roles = ["token_embd"] + ([] if tied else ["output"])
        return sum(
            type_bytes(spec.vocab * spec.hidden, tensor_type(dtype, r, spec.hidden, tied=tied)) for r in roles
        ) + spec.hidden * bytes_per_element("f32")
    n = spec.vocab * spec.hidden * (1 if spec.tied_embeddings else 2)
    return n * bytes_per_element(dtype) + spec.hidden * bytes_per_element(norm_dtype)


def weight_bytes(spec: ArchSpec, dtype: str, norm_dtype: str = "f32") -> float:
    """All weights: ``embedding_weight_bytes + sum over blocks of block_weight_bytes``; for a
    llama.cpp quantization of a Llama-style model, exactly the tensor bytes of the GGUF llama.cpp's
    quantizer writes (``costs/gguf_types.gguf_weight_bytes``: per-layer Q4_K_M types included)."""
    if spec.is_dense_layered() and _gguf_priced(dtype, set(spec.kinds())):
        return float(gguf_weight_bytes(spec, dtype))
    return embedding_weight_bytes(spec, dtype, norm_dtype) + sum(
        block_weight_bytes(b, spec.hidden, dtype, norm_dtype) for b in spec.blocks
    )


def block_kv_bytes(b: Block, context: int, batch: int, kv_dtype: str) -> float:
    """KV cache of one attention block at full context: ``2 * G * d * C * B * b(kv)`` (K and V); else 0."""
    return 0.0 if b.removed else kind_of(b).kv_bytes_per_token(b, bytes_per_element(kv_dtype)) * context * batch


def kv_cache_bytes(spec: ArchSpec, context: int, batch: int, kv_dtype: str) -> float:
    """Whole KV cache: ``kv_bytes_per_token(spec) * C * B`` = sum of ``block_kv_bytes``."""
    return kv_bytes_per_token(spec, bytes_per_element(kv_dtype)) * context * batch


def block_state_bytes(b: Block, batch: int, state_dtype: str, conv_extra: int = 0) -> float:
    """Mamba state of one block per ``B`` sequences, constant in context:
    ``(Hm*Pm*N + conv_dim*(K-1+e)) * B * b(state)``; 0 for other kinds. ``e`` (``conv_extra``):
    conv-state columns an engine keeps beyond the ``K-1`` past inputs (llama.cpp 0; transformers
    and mamba-ssm keep ``K``, ``e = 1``; calibrated by the profiler as ``memory.conv_extra``)."""
    return 0.0 if b.removed else kind_of(b).state_elements(b, conv_extra) * batch * bytes_per_element(state_dtype)


def ssm_state_bytes(spec: ArchSpec, batch: int, state_dtype: str, conv_extra: int = 0) -> float:
    """All Mamba state: ``ssm_state_bytes_per_sequence(spec) * B`` (+ ``conv_dim * e * B`` per block)."""
    return state_elements(spec, conv_extra) * batch * bytes_per_element(state_dtype)


def conv_extra_columns(spec: ArchSpec, batch: int, state_dtype: str, measured_state: float) -> int:
    """The ``conv_extra`` that explains an engine's measured state bytes of ``spec``:
    ``round((S - ssm_state_bytes(e=0)) / (sum conv_dim * B * b))``; 0 without Mamba blocks."""
    conv = state_elements(spec, 1) - state_elements(spec, 0)  # conv channels summed over Mamba blocks
    if not conv or measured_state <= 0:
        return 0
    return int(
        round(
            (measured_state - ssm_state_bytes(spec, batch, state_dtype))
            / (conv * batch * bytes_per_element(state_dtype))
        )
    )


def output_buffer_bytes(vocab: int, batch: int, logits_bytes: int = 4) -> int:
    """Logits of the last token of every sequence: ``V * B * 4`` (f32); llama.cpp adds small padding,
    so the table stores the value it reports."""
    return vocab * batch * logits_bytes


def block_memory_bytes(
    b: Block,
    hidden: int,
    *,
    dtype: str,
    kv_dtype: str,
    context: int,
    batch: int,
    norm_dtype: str = "f32",
    state_dtype: str = "f32",
) -> float:
    """The additive memory of one block: its weights + its KV (attention) or state (Mamba)
    at full context ``C`` and batch ``B``."""
    return (
        block_weight_bytes(b, hidden, dtype, norm_dtype)
        + block_kv_bytes(b, context, batch, kv_dtype)
        + block_state_bytes(b, batch, state_dtype)
    )


def workspace_estimate(spec: ArchSpec, tokens: int, bytes_act: int = 4) -> float:
    """Uncalibrated activation peak of one forward over ``tokens`` tokens (used only when no
    engine reported its workspace, e.g. roofline planning):
    ``tokens * max(V, 2*F_max + h, H_max*d + 2*G_max*d) * b(act)``.
    The logits ``tokens x V`` usually dominate (llama.cpp reserves for ``n_ubatch`` outputs)."""
    widths = [spec.vocab] + [kind_of(b).activation_width(b, spec.hidden) for b in spec.blocks if not b.removed]
    return float(tokens * max(widths) * bytes_act)

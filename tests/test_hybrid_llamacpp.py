"""llama.cpp serving heterogeneous Nemotron-H hybrids (``nemotron_h`` / ``nemotron_h_moe`` GGUF).

Parity: a heterogeneous student (per-layer query / KV heads, dense ffn or routed-expert widths,
top-k, removed blocks) is built as the project's Megatron model, exported from that model's own
weights (``megatron_to_hf``) to GGUF, and run in llama.cpp in a child process; its logits at every
position match the Megatron model's. F32 weights, F32 KV cache (the F16 cache adds ~1e-3) and flash
attention off (on CPU it adds ~1e-3 too).
transformers' NemotronH clamps ``dt >= time_step_min`` and llama.cpp does not; the reference here
is the project's Megatron model, which does not clamp either, and the random weights keep
``softplus(dt_bias) >= 0.01`` (``random_hf_state_dict``), so the clamp would be inactive anyway.
Tolerance 1e-5 on logits of magnitude ~1 (float32, different scan / matmul orders); measured
7e-7 (nemotron_h_moe) and 1e-6 (nemotron_h).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hybrid_utils import requires_mamba

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock

llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
TOL = 1e-5
A, M, E, F = AttentionBlock, MambaBlock, MoeBlock, MlpBlock


def moe_student() -> ArchSpec:
    """nemotron_h_moe: expert widths 64 / 32 / 48, top-k 2 / 3 / 2 of 4, query heads 4 / 2, KV 2 / 1,
    a removed Mamba block and a removed attention block."""
    blocks = (
        M(4, 16, 16, 2),
        A(4, 2, 16),
        E(4, 64, 2, 32, 0, "relu2"),
        M(0, 16, 16, 2),
        E(4, 32, 3, 32, 0, "relu2"),
        A(2, 1, 16),
        M(4, 16, 16, 2),
        A(0, 0, 16),
        E(4, 48, 2, 32, 0, "relu2"),
    )
    return ArchSpec(hidden=64, vocab=256, blocks=blocks, family="nemotron_h", name="moe_student")


def dense_student() -> ArchSpec:
    """nemotron_h: dense ffn widths 96 / 32, a removed MLP block, query heads 4 / 2."""
    blocks = (A(4, 2, 16), M(4, 16, 16, 2), F(96, "relu2"), M(4, 16, 16, 2), F(0, "relu2"), A(2, 2, 16), F(32, "relu2"))
    return ArchSpec(hidden=64, vocab=256, blocks=blocks, family="nemotron_h", name="dense_student")


def _parity(spec: ArchSpec, tmp_path) -> float:
    from autocompress_nemo.costs.engines.llamacpp_child import gguf_logits
    from autocompress_nemo.export.gguf_hybrid import gguf_arch, write_hybrid_gguf
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.nemotron_h import hf_to_megatron, megatron_to_hf, random_hf_state_dict

    model = build_model(spec)
    hf_to_megatron(spec, random_hf_state_dict(spec, seed=5), model)
    tokens = torch.randint(0, spec.vocab, (1, 12), generator=torch.Generator().manual_seed(4))
    ours = forward_logits(model, tokens)[0].detach().double().numpy()
    path = write_hybrid_gguf(spec, tmp_path / f"{spec.name}.gguf", megatron_to_hf(spec, model), dtype="f32")
    theirs = gguf_logits(path, tokens[0].tolist(), kv_dtype="f32")
    assert np.abs(ours).max() > 0.3  # a real signal
    err = float(np.abs(theirs - ours).max())
    print(f"{spec.name} ({gguf_arch(spec)}): llama.cpp vs Megatron max |dlogits| = {err:.2e}")
    return err


@llama_cpp
@requires_mamba
@pytest.mark.parametrize("make", [moe_student, dense_student], ids=["nemotron_h_moe", "nemotron_h"])
def test_heterogeneous_hybrid_gguf_matches_megatron(megatron_tp1, tmp_path, make):
    assert _parity(make(), tmp_path) < TOL

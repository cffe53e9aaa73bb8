"""Parity of the project's Megatron Nemotron-H against transformers' own ``NemotronHForCausalLM``.

The installed transformers (5.x) has ``NemotronHForCausalLM``; the reference is that class, loaded
from the directory the project exports (so export naming is checked too). Its Mamba-2 mixer
would pick mamba-ssm's Triton kernels when mamba-ssm is installed (they need CUDA); the test
switches it to transformers' own pure-PyTorch SSD scan and convolution (the functions the
decorators fall back to), which is independent of the mamba-ssm reference scan that Megatron
runs on CPU.

Weights: random (``random_hf_state_dict``), with ``softplus(dt_bias) >= 0.01``: transformers
clamps the Mamba time step from below at ``time_step_min`` (1e-3) while Megatron does not; the
clamp is inactive for these weights. Tolerance 1e-4 on logits of magnitude ~2: float32, different
scan algorithms (chunked vs chunked with other reductions), measured ~5e-7.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hybrid_utils import conf_spec, ids

from autocompress_nemo.arch.spec import MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.nemotron_h import export_hf, hf_to_megatron, random_hf_state_dict

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is None,
    reason="Mamba blocks need mamba-ssm (install: models/hybrid/builder.py MAMBA_INSTALL)",
)
transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture
def hf_torch_mamba(monkeypatch):
    """transformers' NemotronH with its pure-PyTorch Mamba ops (not mamba-ssm's Triton kernels)."""
    mn = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    for f in ("mamba2_chunk_scan", "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined"):
        monkeypatch.setattr(mn, f, getattr(mn, f).__wrapped__)
    return mn


def _parity(spec, tmp_path, hf_torch_mamba) -> float:
    sd = random_hf_state_dict(spec, seed=1)
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    x = ids(spec)
    ours = forward_logits(model, x)
    export_hf(spec, sd, tmp_path)
    ref_model = hf_torch_mamba.NemotronHForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = ref_model(x).logits.float()
    assert ref.abs().max() > 0.5  # a real signal, not zeros
    return (ours - ref).abs().max().item()


def test_tiny_nemotron_h_matches_transformers(megatron_tp1, tmp_path, hf_torch_mamba):
    spec = conf_spec("tiny_hybrid")
    assert spec.pattern == "M*EME-"
    err = _parity(spec, tmp_path, hf_torch_mamba)
    print(f"tiny_hybrid vs transformers NemotronHForCausalLM: max |dlogits| = {err:.2e}")
    assert err < TOL


def test_latent_moe_matches_transformers(megatron_tp1, tmp_path, hf_torch_mamba):
    """LatentMoE (Nemotron 3 Super): routed experts in a 32-wide latent space, shared expert full width."""
    base = conf_spec("tiny_hybrid")
    moe = next(b for b in base.blocks if isinstance(b, MoeBlock))
    spec = base.replace(
        blocks=tuple(MoeBlock(4, 48, 2, 64, 32, "relu2") if b == moe else b for b in base.blocks), name="tiny_latent"
    )
    err = _parity(spec, tmp_path, hf_torch_mamba)
    print(f"tiny LatentMoE vs transformers: max |dlogits| = {err:.2e}")
    assert err < TOL

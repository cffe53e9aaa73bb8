"""The hybrid / MoE Megatron builder: tiny Nemotron-H and Qwen3-MoE models build on CPU with the
right shapes and parameter counts; heterogeneous per-block shapes (expert counts, expert / shared /
dense widths, Mamba heads, removed blocks) build and match an independent transformers model with
per-block configs; Qwen3-MoE matches transformers' ``Qwen3MoeForCausalLM``; bad sizes fail clearly.

Tolerance 1e-4 on logits of magnitude ~1-2: float32, different kernels; measured ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_utils import conf_spec, hetero_hybrid_spec, ids, requires_mamba, transformers_nemotron_h

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import MambaBlock, MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron, megatron_to_hf
from autocompress_nemo.models.hybrid.stack import NoOpBlock
from autocompress_nemo.models.hybrid.state_dict import hf_shapes, random_hf_state_dict

TOL = 1e-4


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _counted(spec) -> int:
    """arch.counts.param_count plus the Qwen3 per-head q/k norms, which counts.py does not model."""
    qk = sum(2 * b.head_dim for b in spec.blocks if b.kind == "attention" and not b.removed)
    return param_count(spec) + (qk if spec.family == "qwen3_moe" else 0)


@requires_mamba
@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_moe"])
def test_tiny_configs_build_with_counted_params(megatron_tp1, name):
    spec = conf_spec(name)
    model = build_model(spec)
    assert type(model).__name__ == "HybridModel" and len(model.decoder.layers) == len(spec.blocks)
    assert _n_params(model) == _counted(spec)
    assert sum(torch.Size(s).numel() for s in hf_shapes(spec).values()) == _counted(spec) + sum(
        b.num_experts for b in spec.blocks if isinstance(b, MoeBlock) and spec.family == "nemotron_h"
    )
    sd = random_hf_state_dict(spec, seed=2)
    hf_to_megatron(spec, sd, model)
    back = megatron_to_hf(spec, model)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    logits = forward_logits(model, ids(spec))
    assert logits.shape == (2, 12, spec.vocab) and torch.isfinite(logits).all()


@requires_mamba
def test_heterogeneous_hybrid_builds_and_matches_transformers(megatron_tp1, monkeypatch):
    import transformers.models.nemotron_h.modeling_nemotron_h as mn

    for f in ("mamba2_chunk_scan", "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined"):
        monkeypatch.setattr(mn, f, getattr(mn, f).__wrapped__)
    spec = hetero_hybrid_spec()
    model = build_model(spec)
    layers = model.decoder.layers
    assert _n_params(model) == param_count(spec)
    for i, b in enumerate(spec.blocks):
        assert isinstance(layers[i], NoOpBlock) == b.removed, i
        if isinstance(b, MoeBlock) and b.num_experts:
            assert len(layers[i].mlp.experts.local_experts) == b.num_experts
            assert layers[i].mlp.router.topk == b.top_k
        if isinstance(b, MambaBlock) and not b.removed:
            assert layers[i].mixer.nheads == b.num_heads
    sd = random_hf_state_dict(spec, seed=3)
    hf_to_megatron(spec, sd, model)
    x = ids(spec)
    ours = forward_logits(model, x)
    with torch.no_grad():
        ref = transformers_nemotron_h(spec, sd)(x).logits.float()
    err = (ours - ref).abs().max().item()
    print(f"heterogeneous hybrid vs transformers (per-block configs): max |dlogits| = {err:.2e}")
    assert ref.abs().max() > 0.5 and err < TOL
    # gradients reach every block that is present
    model.train()
    loss = forward_logits(model, x).logsumexp(-1).mean()
    loss.backward()
    grads = megatron_to_hf(spec, model, grads=True)
    assert set(grads) == set(sd) - {k for k in sd if k.endswith("e_score_correction_bias")}
    assert not [k for k, g in grads.items() if g.abs().max() == 0]


def test_qwen3_moe_matches_transformers(megatron_tp1, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from autocompress_nemo.models.qwen3_moe import export_hf, load_hf

    spec = conf_spec("tiny_moe")
    sd = random_hf_state_dict(spec, seed=4)
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    x = ids(spec)
    ours = forward_logits(model, x)
    export_hf(spec, sd, tmp_path)
    ref_model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = ref_model(x).logits.float()
    err = (ours - ref).abs().max().item()
    print(f"tiny_moe vs transformers Qwen3MoeForCausalLM: max |dlogits| = {err:.2e}")
    assert ref.abs().max() > 0.5 and err < TOL
    spec2, sd2, _ = load_hf(tmp_path, tokenizer=False)
    assert spec2.blocks == spec.blocks and set(sd2) == set(sd)


def test_bad_sizes_fail_clearly(megatron_tp1):
    spec = conf_spec("tiny_moe")
    bad = spec.replace_block(1, MoeBlock(3, 64, 1, 0, 0, "swiglu"))
    from autocompress_nemo.models.hybrid.configs import check_shardable

    with pytest.raises(ValueError, match="block 1: 3 experts vs EP=2"):
        check_shardable(bad, tp=1, ep=2, etp=1)
    with pytest.raises(ValueError, match="top_k=1 and a sigmoid router"):
        build_model(conf_spec("tiny_hybrid").replace_block(2, MoeBlock(4, 64, 1, 64, 0, "relu2")))
    with pytest.raises(ValueError, match="must alternate attention"):
        build_model(spec.replace(blocks=spec.blocks[1:]))

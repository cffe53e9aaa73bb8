"""Hugging Face export round trip of a heterogeneous hybrid in the Nemotron-H Puzzle format:
Megatron model -> export -> re-import -> rebuilt Megatron model gives identical logits; the config
carries the per-block expert count, expert size, top-k, shared-expert size, dense ffn size and
Mamba heads; removed blocks are dropped (a no-op computes the identity). Uniform models are written
as plain ``NemotronHForCausalLM``.

Tolerance: 0 difference is expected (same float32 weights, same kernels); 1e-6 allows only
reordering noise.
"""

from __future__ import annotations

import json

import torch
from hybrid_utils import conf_spec, hetero_hybrid_spec, ids, requires_mamba

from autocompress_nemo.arch.spec import MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.nemotron_h import export_hf, export_spec, hf_to_megatron, load_hf, random_hf_state_dict

pytestmark = requires_mamba


def test_heterogeneous_export_round_trip(megatron_tp1, tmp_path):
    spec = hetero_hybrid_spec()
    model = build_model(spec)
    hf_to_megatron(spec, random_hf_state_dict(spec, seed=7), model)
    x = ids(spec)
    before = forward_logits(model, x)
    out = export_hf(spec, model, tmp_path)  # from the Megatron model itself
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronHPuzzleForCausalLM"] and cfg["model_type"] == "nemotron_h_puzzle"
    compact, index = export_spec(spec)
    assert index.count(None) == 3 and len(cfg["block_configs"]) == len(compact.blocks)
    assert cfg["hybrid_override_pattern"] == compact.pattern
    for b, bc in zip(compact.blocks, cfg["block_configs"], strict=True):
        if isinstance(b, MoeBlock):
            assert (
                bc["n_routed_experts"],
                bc["moe_intermediate_size"],
                bc["num_experts_per_tok"],
                bc["moe_shared_expert_intermediate_size"],
            ) == (b.num_experts, b.expert_ffn, b.top_k, b.shared_ffn)
        elif isinstance(b, MlpBlock):
            assert bc == {"block_type": "mlp", "intermediate_size": b.ffn}
        elif isinstance(b, MambaBlock):
            assert bc["block_type"] == "mamba" and bc.get("mamba_num_heads", cfg["mamba_num_heads"]) == b.num_heads
    # the shared-expert-only MoE block became a dense block of the shared width
    assert MlpBlock(48, "relu2") in compact.blocks

    spec2, sd2, _ = load_hf(out, tokenizer=False)
    assert spec2.blocks == compact.blocks
    model2 = build_model(spec2)
    hf_to_megatron(spec2, sd2, model2)
    after = forward_logits(model2, x)
    err = (after - before).abs().max().item()
    print(f"Puzzle export round trip: max |dlogits| = {err:.1e}")
    assert err <= 1e-6


def test_uniform_export_is_plain_nemotron_h(megatron_tp1, tmp_path):
    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=8)
    out = export_hf(spec, sd, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronHForCausalLM"] and "block_configs" not in cfg
    assert (
        cfg["hybrid_override_pattern"],
        cfg["n_routed_experts"],
        cfg["moe_shared_expert_intermediate_size"],
        cfg["mamba_num_heads"],
        cfg["intermediate_size"],
    ) == ("M*EME-", 4, 64, 4, 128)
    spec2, sd2, _ = load_hf(out, tokenizer=False)
    assert spec2.blocks == spec.blocks and all(torch.equal(sd2[k], sd[k]) for k in sd)


def test_puzzle_config_keeps_per_block_mamba_groups() -> None:
    """A Mamba block shrunk by whole groups round-trips through the Puzzle config (n_groups per block)."""
    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.arch.spec import MambaBlock
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec, spec_from_hf_config

    spec = spec_from_model_config(compose(["model=tiny_hybrid"]).model)
    i = next(i for i, b in enumerate(spec.blocks) if b.kind == "mamba")
    b = spec.blocks[i]
    child = spec.replace_block(i, MambaBlock(b.num_heads // b.num_groups, b.head_dim, b.state_size, 1, b.conv_kernel))
    assert spec_from_hf_config(hf_config_from_spec(child)).blocks[i] == child.blocks[i]

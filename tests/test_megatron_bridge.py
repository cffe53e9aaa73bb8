"""Megatron-Bridge (the NeMo Framework's LLM side), measured on this CPU in its own venv.

Versions measured: megatron-bridge 0.6.2, megatron-core 0.19.2, transformers 5.12.1, torch 2.14.1 (CUDA
build, no driver), gloo, world size 1 (``autocompress_nemo.models.bridge.TESTED_VERSIONS``). Each test
runs one command of ``python -m autocompress_nemo.models.bridge`` in ``.venv-bridge``
(``scripts/make_bridge_venv.sh``; ``$ACN_BRIDGE_PYTHON`` points elsewhere) and checks what it measured:

- ``import megatron.bridge`` needs Transformer Engine (``megatron/bridge/peft/lora_layers.py:20``), which
  does not install without CUDA: everything below imports it with an import-only stand-in and builds
  megatron-core local-spec models (``models/bridge.py`` says how);
- in the project's interpreter (transformers 5.24) it does not import at all;
- ``AutoBridge``: Llama (tiny, SmolLM2-135M from its GGUF), DeciLM heterogeneous through
  ``llama_nemotron`` and a tiny Nemotron-H (Mamba + attention + MoE + MLP) give the same logits as the
  project's adapter (``models/hybrid/state_dict.py``) on the same weights and batch, and export back to
  the same Hugging Face tensors; a student whose query heads vary per layer (what llama.cpp targets
  search) is refused by ``llama_nemotron``;
- ``save_megatron_model`` stops at ``torch.cuda.get_rng_state()`` (``training/checkpointing.py``);
- a heterogeneous student checkpoint written by the project loads through Megatron-Bridge's own loader
  (``load_model_config`` + ``build_and_load_model``) once ``run_config.yaml`` is written, with logits
  equal to the project's within 1e-5; a uniform student's checkpoint does not (its layers are saved one
  by one, Megatron-Bridge's GPT provider expects them stacked);
- the training loops (``finetune`` / ``distill``) stop at import: ``training/pretrain.py`` imports
  ``nvidia_resiliency_ext.inprocess``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.models.bridge import BRIDGE_VENV, TESTED_VERSIONS, bridge_python, run_bridge

needs_bridge = pytest.mark.skipif(
    bridge_python() is None,
    reason=f"no Megatron-Bridge venv at {BRIDGE_VENV}: scripts/make_bridge_venv.sh builds it (or set ACN_BRIDGE_PYTHON)",
)
TOL = 1e-5  # float32; measured 0.0 (same kernels, same weights, same order)
A, M = AttentionBlock, MlpBlock


def _spec(kind: str) -> ArchSpec:
    if kind == "uniform":
        return ArchSpec.llama(hidden=64, vocab=128, layers=2, heads=4, kv_groups=2, ffn=96, head_dim=16, name="u")
    if kind == "kv":  # vLLM / TensorRT-LLM-style DeciLM: KV groups, ffn and no-op blocks vary per layer
        blocks = (A(4, 2, 16), M(96), A(4, 1, 16), M(0), A(0, 0, 16), M(64), A(4, 4, 16), M(32))
    else:  # llama.cpp-style: query heads vary per layer too
        blocks = (A(4, 2, 16), M(96), A(2, 2, 16), M(0), A(0, 0, 16), M(64), A(6, 2, 16), M(32))
    return ArchSpec(hidden=64, vocab=128, blocks=blocks, name=f"hetero_{kind}", norm_eps=1e-5)


def _hf_dir(tmp: Path, kind: str) -> Path:
    from autocompress_nemo.models.llama.hf_io import export_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    spec = _spec(kind)
    return Path(export_hf(spec, random_hf_state_dict(spec, seed=5), tmp / f"hf_{kind}", engine=""))


def _check_versions(res: dict) -> None:
    got = res["versions"]
    for pkg in ("megatron-bridge", "megatron-core", "transformers"):
        assert got[pkg] == TESTED_VERSIONS[pkg], (pkg, got[pkg], "re-measure before relying on these tests")


def _converts_exactly(res: dict) -> None:
    assert res["max_abs_dlogit_vs_project"] <= TOL, res
    assert res["argmax_agree"] == 1.0
    assert res["exported_tensors"] == res["source_tensors"] and "exported_not_in_source" not in res
    assert res["max_abs_dweight_roundtrip"] == 0.0
    # Megatron-Bridge's own checkpoint writer saves the CUDA RNG state unconditionally
    assert not res["done"] and res["stopped_in"] == "save_megatron_model", res
    frames = " ".join(res["stopped_at"]["frames"])
    assert "megatron/bridge/training/checkpointing.py" in frames and "get_rng_state" in frames
    assert "Found no NVIDIA driver" in res["stopped_at"]["error"]


@needs_bridge
def test_import_needs_transformer_engine():
    res = run_bridge("probe")
    _check_versions(res)
    assert res["plain_import"] is False
    err = res["plain_import_error"]
    assert err["error"] == "ModuleNotFoundError: No module named 'transformer_engine'"
    assert (err["file"], err["line"]) == ("megatron/bridge/peft/lora_layers.py", 20)
    assert "megatron/bridge/models/conversion/auto_bridge.py:40 <module>" in err["frames"]
    assert res["te_standin"]
    for arch in ("LlamaForCausalLM", "DeciLMForCausalLM", "NemotronHForCausalLM"):
        assert arch in res["supported_sample"], arch


@needs_bridge
def test_project_interpreter_cannot_import_bridge():
    """Megatron-Bridge 0.6.2 on the project's interpreter (transformers 5.24): the HF <-> Megatron path
    cannot move into the main venv."""
    site = next((BRIDGE_VENV / "lib").glob("python3.*/site-packages"), None)
    if site is None or bridge_python() != BRIDGE_VENV / "bin" / "python":
        pytest.skip("needs the default .venv-bridge layout")
    code = (
        f"import sys; sys.path.append({str(site)!r})\n"
        "try:\n    import megatron.bridge\nexcept Exception as e:\n    print('ERR', type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    import transformers

    assert transformers.__version__.startswith("5.2"), transformers.__version__
    assert "ERR ModuleNotFoundError No module named 'transformers.modeling_attn_mask_utils'" in r.stdout, r.stdout[
        -2000:
    ]


@needs_bridge
def test_autobridge_llama_matches_project_adapter(tmp_path):
    res = run_bridge("hf", "--src", str(_hf_dir(tmp_path, "uniform")), "--work", str(tmp_path / "w"))
    assert res.get("megatron_class") == "GPTModel", res
    _converts_exactly(res)


@needs_bridge
def test_autobridge_llama_nemotron_heterogeneous_student(tmp_path):
    """DeciLM ``block_configs`` (KV groups, ffn widths, no-op attention and MLP per layer) through
    ``LlamaNemotronBridge`` / megatron-core's heterogeneous config; the export writes ``ffn_hidden_size``
    per block, which megatron-core takes exactly (from ``ffn_mult`` alone it rounds up to 256)."""
    res = run_bridge("hf", "--trust-remote-code", "--src", str(_hf_dir(tmp_path, "kv")), "--work", str(tmp_path / "w"))
    assert res.get("megatron_class") == "GPTModel", res
    _converts_exactly(res)


@needs_bridge
def test_llama_nemotron_refuses_per_layer_query_heads(tmp_path):
    """The llama.cpp-target student (query heads vary per layer, as the default run's) is not a
    Megatron-Bridge model: megatron-core's heterogeneous config varies KV groups, not query heads."""
    res = run_bridge("hf", "--trust-remote-code", "--src", str(_hf_dir(tmp_path, "q")), "--work", str(tmp_path / "w"))
    assert not res["done"] and res["stopped_in"].startswith("to_megatron_provider"), res
    err = res["stopped_at"]["error"]
    assert "Shape mismatch for megatron param decoder.layers.0.self_attention.linear_proj.weight" in err
    assert "Expected shape: torch.Size([64, 96])" in err and "Got shape: torch.Size([64, 64])" in err
    assert res["stopped_at"]["file"] == "megatron/bridge/models/conversion/model_bridge.py"


@needs_bridge
def test_autobridge_nemotron_h_matches_project_adapter(tmp_path):
    from omegaconf import OmegaConf

    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
    from autocompress_nemo.models.nemotron_h import export_hf

    conf = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny_hybrid.yaml"
    spec = spec_from_model_config(OmegaConf.load(conf))
    assert spec.pattern == "M*EME-"
    hf = export_hf(spec, random_hf_state_dict(spec, seed=5), tmp_path / "hf", engine="")
    res = run_bridge("hf", "--src", str(hf), "--work", str(tmp_path / "w"))
    assert res.get("megatron_class") == "HybridModel", res
    _converts_exactly(res)


@needs_bridge
@pytest.mark.slow
def test_autobridge_smollm2_matches_project_adapter(tmp_path, smollm2_gguf):
    """SmolLM2-135M: transformers 5.12.1 dequantizes the GGUF into a Hugging Face directory, both sides
    read that directory (measured: max |d logit| 0.0 over 2 x 32 tokens, max |logit| ~34; ~70 s)."""
    res = run_bridge("hf", "--src", str(smollm2_gguf), "--work", str(tmp_path / "w"), "--seq", "32", timeout=1800)
    assert res["exported_tensors"] == 272
    _converts_exactly(res)


def _checkpoint(tmp_path: Path, kind: str) -> Path:
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    spec = _spec(kind)
    model = build_model(spec)
    hf_to_megatron(spec, random_hf_state_dict(spec, seed=5), model)
    out = tmp_path / f"ckpt_{kind}"
    save_checkpoint(model, spec, out)
    return out


@needs_bridge
def test_project_student_checkpoint_loads_through_bridge_loader(megatron_tp1, tmp_path):
    """The project's torch_dist student checkpoint, with ``run_config.yaml`` written by
    ``models.bridge.write_run_config`` (the provider Megatron-Bridge builds for the student, serialized by
    Megatron-Bridge), through ``load_model_config`` + ``build_and_load_model``."""
    res = run_bridge("load-project-ckpt", "--ckpt", str(_checkpoint(tmp_path, "kv")))
    # as written (Megatron-LM ``args`` only), Megatron-Bridge's MLM-compat reader wants Megatron-LM's full args
    args_only = res["args_only"]["stopped_at"]
    assert args_only["error"] == "AttributeError: 'Namespace' object has no attribute 'multi_latent_attention'"
    assert args_only["file"] == "megatron/bridge/training/mlm_compat/arguments.py"
    assert res["done"], res
    assert res["provider"] == "LlamaNemotronHeterogeneousProvider"
    assert res["max_abs_dlogit_vs_project"] <= TOL


@needs_bridge
def test_uniform_student_checkpoint_layout_is_not_bridges(megatron_tp1, tmp_path):
    """A uniform student is built on the project's per-layer config, so its layers are saved one by one
    (``decoder.layers.0.…``); Megatron-Bridge's ``GPTModelProvider`` builds a model whose layers are
    stacked (``decoder.layers.…`` with a layer axis) and finds no such keys."""
    res = run_bridge("load-project-ckpt", "--ckpt", str(_checkpoint(tmp_path, "uniform")))
    assert res["provider"] == "GPTModelProvider"
    assert not res["done"] and res["stopped_in"] == "build_and_load_model", res
    assert (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight from model not in state dict"
        in (res["stopped_at"]["error"])
    )


@needs_bridge
def test_training_loops_stop_at_import():
    res = run_bridge("train-probe")
    for mod in ("megatron.bridge.training.finetune", "megatron.bridge.training.distill"):
        stop = res[mod]
        assert stop["error"].startswith("ModuleNotFoundError: No module named 'nvidia_resiliency_ext"), stop
        assert stop["code"] == "from nvidia_resiliency_ext.inprocess import CallWrapper"
        assert "megatron/bridge/training/pretrain.py:19 <module>" in stop["frames"], stop


def test_no_bridge_venv_is_said(monkeypatch, tmp_path):
    from autocompress_nemo.models import bridge

    monkeypatch.setenv("ACN_BRIDGE_PYTHON", str(tmp_path / "missing" / "python"))
    assert bridge.bridge_python() is None
    with pytest.raises(bridge.BridgeError, match="make_bridge_venv.sh"):
        bridge.run_bridge("probe")


def test_bridge_module_imports_nothing_from_bridge_here():
    """The project's side of ``models/bridge.py`` needs no Megatron-Bridge (it is not in this venv)."""
    code = (
        "import sys, autocompress_nemo.models.bridge as b; b.bridge_python(); print('megatron.bridge' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert r.stdout.strip() == "False", r.stderr[-2000:]

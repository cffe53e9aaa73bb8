"""Recovery distillation as a Megatron-Bridge recipe (``models/bridge_recipe.py``), rendered on CPU.

The recipe is built in the bridge venv (megatron-bridge 0.6.2; ``.venv-bridge``) from the run's composed
config: the student checkpoint the project wrote (made a Megatron-Bridge checkpoint by
``models.bridge.write_run_config``) as the model provider, the parent's Hugging Face directory as the
teacher, ``convert_to_distillation_provider`` with logit KL at ``distill.temperature``, Megatron-Bridge's
pre-training template with the run's token budget, batch, sequence length and learning rates. It is
rendered to YAML and checked here; running it (``--run``: ``distill(cfg)``) needs a GPU and is part of
``bench/gpu_check.sh`` (untested: no GPU was lent to the session that wrote it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.config.entry import compose
from autocompress_nemo.models.bridge import BRIDGE_VENV, ROOT, bridge_python, run_bridge
from autocompress_nemo.models.bridge_recipe import recipe_inputs

pytestmark = pytest.mark.skipif(
    bridge_python() is None,
    reason=f"no Megatron-Bridge venv at {BRIDGE_VENV}: scripts/make_bridge_venv.sh builds it (or set ACN_BRIDGE_PYTHON)",
)
A, M = AttentionBlock, MlpBlock


def test_recovery_recipe_renders_from_the_run_config(megatron_tp1, tmp_path):
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron
    from autocompress_nemo.models.llama.hf_io import export_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    parent = ArchSpec.llama(hidden=64, vocab=128, layers=4, heads=4, kv_groups=2, ffn=96, head_dim=16, name="p")
    parent_hf = export_hf(parent, random_hf_state_dict(parent, seed=1), tmp_path / "parent_hf", engine="")
    blocks = (A(4, 2, 16), M(96), A(4, 1, 16), M(64), A(0, 0, 16), M(96), A(4, 2, 16), M(32))
    student = ArchSpec(hidden=64, vocab=128, blocks=blocks, name="s", norm_eps=1e-5)
    model = build_model(student)
    hf_to_megatron(student, random_hf_state_dict(student, seed=2), model)
    ckpt = tmp_path / "student_ckpt"
    save_checkpoint(model, student, ckpt)
    assert run_bridge("run-config", "--ckpt", str(ckpt))["run_config"].endswith("release/run_config.yaml")

    cfg = compose(["model=tiny_llama", "+target=tiny_cpu", "distill=quick", f"run_dir={tmp_path / 'run'}"])
    inp = recipe_inputs(cfg, ckpt, parent_hf, tmp_path / "bridge_distill")
    (tmp_path / "inputs.json").write_text(json.dumps(inp))
    out = tmp_path / "recipe.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [
            str(bridge_python()),
            "-m",
            "autocompress_nemo.models.bridge_recipe",
            "--config",
            str(tmp_path / "inputs.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    s = json.loads(Path(str(out) + ".summary.json").read_text())
    assert s["model"] == "DistillationProvider"
    assert s["student"] == "LlamaNemotronHeterogeneousProvider"  # the DeciLM student
    assert s["teacher"] == "GPTModelProvider"  # LlamaBridge's provider for the Llama parent
    assert s["kd"]["logit_layers"] == ["output_layer", "output_layer"]
    assert s["kd"]["logit_kl_temperature"] == float(cfg.distill.temperature)
    d = cfg.distill
    assert s["train_iters"] == int(d.tokens) // (int(d.batch_size) * int(d.seq_len))
    assert (s["global_batch_size"], s["seq_length"]) == (int(d.batch_size), int(d.seq_len))
    assert (s["lr"], s["min_lr"]) == (float(d.lr), float(d.min_lr))
    assert s["mixed_precision"] == "bf16_mixed" and s["pretrained_checkpoint"] == str(ckpt)
    assert s["tp"] == s["teacher_tp"] == int(cfg.cluster.tp)
    rendered = yaml.safe_load(out.read_text())
    assert rendered["model"]["_target_"].endswith("LlamaNemotronHeterogeneousProvider")
    assert rendered["train"]["train_iters"] == s["train_iters"]
    assert rendered["checkpoint"]["pretrained_checkpoint"] == str(ckpt)
    assert rendered["checkpoint"]["ckpt_format"] == "torch_dist"

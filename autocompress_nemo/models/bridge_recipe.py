"""Recovery distillation as a Megatron-Bridge recipe (GPU; rendered and checked on CPU).

The run's distillation, handed to NVIDIA's maintained loop (``megatron.bridge.training.distill.distill``:
its distributed optimizer, mixed precision, fault tolerance and checkpointing) instead of the project's:

- the student is the model provider Megatron-Bridge builds for it (``AutoBridge.from_hf_config`` on the
  student's Hugging Face config: ``LlamaNemotronBridge`` for a DeciLM student, ``NemotronHBridge`` for a
  hybrid), its weights from the project's student checkpoint (``checkpoint.pretrained_checkpoint``, made a
  Megatron-Bridge checkpoint by ``models.bridge.write_run_config``);
- the parent is the teacher (``AutoBridge.from_hf_pretrained(parent).to_megatron_provider(load_weights=True)``);
- ``convert_to_distillation_provider(student, teacher, ModelOptDistillConfig(...))`` makes the student a
  KD model (logit KL, ``distill.temperature``; intermediate losses when ``distill.intermediate_weight``);
- the rest starts from Megatron-Bridge's own pre-training template (``recipes.common._pretrain_common``:
  distributed Adam with cosine annealing, bf16 mixed precision, torch_dist checkpoints) with the run's
  token budget, batch, sequence length, learning rates and parallel layout.

Runs in the bridge venv (``.venv-bridge`` on CPU, the NeMo Framework container on GPU)::

    python -m autocompress_nemo.models.bridge_recipe --config run_config.json --out recipe.yaml [--run]

``--config`` is a JSON of the keys ``recipe_config`` reads (``recipe_inputs`` writes it from the run's
composed config in the project's interpreter). Without ``--run`` it only renders the ``ConfigContainer``
to YAML; ``--run`` calls ``distill(cfg)`` (GPU: Transformer Engine, NCCL; ``bench/gpu_check.sh``).

Measured on CPU (megatron-bridge 0.6.2): the recipe renders (``tests/test_megatron_bridge_recipe.py``);
``distill`` itself cannot be imported here (``training/pretrain.py`` imports ``nvidia_resiliency_ext``).
Not yet run on a GPU: no GPU was lent to the session that wrote it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def recipe_inputs(cfg: Any, student_ckpt: str | Path, parent_hf: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """What the recipe reads from the run's composed config (project interpreter; plain JSON types)."""
    d, cl = cfg.distill, cfg.cluster
    return {
        "student_ckpt": str(student_ckpt),
        "parent_hf": str(parent_hf),
        "out_dir": str(out_dir),
        "tokens": int(d.tokens),
        "seq_len": int(d.seq_len),
        "global_batch": int(d.batch_size),
        "micro_batch": int(cl.get("micro_batch_size", 1) or 1),
        "lr": float(d.lr),
        "min_lr": float(d.min_lr),
        "warmup_steps": int(d.warmup_steps),
        "temperature": float(d.temperature),
        "intermediate_weight": float(d.intermediate_weight),
        "checkpoint_every": int(d.checkpoint_every),
        "tp": int(cl.tp),
        "pp": int(cl.pp),
        "ep": int(cl.ep),
        "cp": int(cl.get("cp", 1) or 1),
        "sequence_parallel": bool(cl.sequence_parallel),
        "distributed_optimizer": bool(cl.get("distributed_optimizer", True)),
        "seed": int(cfg.seed),
        "data_paths": [str(p) for p in (cfg.data.get("paths") or [])] if cfg.get("data") else [],
    }


def _student_provider(ckpt: str) -> Any:
    """The provider Megatron-Bridge keeps in the student checkpoint's ``run_config.yaml``."""
    from megatron.bridge.training.model_load_save import load_model_config

    from autocompress_nemo.models.dist_checkpoint import checkpoint_path

    provider, _ = load_model_config(str(checkpoint_path(ckpt)))
    return provider


def recipe_config(inp: dict[str, Any], load_teacher_weights: bool = True) -> Any:
    """The ``ConfigContainer`` of recovery distillation for ``inp`` (``recipe_inputs``)."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.distillation_provider import convert_to_distillation_provider
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.post_training.distillation import ModelOptDistillConfig

    from autocompress_nemo.models.bridge import finalize_as_written

    student = _student_provider(inp["student_ckpt"])
    parent = AutoBridge.from_hf_pretrained(inp["parent_hf"], trust_remote_code=True)
    teacher = parent.to_megatron_provider(load_weights=load_teacher_weights)
    for p in (student, teacher):
        p.tensor_model_parallel_size = inp["tp"]
        p.pipeline_model_parallel_size = inp["pp"]
        p.expert_model_parallel_size = inp["ep"]
        p.context_parallel_size = inp["cp"]
        p.sequence_parallel = inp["sequence_parallel"]
        p.seq_length = inp["seq_len"]
    kd = ModelOptDistillConfig(
        logit_layers=("output_layer", "output_layer"),
        intermediate_layer_pairs=(
            [["decoder.final_layernorm", "decoder.final_layernorm"]] if inp["intermediate_weight"] > 0 else []
        ),
        skip_lm_loss=True,
        kd_loss_scale=1.0,
        logit_kl_temperature=inp["temperature"],
    )
    model = convert_to_distillation_provider(student, teacher, kd)
    finalize_as_written(model)  # as ConfigContainer.validate() does before training writes its run_config

    cfg = _pretrain_common()
    cfg.model = model
    steps = max(1, inp["tokens"] // (inp["global_batch"] * inp["seq_len"]))
    cfg.train.train_iters = steps
    cfg.train.global_batch_size = inp["global_batch"]
    cfg.train.micro_batch_size = inp["micro_batch"]
    cfg.validation.eval_interval = max(1, steps // 4)
    cfg.optimizer.lr = inp["lr"]
    cfg.optimizer.min_lr = inp["min_lr"]
    cfg.optimizer.use_distributed_optimizer = inp["distributed_optimizer"]
    cfg.ddp.use_distributed_optimizer = inp["distributed_optimizer"]
    cfg.scheduler.lr_warmup_iters = min(inp["warmup_steps"], steps)
    cfg.scheduler.lr_decay_iters = steps
    cfg.dataset.seq_length = inp["seq_len"]
    cfg.dataset.random_seed = inp["seed"]
    if inp["data_paths"]:  # Megatron indexed datasets (prefixes); empty: Megatron-Bridge's mock data
        cfg.dataset.blend = (inp["data_paths"], None)
    cfg.tokenizer.tokenizer_model = inp["parent_hf"]
    out = Path(inp["out_dir"])
    cfg.checkpoint.pretrained_checkpoint = inp["student_ckpt"]
    cfg.checkpoint.save = str(out / "checkpoints")
    cfg.checkpoint.load = str(out / "checkpoints")
    cfg.checkpoint.save_interval = inp["checkpoint_every"]
    cfg.logger.tensorboard_dir = str(out / "tb_logs")
    cfg.rng.seed = inp["seed"]
    cfg.mixed_precision = "bf16_mixed"
    return cfg


def summarize(cfg: Any) -> dict[str, Any]:
    """What a reviewer checks in the recipe (the YAML holds the student provider's fields only: Megatron-
    Bridge serializes a DistillationProvider as its student class)."""
    m = cfg.model
    kd = m.kd_config
    return {
        "model": type(m).__name__,
        "student": type(m).__bases__[0].__name__,
        "teacher": type(m.teacher).__name__,
        "kd": {
            "logit_layers": list(kd.logit_layers),
            "intermediate_layer_pairs": [list(p) for p in kd.intermediate_layer_pairs],
            "logit_kl_temperature": kd.logit_kl_temperature,
            "skip_lm_loss": kd.skip_lm_loss,
        },
        "train_iters": cfg.train.train_iters,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seq_length": cfg.dataset.seq_length,
        "lr": cfg.optimizer.lr,
        "min_lr": cfg.optimizer.min_lr,
        "use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
        "mixed_precision": cfg.mixed_precision,
        "pretrained_checkpoint": cfg.checkpoint.pretrained_checkpoint,
        "save": cfg.checkpoint.save,
        "tp": m.tensor_model_parallel_size,
        "teacher_tp": m.teacher.tensor_model_parallel_size,
    }


def render(cfg: Any) -> str:
    """The ``ConfigContainer`` as YAML (Megatron-Bridge's own serializer)."""
    import yaml
    from megatron.training.config.yaml_utils import safe_yaml_representers

    with safe_yaml_representers():
        return yaml.safe_dump(cfg.to_dict(), default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m autocompress_nemo.models.bridge_recipe", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", required=True, help="JSON of recipe_inputs(...)")
    p.add_argument("--out", required=True, help="where the rendered recipe (YAML) goes")
    p.add_argument("--run", action="store_true", help="run Megatron-Bridge's distill loop (GPU)")
    a = p.parse_args(argv)
    from autocompress_nemo.models.bridge import import_bridge

    info = import_bridge()  # on CPU: the Transformer Engine stand-in (models/bridge.py); on GPU: as shipped
    inp = json.loads(Path(a.config).read_text())
    cfg = recipe_config(inp, load_teacher_weights=a.run)
    Path(a.out).write_text(render(cfg))
    summary = summarize(cfg)
    summary["te_standin"] = bool(info.get("te_standin"))
    summary["versions"] = info["versions"]
    Path(a.out + ".summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, default=str))
    if a.run:
        from megatron.bridge.training.distill import distill

        distill(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

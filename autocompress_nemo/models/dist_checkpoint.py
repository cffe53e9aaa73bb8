"""Megatron distributed checkpoints (``dist_checkpointing``, ``torch_dist`` format) of a student, out and in.

Layout (Megatron-LM's, so ``--load <dir>`` finds it)::

    <dir>/latest_checkpointed_iteration.txt   "release" (iteration 0) or the iteration number
    <dir>/release/ or <dir>/iter_0000050/     the torch_dist checkpoint: metadata.json, *.distcp
    <dir>/heterogeneous_layers_config.json    dense students: the per-layer block_configs
    <dir>/megatron_args.json                  the Megatron-LM / Megatron-Bridge arguments of the model
    <dir>/spec.json                           this project's ArchSpec (reads the model back exactly)

The checkpoint holds ``{"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": n,
"args": Namespace}`` like Megatron-LM's own (``checkpoint_args``; no optimizer, no RNG state: continue
with ``--finetune --no-load-optim --no-load-rng``). Its tensor keys are those of the Transformer Engine layer specs whichever spec
built the model (the local specs rename their separate norms, ``models.builder.te_keys_map``), and
tensors are stored whole with their TP sharding described, so a checkpoint written at one TP size
loads at another.

Iteration 0 is written as ``release``: Megatron-LM's ``read_metadata`` refuses iteration 0 unless
the tracker says ``release`` (the name its converters use for a model that was not trained here).

Every function is collective: every rank of the model-parallel world calls it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models import compat_cpu
from autocompress_nemo.utils.interrupts import ctrl_c_deferred

TRACKER = "latest_checkpointed_iteration.txt"
ARGS = "megatron_args.json"
SPEC = "spec.json"
CHECKPOINT_VERSION = 3.0


def iteration_dir(iteration: int) -> str:
    """``release`` for iteration 0, else ``iter_0000050`` (Megatron-LM's ``get_checkpoint_name``)."""
    return "release" if iteration == 0 else f"iter_{iteration:07d}"


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def rank0_dir(path: str | Path) -> Path:
    """Rank 0's ``path`` on every rank. The pipeline hands the other ranks a scratch directory
    (only rank 0 writes artifacts) but a distributed checkpoint is written by every rank, each its
    own shards, into one directory: rank 0's (a filesystem every rank sees, as for ``run_dir``)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return Path(path)
    obj = [str(path)]
    torch.distributed.broadcast_object_list(obj, src=0)
    return Path(obj[0])


def unwrap(model: Any) -> Any:
    """The model inside DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def save_checkpoint(model: Any, spec: ArchSpec, out_dir: str | Path, iteration: int = 0) -> Path:
    """Write ``model`` (a Megatron ``GPTModel`` / ``HybridModel`` built here) as a Megatron-LM
    distributed checkpoint under rank 0's ``out_dir`` (``rank0_dir``); returns the iteration directory."""
    compat_cpu.apply()
    from megatron.core import dist_checkpointing

    out = rank0_dir(out_dir)
    ckpt = out / iteration_dir(iteration)
    if _rank0():
        ckpt.mkdir(parents=True, exist_ok=True)
    _barrier()
    m = unwrap(model)
    state = {
        "model": m.sharded_state_dict(),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "args": checkpoint_args(spec, m),
    }
    with ctrl_c_deferred():  # a Ctrl-C lands after the checkpoint is whole
        dist_checkpointing.save(state, str(ckpt))
    if _rank0():
        (out / SPEC).write_text(spec.to_json())
        args = megatron_args(spec, m)
        hetero = args.pop("heterogeneous_layers_config", None)
        if hetero is not None:  # the file --heterogeneous-layers-config-path names
            (out / args["heterogeneous_layers_config_path"]).write_text(json.dumps(hetero, indent=2) + "\n")
        (out / ARGS).write_text(json.dumps(args, indent=2, sort_keys=True) + "\n")
        (out / TRACKER).write_text("release" if iteration == 0 else str(iteration))  # last: the checkpoint is whole
    _barrier()
    return ckpt


NOT_ARGUMENTS = ("model", "expressible", "not_expressible_because", "heterogeneous_layers_config")


def checkpoint_args(spec: ArchSpec, model: Any) -> argparse.Namespace:
    """The ``args`` entry of the checkpoint's common state: Megatron-LM's ``load_checkpoint`` reads
    ``state_dict['args'].tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` (and
    ``no_save_rng`` / ``no_save_optim``) from every torch_dist checkpoint before loading it, and
    ``--use-checkpoint-args`` takes the model's arguments from it."""
    from megatron.core import parallel_state as ps

    fields = {k: v for k, v in megatron_args(spec, model).items() if k not in NOT_ARGUMENTS}
    fields.update(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size()
        if ps.model_parallel_is_initialized()
        else 1,
        pipeline_model_parallel_size=1,
        no_save_rng=True,
        no_save_optim=True,
    )
    return argparse.Namespace(**fields)


def checkpoint_path(ckpt_dir: str | Path) -> Path:
    """The iteration directory the tracker file of ``ckpt_dir`` names."""
    root = Path(ckpt_dir)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"{root}: no {TRACKER}, not a Megatron-LM checkpoint directory")
    text = tracker.read_text().strip()
    return root / iteration_dir(0 if text == "release" else int(text))


def read_spec(ckpt_dir: str | Path) -> ArchSpec:
    return ArchSpec.from_json((Path(ckpt_dir) / SPEC).read_text())


def load_checkpoint(model: Any, ckpt_dir: str | Path) -> int:
    """Load the weights of the checkpoint in ``ckpt_dir`` into ``model`` (built at any TP size for
    the same ``ArchSpec``); returns the checkpoint's iteration. Strict: a missing or unexpected
    tensor is an error."""
    compat_cpu.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    m = unwrap(model)
    path = checkpoint_path(rank0_dir(ckpt_dir))
    state = dist_checkpointing.load(
        {"model": m.sharded_state_dict(), "iteration": 0}, str(path), strict=StrictHandling.RAISE_ALL
    )
    m.load_state_dict(state["model"], strict=False)  # _extra_state entries: TE modules only
    return int(state.get("iteration", 0))


def sharded_keys(model: Any) -> list[str]:
    """The tensor keys a checkpoint of ``model`` holds (``ShardedTensor.key``), sorted."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return sorted({v.key for v in nested_values(unwrap(model).sharded_state_dict()) if isinstance(v, ShardedBase)})


def megatron_args(spec: ArchSpec, model: Any) -> dict[str, Any]:
    """The Megatron-LM command-line arguments (as ``{flag name: value}``) that rebuild ``model``.

    Dense Llama-style students: ``GPTModel`` with a heterogeneous layer config
    (``--heterogeneous-layers-config-path``, DeciLM ``block_configs``: per-layer KV groups, ffn
    width, removed attention / mlp). Per-layer *query* heads are this project's extension
    (``num_attention_heads`` in each block config), which Megatron's parser ignores: a student
    whose layers keep different query-head counts is not expressible in Megatron-LM itself
    (``expressible: false`` and the reason). Hybrids: ``--hybrid-layer-pattern`` with the first
    kept block's shapes; per-block Mamba heads / experts / widths are not expressible in
    Megatron-LM's ``HybridModel`` (one config for every block of a kind): said the same way.
    """
    cfg = model.config
    args: dict[str, Any] = {
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "group_query_attention": cfg.num_query_groups != cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "kv_channels": cfg.kv_channels,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "normalization": cfg.normalization,
        "norm_epsilon": cfg.layernorm_epsilon,
        "disable_bias_linear": not cfg.add_bias_linear,
        "add_qkv_bias": bool(getattr(cfg, "add_qkv_bias", False)),
        "qk_layernorm": bool(cfg.qk_layernorm),
        "swiglu": bool(cfg.gated_linear_unit),
        "position_embedding_type": getattr(model, "position_embedding_type", "rope"),
        "rotary_base": spec.rope_theta,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "vocab_size": spec.vocab,
        "make_vocab_size_divisible_by": 1,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bf16": False,
        "fp16": False,
        "use_dist_ckpt": True,
        "ckpt_format": "torch_dist",
        "finetune": True,
        "no_load_optim": True,
        "no_load_rng": True,
    }
    notes: list[str] = []
    if spec.is_dense_layered():
        args["model"] = "GPTModel"
        enc = getattr(cfg, "heterogeneous_layers_config_encoded_json", "")
        if enc:
            args["heterogeneous_layers_config_path"] = "heterogeneous_layers_config.json"
            args["heterogeneous_layers_config"] = json.loads(enc)
        heads = {a.num_heads for a, _ in spec.layers() if not a.removed}
        if len(heads) > 1:
            notes.append(
                f"per-layer query heads {sorted(heads)}: Megatron-LM's heterogeneous config varies KV groups, ffn "
                "width and no-op blocks per layer but not query heads (the num_attention_heads field of each "
                "block config is this project's extension, read by autocompress_nemo.models.builder)"
            )
    else:
        args["model"] = "HybridModel"
        args["hybrid_layer_pattern"] = getattr(model, "hybrid_layer_pattern", None) or "".join(
            getattr(model.decoder, "layer_type_list", [])
        )
        per_kind: dict[str, set] = {}
        first: dict[str, Any] = {}
        for b in spec.blocks:
            if not b.removed:
                per_kind.setdefault(type(b).__name__, set()).add(b)
                first.setdefault(b.kind, b)
        args.update(_hybrid_block_args(first))
        varied = sorted(k for k, v in per_kind.items() if len(v) > 1)
        if varied:
            notes.append(
                f"per-block shapes of {', '.join(varied)}: Megatron-LM's HybridModel builds every block of a kind "
                "from one config; this student needs autocompress_nemo's PerBlockHybridStack"
            )
        if any(b.removed for b in spec.blocks):
            notes.append("removed blocks (no-op layers) have no symbol in Megatron-LM's hybrid_layer_pattern")
    args["expressible"] = not notes
    args["not_expressible_because"] = notes
    return args


def _hybrid_block_args(first: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's hybrid arguments from the first kept block of each kind (the only shapes its
    one-config ``HybridModel`` can take)."""
    out: dict[str, Any] = {}
    if "mamba" in first:
        m = first["mamba"]
        out.update(
            mamba_num_heads=m.num_heads,
            mamba_head_dim=m.head_dim,
            mamba_state_dim=m.state_size,
            mamba_num_groups=m.num_groups,
        )
    if "moe" in first:
        e = first["moe"]
        out.update(
            num_experts=e.num_experts,
            moe_ffn_hidden_size=e.expert_ffn,
            moe_router_topk=e.top_k,
            moe_shared_expert_intermediate_size=e.shared_ffn or None,
        )
    act = next((first[k].activation for k in ("mlp", "moe") if k in first), None)
    if act is not None:
        out.update(swiglu=act == "swiglu", squared_relu=act == "relu2")
    if "mlp" in first:
        out["ffn_hidden_size"] = first["mlp"].ffn
    return out


def _main(argv: list[str] | None = None) -> None:
    """``python -m autocompress_nemo.models.dist_checkpoint save WEIGHTS_DIR OUT_DIR`` writes a
    weights directory (``spec.json`` + ``model.safetensors``: an extract / distill artifact, also of
    runs made before these checkpoints existed) as a Megatron-LM distributed checkpoint;
    ``... load CKPT_DIR`` builds the model from the checkpoint's ``spec.json``, loads it and prints
    its iteration, parameter count and the logits of a fixed token sequence. Both run under
    ``torchrun --nproc_per_node N`` at TP=N."""
    import os

    from autocompress_nemo.context import load_weights
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron

    ap = argparse.ArgumentParser(prog="python -m autocompress_nemo.models.dist_checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="weights directory -> Megatron-LM distributed checkpoint")
    s.add_argument("weights_dir")
    s.add_argument("out_dir")
    s.add_argument("--iteration", type=int, default=0)
    ld = sub.add_parser("load", help="load a checkpoint at TP=WORLD_SIZE and run it once")
    ld.add_argument("ckpt_dir")
    a = ap.parse_args(argv)
    init_distributed(tp=int(os.environ.get("WORLD_SIZE", "1")), seed=0)
    if a.cmd == "save":
        spec, sd = load_weights(Path(a.weights_dir))
        model = build_model(spec)
        hf_to_megatron(spec, sd, model)
        path = save_checkpoint(model, spec, a.out_dir, iteration=a.iteration)
        if _rank0():
            print(f"{spec.name}: Megatron-LM checkpoint (torch_dist) -> {path}")
        return
    spec = read_spec(a.ckpt_dir)
    model = build_model(spec).eval()
    it = load_checkpoint(model, a.ckpt_dir)
    x = torch.arange(16).remainder(spec.vocab).unsqueeze(0)
    with torch.no_grad():
        logits = forward_logits(model, x)
    n = sum(p.numel() for p in model.parameters())
    if _rank0():
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        print(
            f"{spec.name}: iteration {it}, TP={world}, {n:,} parameters on rank 0, "
            f"logits[0, -1, :4] = {[round(v, 4) for v in logits[0, -1, :4].tolist()]}"
        )


if __name__ == "__main__":
    _main()

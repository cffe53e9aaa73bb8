"""Megatron-LM distributed checkpoints (``models.dist_checkpoint``, torch_dist) out and in, on CPU.

- a checkpoint written at TP=1 loads at TP=2 (two gloo ranks): the same weights exactly, the same
  logits (within float32 reduction order, as in tests/test_tp_parity.py); written again at TP=2 (and
  at EP=2) it lands whole in rank 0's directory and loads at TP=1 / EP=1 with the same weights;
- a hybrid student with removed blocks (``NoOpBlock``) saves and loads exactly;
- the saved tensor keys are the Transformer Engine spec's, although the model is built from local
  specs (Transformer Engine cannot be installed here: the expectations are stated per test);
- distill started from such a checkpoint follows the run started from the in-memory student.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec
from hybrid_utils import hetero_hybrid_spec, ids, requires_mamba

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock
from autocompress_nemo.distributed.spawn import spawn

TOL = 1e-5  # TP=2 vs TP=1 logits: float32 sums reduced in another order (~1e-7 measured)


def _model(spec: ArchSpec, seed: int):  # noqa: ANN202
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, random_hf_state_dict

    model = build_model(spec, init_seed=0, impl="local")
    hf = random_hf_state_dict(spec, seed=seed)
    hf_to_megatron(spec, hf, model)
    return model.eval(), hf


def _load_and_run(rank: int, world: int, spec_json: str, ckpt: str, x: torch.Tensor, dirs: list[str]) -> tuple:
    """On each rank: build at TP=world with other weights, load the checkpoint, forward; then save
    the model again, each rank handed its own directory (as the pipeline's non-zero ranks get a
    scratch one): the checkpoint must land whole in rank 0's."""
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.dist_checkpoint import load_checkpoint, save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=world, seed=0)
    model = build_model(spec, init_seed=123, impl="local").eval()
    load_checkpoint(model, ckpt)
    with torch.no_grad():
        logits = forward_logits(model, x)
    save_checkpoint(model, spec, dirs[rank], iteration=7)
    return logits, megatron_to_hf(spec, model)


def _tp2_hybrid_spec() -> ArchSpec:
    """Mamba, attention and MLP blocks that shard at TP=2, with a removed attention and Mamba block."""
    A, M, F = AttentionBlock, MambaBlock, MlpBlock
    blocks = (M(4, 16, 16, 2), A(4, 2, 16), F(96, "relu2"), A(0, 0, 16), M(0, 16, 16, 2), A(2, 2, 16), F(64, "relu2"))
    return ArchSpec(hidden=64, vocab=256, blocks=blocks, family="nemotron_h", name="tp2_hybrid")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "make", [tiny_hetero_spec, pytest.param(_tp2_hybrid_spec, marks=requires_mamba)], ids=["dense", "hybrid"]
)
def test_checkpoints_move_between_tp1_and_tp2(megatron_tp1, tmp_path: Path, make) -> None:  # noqa: ANN001
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.dist_checkpoint import TRACKER, load_checkpoint, save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

    spec = make()
    model, hf = _model(spec, seed=4)
    x = ids(spec, T=8)
    with torch.no_grad():
        ref = forward_logits(model, x)
    ckpt = save_checkpoint(model, spec, tmp_path / "ckpt")
    assert ckpt.name == "release" and (tmp_path / "ckpt" / TRACKER).read_text() == "release"
    assert (ckpt / "metadata.json").is_file()
    dirs = [str(tmp_path / "tp2"), str(tmp_path / "rank1_scratch")]
    per_rank = spawn(_load_and_run, 2, spec.to_json(), str(tmp_path / "ckpt"), x, dirs)
    worst = 0.0
    for logits, hf_back in per_rank:
        assert set(hf_back) == set(hf)
        for k in hf:
            assert torch.equal(hf_back[k], hf[k]), f"{k}: weights changed through the TP=1 -> TP=2 checkpoint"
        worst = max(worst, (logits - ref).abs().max().item())
    print(f"{spec.name}: TP=1 checkpoint loaded at TP=2: max |dlogits| = {worst:.2e}")
    assert worst < TOL
    # ... and written at TP=2 (into rank 0's directory only), loaded at TP=1: the same weights
    assert not (tmp_path / "rank1_scratch").exists()
    back = build_model(spec, init_seed=3, impl="local")
    assert load_checkpoint(back, dirs[0]) == 7
    back_hf = megatron_to_hf(spec, back)
    assert set(back_hf) == set(hf) and all(torch.equal(back_hf[k], hf[k]) for k in hf)


@requires_mamba
def test_hybrid_with_removed_blocks_round_trips(megatron_tp1, tmp_path: Path) -> None:
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.dist_checkpoint import load_checkpoint, megatron_args, read_spec, save_checkpoint
    from autocompress_nemo.models.hybrid.stack import NoOpBlock

    spec = hetero_hybrid_spec()  # a removed attention, Mamba and MLP block; per-block shapes
    model, _ = _model(spec, seed=2)
    assert sum(isinstance(layer, NoOpBlock) for layer in model.decoder.layers) == 3
    x = ids(spec)
    with torch.no_grad():
        ref = forward_logits(model, x)
    save_checkpoint(model, spec, tmp_path / "ckpt", iteration=50)
    assert (tmp_path / "ckpt" / "iter_0000050" / "metadata.json").is_file()
    assert read_spec(tmp_path / "ckpt") == spec
    other = build_model(spec, init_seed=9, impl="local").eval()
    assert load_checkpoint(other, tmp_path / "ckpt") == 50
    for (k, a), (k2, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert k == k2
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(forward_logits(other, x), ref)
    # the common state Megatron-LM's load_checkpoint reads before anything else
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "ckpt" / "iter_0000050"))
    assert common["iteration"] == 50 and common["checkpoint_version"] == 3.0
    ck = common["args"]
    assert (ck.tensor_model_parallel_size, ck.pipeline_model_parallel_size, ck.num_layers) == (1, 1, 12)
    assert ck.no_save_rng and ck.no_save_optim and ck.hybrid_layer_pattern == "M*EME-*EM-*E"
    args = json.loads((tmp_path / "ckpt" / "megatron_args.json").read_text())
    assert args == json.loads(json.dumps(megatron_args(spec, model)))
    assert args["model"] == "HybridModel" and args["hybrid_layer_pattern"] == "M*EME-*EM-*E"
    assert args["expressible"] is False and len(args["not_expressible_because"]) == 2


def test_dense_keys_are_megatrons_local_to_te_mapping(megatron_tp1) -> None:
    """Dense: the keys of the project's local-spec model equal those of the same model built from
    Megatron's own heterogeneous local spec (``get_gpt_heterogeneous_layer_spec(use_te=False)``),
    whose ``_get_sharded_state_dict_keys_map`` is Megatron's statement of the TE spec's names
    (norms fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``). The TE spec
    itself cannot be built here (``get_gpt_layer_with_transformer_engine_spec`` needs TE)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

    from autocompress_nemo.models.builder import build_model, transformer_config
    from autocompress_nemo.models.dist_checkpoint import sharded_keys

    spec = tiny_hetero_spec()  # a removed attention (layer 2) and a removed mlp (layer 1)
    ours = sharded_keys(build_model(spec, impl="local"))
    config = transformer_config(spec)
    theirs_model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_heterogeneous_layer_spec(config, use_te=False),
        vocab_size=spec.vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=spec.tied_embeddings,
    )
    assert ours == sharded_keys(theirs_model)
    assert not [k for k in ours if "input_layernorm" in k or "pre_mlp_layernorm" in k]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in ours
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in ours
    assert not [k for k in ours if k.startswith("decoder.layers.2.self_attention")]  # removed attention
    assert not [k for k in ours if k.startswith("decoder.layers.1.mlp")]  # removed mlp


# Transformer Engine hybrid spec (megatron-core 0.19.2, megatron/core/models/hybrid/hybrid_layer_specs.py,
# ``hybrid_stack_spec``): Mamba ``in_proj`` / attention ``linear_qkv`` / MLP ``linear_fc1`` are
# ``TELayerNormColumnParallelLinear`` (the layer's norm fused in: ``layer_norm_weight``; no separate
# ``norm`` / ``input_layernorm`` / ``pre_mlp_layernorm``); the MoE layer keeps ``pre_mlp_layernorm``
# (``TENorm``); experts are stored in the expert-stacked form ``mlp.experts.experts.linear_fc*``
# that ``SequentialMLP`` and ``TEGroupedMLP`` share (transformer/moe/experts.py). Tensor keys only:
# ``_extra_state`` objects depend on the TE version.
TE_HYBRID_TENSOR_KEYS = {
    "M": [
        "mixer.A_log",
        "mixer.D",
        "mixer.conv1d.bias",
        "mixer.conv1d.weight",
        "mixer.dt_bias",
        "mixer.in_proj.layer_norm_weight",
        "mixer.in_proj.weight",
        "mixer.norm.weight",
        "mixer.out_proj.weight",
    ],
    "*": [
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
    ],
    "-": ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"],
    "E": [
        "mlp.experts.experts.linear_fc1.weight",
        "mlp.experts.experts.linear_fc2.weight",
        "mlp.router.expert_bias",
        "mlp.router.weight",
        "pre_mlp_layernorm.weight",
    ],
    "E+shared": ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"],
}


@requires_mamba
def test_hybrid_keys_are_the_te_specs(megatron_tp1) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject

    from autocompress_nemo.blocks.moe import has_routed_experts
    from autocompress_nemo.models.builder import build_model

    spec = hetero_hybrid_spec()
    model = build_model(spec, impl="local")
    sharded = nested_values(model.sharded_state_dict())
    got = sorted({v.key for v in sharded if isinstance(v, ShardedBase) and not isinstance(v, ShardedObject)})
    want = ["decoder.final_norm.weight", "embedding.word_embeddings.weight", "output_layer.weight"]
    for i, (b, sym) in enumerate(zip(spec.blocks, spec.pattern, strict=True)):
        if b.removed:
            continue
        if sym == "E" and not has_routed_experts(b):
            sym = "-"  # an MoE block reduced to its shared expert is a dense MLP block
        keys = TE_HYBRID_TENSOR_KEYS[sym] + (TE_HYBRID_TENSOR_KEYS["E+shared"] if sym == "E" and b.shared_ffn else [])
        want += [f"decoder.layers.{i}.{k}" for k in keys]
    assert got == sorted(want)


def test_distill_from_dist_checkpoint_follows_the_in_memory_run(megatron_tp1, tmp_path: Path) -> None:
    """The student's starting weights read from a Megatron checkpoint give the same run, step for
    step, as the student handed over in memory (same losses, same final weights)."""
    from autocompress_nemo.config.schema import DistillConfig
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint

    cfg = DistillConfig(tokens=3 * 4 * 16, batch_size=4, seq_len=16, lr=3e-3, min_lr=3e-4, warmup_steps=1)
    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    spec = tiny_hetero_spec()

    def data(step: int) -> torch.Tensor:
        return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1000 + step))

    student_a = build_model(spec, init_seed=1, impl="local")
    save_checkpoint(student_a, spec, tmp_path / "start")
    res_a = distill(student_a, teacher, forward_logits, data, cfg, tmp_path / "a", seed=7, optimizer="torch")
    student_b = build_model(spec, init_seed=2, impl="local")  # other weights until the checkpoint is read
    res_b = distill(
        student_b,
        teacher,
        forward_logits,
        data,
        cfg,
        tmp_path / "b",
        seed=7,
        optimizer="torch",
        init_from=tmp_path / "start",
    )
    assert res_b["steps"] == 3
    assert [r["loss"] for r in res_b["history"]] == [r["loss"] for r in res_a["history"]]
    for (k, a), (_, b) in zip(student_a.state_dict().items(), student_b.state_dict().items(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k


def _save_at_ep(rank: int, world: int, spec_json: str, hf: dict, dirs: list[str]) -> None:
    """Build at EP=world holding ``hf``; each rank is handed its own directory: the checkpoint
    lands whole in rank 0's."""
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=1, ep=world, seed=0)
    model = build_model(spec, init_seed=0, impl="local")
    hf_to_megatron(spec, hf, model)
    save_checkpoint(model, spec, dirs[rank], iteration=7)


@requires_mamba
@pytest.mark.distributed
def test_ep2_checkpoint_loads_at_ep1(megatron_tp1, tmp_path: Path) -> None:
    """Routed experts split over 2 expert-parallel ranks (DP=2 for the rest) are written whole."""
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import load_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf, random_hf_state_dict

    spec = hetero_hybrid_spec()
    hf = random_hf_state_dict(spec, seed=8)
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1_scratch")]
    spawn(_save_at_ep, 2, spec.to_json(), hf, dirs)
    assert not (tmp_path / "rank1_scratch").exists()
    model = build_model(spec, init_seed=3, impl="local")
    assert load_checkpoint(model, dirs[0]) == 7
    back = megatron_to_hf(spec, model)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)

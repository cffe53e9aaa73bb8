"""Blockwise local distillation (``distill/local.py``, stage ``reconstruct``): on a dense, an MoE and
a hybrid tiny parent, a narrowed student trained through the one trainer on the local objective
brings every narrowed layer's output closer to the parent's (on the parent's inputs) than the plain
slice, and its loss falls; a kill mid-run resumes to the identical weights; the stage's cache key
follows its declaration; and the pipeline runs it between extract and distill, its tokens taken out
of ``distill.tokens``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_hetero_spec

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distill.local import layer_errors, local_objective
from autocompress_nemo.distill.recover import train
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron, random_hf_state_dict
from autocompress_nemo.stages.reconstruct import train_only_changed
from tests.cfg_utils import TINY_ROOFLINE, statuses
from tests.hybrid_utils import conf_spec


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)
    yield


def _narrow(spec: ArchSpec) -> ArchSpec:
    """Every MLP / expert half as wide, attention one KV group of query heads fewer where it can."""
    out = []
    for b in spec.blocks:
        if b.kind == "mlp" and b.ffn:
            b = dataclasses.replace(b, ffn=b.ffn // 2)
        elif b.kind == "moe" and b.num_experts:
            b = dataclasses.replace(b, expert_ffn=b.expert_ffn // 2, shared_ffn=b.shared_ffn // 2)
        elif b.kind == "attention" and b.num_heads > b.num_kv_groups:
            b = dataclasses.replace(b, num_heads=b.num_heads - b.num_kv_groups)
        out.append(b)
    return dataclasses.replace(spec, blocks=tuple(out), name=f"{spec.name}-narrow")


def _model(spec: ArchSpec, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model


def _cfg(tokens: int, **kw) -> SimpleNamespace:
    base = dict(
        tokens=tokens,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        batch_size=2,
        seq_len=16,
        checkpoint_every=4,
        log_every=100,
        weight_decay=0.0,
        grad_clip=1.0,
    )
    return SimpleNamespace(**{**base, **kw})


def _batches(vocab: int):
    # 64 token ids only: every id is seen many times in a few steps (random ids over the whole vocabulary
    # would let a layer fit the ids it saw and measure the ids it did not)
    return lambda step: torch.randint(0, min(vocab, 64), (2, 16), generator=torch.Generator().manual_seed(100 + step))


def _setup(spec: ArchSpec):
    sd = random_hf_state_dict(spec, seed=3)
    child = _narrow(spec)
    assert child != spec
    parent = _model(spec, sd)
    student = _model(child, slice_state_dict(spec, sd, child))
    assert train_only_changed(parent, student) > 0
    return parent, student


SPECS = {
    "dense": lambda: tiny_hetero_spec(),
    "moe": lambda: conf_spec("tiny_moe"),
    "hybrid": lambda: conf_spec("tiny_hybrid_moe"),
}
STEPS = {"dense": 32, "moe": 128, "hybrid": 32}
"""Steps of 2 x 16 tokens: routed experts (and their router) learn slower on random text than dense
layers; after 32 steps the tiny MoE's layers were closer on the batches trained on but not yet on
new ones; after 128 at lr 1e-3 on both (measured: every MoE layer 0.48-0.66 -> 0.43-0.51; at lr 3e-3 one of
four MoE layers ended worse on new batches)."""


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_narrowed_layer_gets_closer_to_its_parent(kind, tmp_path) -> None:
    if kind == "hybrid":
        pytest.importorskip("mamba_ssm", reason="Mamba blocks need mamba-ssm")
    spec = SPECS[kind]()
    parent, student = _setup(spec)
    probe = [_batches(spec.vocab)(1000 + i) for i in range(2)]
    before = layer_errors(student, parent, forward_logits, probe)
    res = train(
        student,
        local_objective(student, parent, forward_logits),
        _batches(spec.vocab),
        _cfg(STEPS[kind] * 32, lr=1e-3),
        tmp_path,
        seed=0,
        optimizer="torch",
        name="reconstruct",
    )
    after = layer_errors(student, parent, forward_logits, probe)
    assert res["final_loss"] < res["first_loss"], (res["first_loss"], res["final_loss"])
    narrowed = [i for i, e in enumerate(before) if e > 1e-6]
    assert narrowed, before  # the slice changed something
    for i in narrowed:  # every narrowed layer closer to the parent's output than the plain slice
        assert after[i] < before[i], (i, before[i], after[i])
    assert sum(after) < 0.9 * sum(before), (before, after)


def test_losses_measure_the_update_not_the_residual() -> None:
    from autocompress_nemo.distill.local import update_losses

    h = torch.randn(4, 2, 8)
    t = h + 0.1 * torch.randn(4, 2, 8)
    same = update_losses(t.clone(), t, h)
    assert float(same["nmse"]) < 1e-10 and float(same["cosine"]) < 1e-6
    none = update_losses(h.clone(), t, h)  # a student that adds nothing: the whole update is missing
    assert abs(float(none["nmse"]) - 1.0) < 1e-5


def test_a_killed_run_resumes_to_the_same_weights(tmp_path) -> None:
    spec = tiny_hetero_spec()
    ref_parent, ref = _setup(spec)
    train(
        ref,
        local_objective(ref, ref_parent, forward_logits),
        _batches(spec.vocab),
        _cfg(8 * 32),
        tmp_path / "a",
        seed=0,
        optimizer="torch",
    )

    parent, student = _setup(spec)
    data = _batches(spec.vocab)

    def dies_at_6(step: int) -> torch.Tensor:
        if step == 6:
            raise KeyboardInterrupt
        return data(step)

    with pytest.raises(KeyboardInterrupt):
        train(
            student,
            local_objective(student, parent, forward_logits),
            dies_at_6,
            _cfg(8 * 32),
            tmp_path / "b",
            seed=0,
            optimizer="torch",
        )
    parent, student = _setup(spec)
    res = train(
        student,
        local_objective(student, parent, forward_logits),
        data,
        _cfg(8 * 32),
        tmp_path / "b",
        seed=0,
        optimizer="torch",
    )
    assert res["resumed_from_step"] == 4
    for (k, a), (_, b) in zip(ref.state_dict().items(), student.state_dict().items(), strict=True):
        if torch.is_tensor(a) and a.is_floating_point():
            assert torch.equal(a, b), k


def test_a_hidden_size_change_is_refused_with_the_fix() -> None:
    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=3)
    child = dataclasses.replace(spec, hidden=spec.hidden // 2)
    parent, student = _model(spec, sd), build_model(child)
    with pytest.raises(ValueError, match="reconstruct.fraction=0"):
        local_objective(student, parent, forward_logits)


def test_the_split_of_the_recovery_tokens() -> None:
    from omegaconf import OmegaConf

    from autocompress_nemo.stages.reconstruct import split_tokens

    cfg = OmegaConf.create(
        {"distill": {"tokens": 32768, "batch_size": 2, "seq_len": 256}, "reconstruct": {"fraction": 0.25}}
    )
    assert split_tokens(cfg) == (8192, 24576)
    cfg.reconstruct.fraction = 0.0
    assert split_tokens(cfg) == (0, 32768)
    cfg.reconstruct.fraction = 1.0
    with pytest.raises(ValueError, match="reconstruct.fraction"):
        split_tokens(cfg)


def test_the_pipeline_runs_it_between_extract_and_distill(tmp_path) -> None:
    """Record: reconstruct runs after extract and before distill; distill gets the rest of the
    budget; with ``reconstruct.fraction=0`` it is passed through and distill reads the extract."""
    import json

    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    common = [*TINY_ROOFLINE, "search.steps=2", "distill.tokens=4096", "stages=[profile,rank,search,extract,distill]"]
    # (lr 1e-4: the tiny random parent's weights are ~0.02; the re-fit start is already close)
    out = run_pipeline(compose([*common, f"run_dir={tmp_path}/a", "reconstruct.fraction=0.5", "reconstruct.lr=1e-4"]))
    order = [r["stage"] for r in out["record"]]
    assert (
        order.index("extract_autocompress")
        < order.index("reconstruct_autocompress")
        < order.index("distill_autocompress")
    )
    assert statuses(out)["reconstruct_autocompress"] == "ran"
    rec = json.loads((tmp_path / "a" / "reconstruct_autocompress" / "reconstruct.json").read_text())
    dist = json.loads((tmp_path / "a" / "distill_autocompress" / "distill.json").read_text())
    assert rec["tokens"] == 2048 and dist["tokens"] == 2048 and dist["recovery_tokens"] == 4096
    assert sum(rec["layer_nmse_after"]) < sum(rec["layer_nmse_before"])
    man = json.loads((tmp_path / "a" / "distill_autocompress" / "manifest.json").read_text())
    assert "reconstruct_autocompress" in man["inputs"]
    # complete stages keep their artifact only: checkpoints (weights + optimizer state) are removed
    for stage in ("search_autocompress", "reconstruct_autocompress", "distill_autocompress"):
        assert (tmp_path / "a" / stage).is_dir() and not (tmp_path / "a" / f"{stage}.ckpt").exists(), stage

    off = run_pipeline(compose([*common, f"run_dir={tmp_path}/b", "reconstruct.fraction=0"]))
    assert statuses(off)["reconstruct_autocompress"] == "passed"
    man = json.loads((tmp_path / "b" / "distill_autocompress" / "manifest.json").read_text())
    assert "extract_autocompress" in man["inputs"] and "reconstruct_autocompress" not in man["inputs"]
    assert json.loads((tmp_path / "b" / "distill_autocompress" / "distill.json").read_text())["tokens"] == 4096


def test_the_report_shows_the_recovery_path() -> None:
    from autocompress_nemo.report.recovery_path import recovery_path_section

    res = {
        "models": {
            "parent": {"accuracy": {"heldout_ppl": 11.2}},
            "autocompress": {
                "label": "AutoCompress",
                "refit": {"sliced_kd": 1.49, "refit_kd": 0.96, "tokens": 8192, "blocks": [{}]},
                "reconstruct": {
                    "tokens": 8192,
                    "split": {"local": 8192, "global": 24576},
                    "layer_nmse_before": [0.4, 0.2],
                    "layer_nmse_after": [0.2, 0.1],
                },
                "accuracy": {"heldout_ppl": 20.0},
            },
            "minitron_pp": {"label": "Minitron++", "recovery_tokens": 32768, "accuracy": {"heldout_ppl": 28.0}},
        },
        "before_recovery": {"autocompress": {"heldout_ppl": 60.0}, "minitron_pp": {"heldout_ppl": 90.0}},
        "after_local": {"autocompress": {"heldout_ppl": 30.0}},
    }
    text = "\n".join(recovery_path_section(res))
    ac = next(line for line in text.splitlines() if line.startswith("| AutoCompress"))
    assert "30" in ac and "8,192 tok; layer error 0.300 -> 0.150" in ac and "24,576 tok" in ac, ac
    mpp = next(line for line in text.splitlines() if line.startswith("| Minitron++"))
    assert "reconstruct.fraction=0" in mpp and "32,768 tok" in mpp, mpp


def _mlp_only_narrowed(spec: ArchSpec) -> ArchSpec:
    blocks = tuple(dataclasses.replace(b, ffn=b.ffn // 2) if b.kind == "mlp" and b.ffn else b for b in spec.blocks)
    return dataclasses.replace(spec, blocks=blocks, name=f"{spec.name}-mlp-narrow")


def _attention_grad(unit: str) -> tuple[float, float]:
    """The local loss's gradient norm on the student's attention weights and on its MLP weights, when
    only the MLPs were narrowed (the attention is the parent's own)."""
    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=3)
    child = _mlp_only_narrowed(spec)
    parent, student = _model(spec, sd), _model(child, slice_state_dict(spec, sd, child))
    obj = local_objective(student, parent, forward_logits, unit=unit)
    obj.setup()
    try:
        loss, metrics = obj.loss(_batches(spec.vocab)(0))
    finally:
        obj.teardown()
    loss.backward()
    norm = lambda key: sum(  # noqa: E731
        float(p.grad.norm()) for n, p in student.named_parameters() if key in n and p.grad is not None
    )
    return norm("self_attention"), norm(".mlp.")


def test_block_unit_trains_attention_and_mlp_apart() -> None:
    """``reconstruct.unit=block``: the MLP's error does not reach the attention (it is scored on the
    parent's residual after the parent's attention); ``layer``: it does, through the layer's update."""
    attn_layer, mlp_layer = _attention_grad("layer")
    attn_block, mlp_block = _attention_grad("block")
    assert mlp_layer > 0 and mlp_block > 0, (mlp_layer, mlp_block)
    assert attn_layer > 1e-4, attn_layer  # together: the narrowed MLP's error trains the attention too
    assert attn_block < 1e-7 * max(1.0, attn_layer), attn_block  # apart: the attention is already exact


def test_block_unit_brings_every_narrowed_layer_closer(tmp_path) -> None:
    spec = tiny_hetero_spec()
    parent, student = _setup(spec)
    probe = [_batches(spec.vocab)(1000 + i) for i in range(2)]
    before = layer_errors(student, parent, forward_logits, probe)
    res = train(
        student,
        local_objective(student, parent, forward_logits, unit="block"),
        _batches(spec.vocab),
        _cfg(32 * 32, lr=1e-3),
        tmp_path,
        seed=0,
        optimizer="torch",
        name="reconstruct",
    )
    after = layer_errors(student, parent, forward_logits, probe)
    assert res["final_loss"] < res["first_loss"], (res["first_loss"], res["final_loss"])
    narrowed = [i for i, e in enumerate(before) if e > 1e-6]
    assert narrowed and all(after[i] < before[i] for i in narrowed), (before, after)

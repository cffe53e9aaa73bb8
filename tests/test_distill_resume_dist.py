"""distill resumes from its Megatron-LM distributed checkpoint (``distill.dist_state``, torch_dist) to
the same losses and weights as an uninterrupted run, on one process and on two gloo ranks (TP=2,
DP=2); the checkpoint directory is Megatron-LM's layout (``latest_checkpointed_iteration.txt`` ->
``iter_0000002``) holding the model, AdamW's state sharded like the parameters, the RNG states
(``ShardedObject``) and the step. Resuming the weights without AdamW's state gives other losses:
the equality below is sensitive to the optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec
from test_distill import _cfg, batch_fn

STEPS, KILL_AT = 6, 3  # checkpoints every 2 steps: the killed run leaves iter_0000002


class Killed(RuntimeError):
    """Raised by the batch function at ``kill_at``: the run stops there as if its process died."""


def _models(student_seed: int = 1):  # noqa: ANN202
    from autocompress_nemo.models.builder import build_model

    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    student = build_model(tiny_hetero_spec(), init_seed=student_seed, impl="local")
    return student, teacher


def _run(out: Path, student_seed: int = 1, kill_at: int | None = None) -> tuple[dict, dict]:
    """distill STEPS steps into ``out`` (raising ``Killed`` at step ``kill_at``); the result and the
    student's weights (HF names)."""
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.models.builder import forward_logits
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

    data = batch_fn(128, 4, 16)

    def batch_at(step: int) -> torch.Tensor:
        if step == kill_at:
            raise Killed(f"simulated kill at step {step}")
        return data(step)

    student, teacher = _models(student_seed)
    cfg = _cfg(STEPS, intermediate_weight=0.5)
    res = distill(student, teacher, forward_logits, batch_at, cfg, out, seed=7, optimizer="torch", log=lambda s: None)
    return res, megatron_to_hf(tiny_hetero_spec(), student)


def _killed(out: Path) -> None:
    with pytest.raises(Killed):
        _run(out, kill_at=KILL_AT)


def _losses(res: dict) -> list[float]:
    return [r["loss"] for r in res["history"]]


def test_resume_from_the_dist_checkpoint_equals_the_uninterrupted_run(megatron_tp1, tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing

    ref, ref_w = _run(tmp_path / "a")
    _killed(tmp_path / "b")
    root = tmp_path / "b" / "checkpoints"
    # Megatron-LM's layout: the tracker names the newest complete iteration
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    ckpt = root / "iter_0000002"
    assert (ckpt / "metadata.json").is_file() and list(ckpt.glob("*.distcp"))
    assert not list(root.glob("step_*")) and not list(ckpt.glob("*.pt"))  # no torch.save shards
    latest = json.loads((root / "latest.json").read_text())
    assert (latest["step"], latest["dir"], latest["format"]) == (2, "iter_0000002", "torch_dist")
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    assert common["iteration"] == 2 and common["checkpoint_version"] == 3.0
    assert common["args"].ckpt_format == "torch_dist" and not common["args"].no_save_optim
    assert common["opt_param_scheduler"]["num_steps"] == 2 and common["distill"]["step"] == 2
    assert int(common["optimizer"]["state"]["common_step"]) == 2  # AdamW's step, once for every parameter
    keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    model_keys = {k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in model_keys
    for moment in ("exp_avg", "exp_avg_sq"):  # AdamW's moments, sharded like their parameters
        assert {k for k in keys if k.startswith(f"optimizer.state.{moment}.")} == {
            f"optimizer.state.{moment}.{k}" for k in model_keys
        }
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = dist_checkpointing.load({"rng_state": ShardedObject("rng_state", None, (1,), (0,), replica_id=0)}, str(ckpt))[
        "rng_state"
    ]
    assert set(rng) >= {"python", "numpy", "torch"}

    res, w = _run(tmp_path / "b", student_seed=99)  # another start: the checkpoint supplies everything
    assert res["resumed_from_step"] == 2 and res["tokens_this_run"] == (STEPS - 2) * 64
    print(f"uninterrupted losses {_losses(ref)}\nresumed losses       {_losses(res)}")
    assert _losses(res) == _losses(ref)  # exact: same data, same order of operations, same AdamW state
    assert set(w) == set(ref_w) and all(torch.equal(w[k], ref_w[k]) for k in ref_w)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000004", "iter_0000006"]  # keep_checkpoints=2


def test_resuming_the_weights_without_the_optimizer_state_diverges(megatron_tp1, tmp_path: Path, monkeypatch) -> None:
    """The equality above depends on AdamW's state: dropped after the load, the resumed run's
    losses after its first step differ from the uninterrupted run's."""
    from autocompress_nemo.distill import dist_state

    ref, ref_w = _run(tmp_path / "a")
    _killed(tmp_path / "b")
    apply = dist_state.DistState.apply

    def weights_only(self, got: dict) -> dict:  # noqa: ANN001
        out = apply(self, got)
        self.opt.opt.state.clear()  # AdamW starts afresh (moments 0, step 0) from the restored weights
        return out

    monkeypatch.setattr(dist_state.DistState, "apply", weights_only)
    res, w = _run(tmp_path / "b", student_seed=99)
    assert res["resumed_from_step"] == 2
    a, b = _losses(ref), _losses(res)
    print(f"uninterrupted losses {a}\nweights-only resume  {b}")
    assert b[:3] == a[:3]  # the restored weights: the first resumed step's loss is the same
    assert all(abs(x - y) > 1e-6 for x, y in zip(a[3:], b[3:], strict=True)), (a, b)
    assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) > 1e-4


def _parallel(rank: int, world: int, tp: int, root: str) -> dict:
    """On each of 2 ranks: uninterrupted, killed at step 3, resumed; losses and weights."""
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=tp, seed=0)
    ref, ref_w = _run(Path(root) / "a")
    with pytest.raises(Killed):  # the run dies at step 3, leaving iter_0000002
        _run(Path(root) / "b", kill_at=KILL_AT)
    res, w = _run(Path(root) / "b", student_seed=99)
    return {
        "ref": _losses(ref),
        "res": _losses(res),
        "from": res["resumed_from_step"],
        "dweight": max((w[k] - ref_w[k]).abs().max().item() for k in ref_w),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_gloo_ranks_resume_from_the_dist_checkpoint(megatron_tp1, tmp_path: Path, tp: int) -> None:
    from autocompress_nemo.distributed.spawn import spawn

    outs = spawn(_parallel, 2, tp, str(tmp_path))
    for o in outs:
        print(f"tp={tp}: resumed from {o['from']}, losses {o['res']}, max |dweight| {o['dweight']:.1e}")
        assert o["from"] == 2 and o["res"] == o["ref"] and o["dweight"] == 0.0
    ckpt = tmp_path / "b" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    assert sorted(p.name for p in (ckpt / "iter_0000006").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def _resume_at(rank: int, world: int, tp: int, root: str) -> dict:
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import forward_logits
    from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

    init_distributed(tp=tp, seed=0)
    logs: list[str] = []
    student, teacher = _models(99)
    res = distill(
        student,
        teacher,
        forward_logits,
        batch_fn(128, 4, 16),
        _cfg(STEPS, intermediate_weight=0.5),
        Path(root) / "b",
        seed=7,
        optimizer="torch",
        log=logs.append,
    )
    w = megatron_to_hf(tiny_hetero_spec(), student)
    return {"from": res["resumed_from_step"], "losses": _losses(res), "logs": logs, "w": w if rank == 0 else None}


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_a_one_process_checkpoint_resumes_on_two_ranks(megatron_tp1, tmp_path: Path, tp: int) -> None:
    """A checkpoint of one process resumes on two ranks: at DP=2 (model and AdamW state replicated)
    and at TP=2 (torch_dist reshards the weights and AdamW's moments along their TP axis; before,
    another TP size was refused). Each rank's RNG states are not in it: left as they are."""
    from autocompress_nemo.distributed.spawn import spawn

    ref, ref_w = _run(tmp_path / "a")
    _killed(tmp_path / "b")
    outs = spawn(_resume_at, 2, tp, str(tmp_path))
    for o in outs:
        print(f"tp={tp}: resumed from {o['from']}, losses {o['losses']} (uninterrupted {_losses(ref)})")
        assert o["from"] == 2
        assert o["losses"] == pytest.approx(_losses(ref), rel=1e-5, abs=1e-6)  # two ranks sum in another order
        assert any("resharding it to TP=2" in line for line in o["logs"]) == (tp == 2)
    w = outs[0]["w"]
    assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) < 1e-4

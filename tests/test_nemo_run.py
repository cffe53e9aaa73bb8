"""``autocompress-launch --backend nemo_run`` (``launchers/nemo_run.py``; nemo-run 0.11.1, leptonai<0.47):

- Local executor: a tiny pipeline (tiny Llama, analytic cost model) runs end to end on this machine as
  one NeMo-Run task (``python -m autocompress_nemo.search``) and leaves the pipeline's artifacts; a stage
  that fails is a failed launch;
- Slurm executor: submitted through NeMo-Run's ``LocalTunnel`` to a fake ``sbatch`` on PATH, stage after
  stage (``--dependency=afterok``), each task the same torchrun / module / overrides as the sbatch backend;
- Docker executor: rendered (NeMo-Run's dry run), the image, GPUs and mounts from the cluster config.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from test_slurm import BASE, IMAGE, compose_run, fake_sbatch

from launchers import launch as launch_mod
from launchers.render import job_for
from tests.cfg_utils import TINY_ROOFLINE

nemo_run = pytest.importorskip("nemo_run", reason="nemo-run is not installed (pip install 'nemo-run' 'leptonai<0.47')")


@pytest.fixture(autouse=True)
def _nemo_run_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun_home"))
    # NeMo-Run's LocalTunnel runs sbatch through invoke, which reads stdin (pytest's raises on reading)
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # noqa: SIM115


def _fake_slurm_queries(tmp_path: Path) -> None:
    """``sacct`` / ``squeue`` next to the fake ``sbatch``: NeMo-Run asks for the state after submitting."""
    for name in ("sacct", "squeue"):
        f = tmp_path / "bin" / name
        f.write_text("#!/bin/bash\necho 'JobID|State'\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)


def test_local_executor_runs_tiny_pipeline(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [*TINY_ROOFLINE, "search.steps=4", "stages=[profile,rank,search,extract]", "cluster=local"]
    rc = launch_mod.main(["--backend", "nemo_run", *overrides, f"run_dir={run_dir}"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "pipeline: SUCCEEDED (nemo_run local" in out, out[-3000:]  # one task: the pipeline in one process
    record = json.loads((run_dir / "record.json").read_text())
    status = {r["name"]: r["status"] for r in record["stages"]}
    assert {"profile", "rank", "search", "extract"} <= set(status), status
    assert set(status.values()) == {"ran"}, status
    assert (run_dir / "extract_autocompress").is_dir()
    assert any((run_dir / "nemo_run" / "experiments" / "autocompress").rglob("SUCCESS"))


def test_local_executor_reports_a_failed_stage(tmp_path, monkeypatch, capsys):
    """A task that exits non-zero (here an interpreter that refuses to run) is a failed launch: exit 2,
    naming the stage and where NeMo-Run keeps its logs."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'refusing to run' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("sys.executable", str(fake))
    overrides = [*TINY_ROOFLINE, "stages=[rank]", "cluster=local"]
    rc = launch_mod.main(["--backend", "nemo_run", *overrides, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "nemo_run local: stage(s) rank did not succeed" in err, err
    log = next((tmp_path / "run" / "nemo_run").rglob("rank/0/stderr.log")).read_text()
    assert "refusing to run" in log


def test_slurm_executor_submits_to_fake_sbatch(tmp_path, monkeypatch):
    log = fake_sbatch(tmp_path, monkeypatch)
    _fake_slurm_queries(tmp_path)
    cfg = compose_run([*BASE, f"run_dir={tmp_path / 'run'}"])
    ids = launch_mod.launch(
        cfg, BASE, stage="pipeline", chain=True, render_only=False, backend="nemo_run", out_dir=tmp_path / "nr"
    )
    stages = list(cfg.stages)
    assert len(ids) == len(stages)
    args = [line for line in log.read_text().splitlines() if line.startswith("ARGS")]
    assert len(args) == len(stages)
    assert args[0].startswith("ARGS --requeue --parsable ") and "--dependency" not in args[0]
    assert "--dependency=afterok:4241" in args[1] and "--dependency=afterok:4242" in args[2]
    jobs = tmp_path / "nr"
    search = next(jobs.rglob("search_sbatch.sh")).read_text()
    for expected in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=12:00:00",
        "#SBATCH --signal=B:USR1@300",
        f"--container-image {IMAGE}",
        "--container-mounts",
        "bash /nemo_run/scripts/search.sh",
        'head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)',
    ):
        assert expected in search, expected
    step = job_for(cfg, ["search"], BASE).steps[0]
    script = next(jobs.rglob("scripts/search.sh")).read_text()
    assert "cd /workspace/autocompress-nemo" in script
    assert (
        'exec torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d "--rdzv-endpoint=$head_node_ip:29500" '
        '"--rdzv-id=$SLURM_JOB_ID" -m autocompress_nemo.search ' + step.args
    ) in script
    assert "export NCCL_DEBUG=WARN" in script
    extract = next(jobs.rglob("scripts/extract.sh")).read_text()
    assert "--nnodes=1 --nproc-per-node=1" in extract  # each stage its own layout, as the sbatch backend


def test_slurm_render_only_submits_nothing(tmp_path, monkeypatch, capsys):
    log = fake_sbatch(tmp_path, monkeypatch)
    cfg = compose_run([*BASE, f"run_dir={tmp_path / 'run'}"])
    ids = launch_mod.launch(
        cfg, BASE, stage="distill", chain=False, render_only=True, backend="nemo_run", out_dir=tmp_path / "nr"
    )
    assert ids == [] and not log.exists()
    sbatch = next((tmp_path / "nr").rglob("distill_sbatch.sh")).read_text()
    assert "#SBATCH --time=1-00:00:00" in sbatch
    assert any((tmp_path / "nr").rglob("distill.sh"))
    assert "nemo_run: rendered 1 task(s)" in capsys.readouterr().out


def test_docker_executor_rendered(tmp_path, capsys):
    image = "nvcr.io/acme/autocompress-nemo:0.1.0"
    overrides = [
        *TINY_ROOFLINE,
        "cluster=local",
        f"cluster.container_image={image}",
        "cluster.gpus_per_node=1",
        "cluster.container_mounts=[/data:/data]",
    ]
    cfg = compose_run([*overrides, f"run_dir={tmp_path / 'run'}"])
    launch_mod.launch(
        cfg, overrides, stage="rank", chain=False, render_only=True, backend="nemo_run", out_dir=tmp_path / "nr"
    )
    out = capsys.readouterr().out
    assert "DockerExecutor" in out or "docker" in out.lower()
    exp = next((tmp_path / "nr" / "experiments" / "autocompress").iterdir())
    executor = (exp / "rank" / "configs" / "rank_executor.yaml").read_text()
    for expected in (f"container_image: {image}", "num_gpus: 1", "runtime: nvidia", "- /data:/data"):
        assert expected in executor, expected
    script = (exp / "rank" / "scripts" / "rank.sh").read_text()
    assert "cd /workspace/autocompress-nemo" in script
    assert "exec python -m autocompress_nemo.search 'stages=[rank]' model=tiny_llama +target=tiny_cpu" in script


def test_missing_nemo_run_is_explained(monkeypatch):
    import builtins

    from launchers import nemo_run as nr
    from launchers.render import LaunchError

    real = builtins.__import__

    def no_nemo_run(name, *a, **k):  # noqa: ANN001, ANN002, ANN003
        if name == "nemo_run":
            raise ImportError("No module named 'nemo_run'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nemo_run)
    with pytest.raises(LaunchError, match="leptonai<0.47"):
        nr._nemo_run()

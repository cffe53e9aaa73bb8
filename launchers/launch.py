"""``autocompress-launch``: run a stage or the whole pipeline where ``cluster=...`` says.

    autocompress-launch --stage search cluster=slurm_2x8 +target=b200_128k model=nemotron_super
    autocompress-launch --chain cluster=slurm_b200x8 +target=b200_128k model=nemotron_super
    autocompress-launch --render-only --stage distill cluster=slurm_2x8 ...   # print, submit nothing
    autocompress-launch --stage rank cluster=local ...                        # torchrun here

Everything after the flags is a Hydra override, composed here exactly as the job will compose
it, and passed to the job unchanged: the cluster decides where a stage runs, never what it
computes.

Backends for Slurm: ``sbatch`` (default) submits the rendered script from ``slurm/`` with
``sbatch --parsable``; ``submitit`` submits the same torchrun step through submitit's
``SlurmExecutor`` (job objects, states and requeue handled by submitit). ``nemo_run`` runs or
submits through NeMo-Run's Local / Docker / Slurm executors (``launchers/nemo_run.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from autocompress_nemo.plan.layout import STAGES
from launchers.render import LaunchError, job_for, local_command, parse_time, render_sbatch, step_for


def compose(overrides: list[str]) -> Any:
    """The composed run config (the same entry the stages use)."""
    try:
        from autocompress_nemo.config.entry import compose as _compose
    except ImportError as e:  # pragma: no cover - depends on the config entry being installed
        raise LaunchError(f"cannot compose the config: autocompress_nemo.config.entry is missing ({e})") from e
    return _compose(overrides)


def out_dir_problem(out_dir: Path | None) -> str | None:
    """Why ``--out`` cannot hold the rendered scripts (it, or a directory above it, is a file), or None."""
    if out_dir is None:
        return None
    p = Path(out_dir).expanduser().absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if anc.exists() and not anc.is_dir():
        what = f"{p} is a file" if anc == p else f"{anc} is a file, so {p} cannot be created"
        return (
            f"--out {out_dir}: {what}; --out names a directory for the rendered scripts "
            f"(<out>/<stage>.sbatch): give a directory path, e.g. --out {p.parent / 'slurm'}"
        )
    return None


def time_limit_problems(cfg: Any) -> list[str]:
    """``cluster.time_limits.<stage>`` values that are not Slurm times (``forever``, ``4h``), each
    named with its field and the forms Slurm takes."""
    limits = (cfg.cluster.get("time_limits") if hasattr(cfg.cluster, "get") else None) or {}
    out = []
    for stage, value in dict(limits).items():
        try:
            seconds = parse_time(str(value))
            ok = seconds > 0
        except (ValueError, LaunchError):
            ok = False
        if not ok:
            out.append(
                f"cluster.time_limits.{stage}={value!r} is not a Slurm time limit; give [D-]HH:MM:SS, HH:MM:SS, "
                f"MM:SS or minutes, e.g. cluster.time_limits.{stage}=04:00:00 (4 hours) or 2-00:00:00 (2 days)"
            )
        elif stage not in STAGES:
            out.append(f"cluster.time_limits.{stage}: {stage!r} is not a stage; the stages are {', '.join(STAGES)}")
    return out


def write_script(text: str, out_dir: Path, name: str) -> Path:
    """``<out_dir>/<name>.sbatch``, written atomically (a temporary name, then renamed)."""
    problem = out_dir_problem(out_dir)
    if problem:
        raise LaunchError(problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.sbatch"
    tmp = out_dir / f".{name}.sbatch.tmp-{os.getpid()}"
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def sbatch_submit(script: Path, dependency: str | None = None) -> str:
    """``sbatch --parsable [--dependency=afterok:ID] script`` -> job id."""
    cmd = ["sbatch", "--parsable"]
    if dependency:
        cmd.append(f"--dependency=afterok:{dependency}")
    cmd.append(str(script))
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError as e:
        raise LaunchError("sbatch not found on PATH: run on a Slurm login node, or use --render-only") from e
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"sbatch refused {script}: {e.stderr.strip() or e.stdout.strip()}") from e
    return out.split(";")[0]


class TorchrunStep:
    """A submitit callable: runs the stage's torchrun on one node; requeued on timeout or
    preemption (the stage resumes from its checkpoints)."""

    def __init__(self, nnodes: int, nproc: int, module: str, argv: list[str], workdir: str):
        self.nnodes, self.nproc, self.module, self.argv, self.workdir = nnodes, nproc, module, argv, workdir

    def command(self) -> list[str]:
        endpoint = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '29500')}"
        return [
            "torchrun",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={os.environ.get('SLURM_JOB_ID', 'local')}",
            "-m",
            self.module,
            *self.argv,
        ]

    def __call__(self) -> int:
        return subprocess.run(self.command(), check=True, cwd=self.workdir).returncode

    def checkpoint(self) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def submitit_submit(cfg: Any, stage: str, overrides: list[str], folder: Path, dependency: str | None = None) -> str:
    """Submit one stage through submitit's SlurmExecutor (same resources, container, step)."""
    import submitit

    job = job_for(cfg, [stage], overrides)
    step = job.steps[0]
    # python="python": the worker runs inside the container, whose python is on PATH
    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=int(cfg.cluster.max_requeues), python="python")
    params: dict[str, Any] = dict(
        job_name=job.job_name,
        nodes=step.nodes,
        ntasks_per_node=1,
        gpus_per_node=job.gpus_per_node,
        time=max(1, parse_time(job.time_limit) // 60),
        signal_delay_s=job.signal_seconds,
        setup=[f"export {k}={shlex.quote(v)}" for k, v in job.env]
        + [
            'export MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"',
            f"export MASTER_PORT={job.master_port}",
        ],
        srun_args=[
            f"--container-image={job.container_image}",
            f"--container-mounts={step.mounts or job.container_mounts}",
            f"--container-workdir={job.container_workdir}",
        ],
    )
    cl = cfg.cluster
    for key in ("partition", "account", "qos", "constraint"):
        if cl.get(key):
            params[key] = str(cl.get(key))
    if dependency:
        params["dependency"] = f"afterok:{dependency}"
    ex.update_parameters(**params)
    sub = ex.submit(TorchrunStep(step.nodes, step.nproc_per_node, job.module, step.argv, job.container_workdir))
    return str(sub.job_id)


def launch(
    cfg: Any,
    overrides: list[str],
    *,
    stage: str,
    chain: bool,
    render_only: bool,
    backend: str,
    out_dir: Path | None = None,
) -> list[str]:
    """Render (and unless ``render_only``, submit or run) the requested job(s); returns job ids
    (Slurm) or the local return codes as strings."""
    stages = list(cfg.stages) if stage == "pipeline" else [stage]
    if backend == "nemo_run":  # NeMo-Run executors (Local / Docker / Slurm), one task per stage
        from launchers.nemo_run import launch as nemo_run_launch

        return nemo_run_launch(cfg, overrides, stages=stages, chain=chain, render_only=render_only, out_dir=out_dir)
    if str(cfg.cluster.kind) == "local":
        codes = []
        for st in stages:
            cmd = local_command(cfg, st, overrides, python=sys.executable)
            print("$ " + " ".join(shlex.quote(c) for c in cmd))
            if not render_only:
                codes.append(str(subprocess.run(cmd).returncode))
                if codes[-1] != "0":
                    break
        return codes
    run_dir = Path(str(cfg.run_dir))
    out_dir = out_dir or run_dir / "slurm"
    jobs = [job_for(cfg, [st], overrides) for st in stages] if chain else [job_for(cfg, stages, overrides)]
    ids: list[str] = []
    for job in jobs:
        name = job.steps[0].stage if len(job.steps) == 1 else "pipeline"
        path = write_script(render_sbatch(job), out_dir, name)
        print(f"rendered {path}")
        if render_only:
            continue
        Path(job.log_dir).mkdir(parents=True, exist_ok=True)  # Slurm does not create --output dirs
        dep = ids[-1] if ids else None
        if backend == "submitit":
            ids.append(
                submitit_submit(cfg, job.steps[0].stage, overrides, Path(job.log_dir), dep)
                if len(job.steps) == 1
                else sbatch_submit(path, dep)
            )
        else:
            ids.append(sbatch_submit(path, dep))
        print(f"submitted {name}: job {ids[-1]}" + (f" (after {dep})" if dep else ""))
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="autocompress-launch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--stage", default="pipeline", choices=["pipeline", *STAGES], help="one stage, or the whole pipeline (default)"
    )
    p.add_argument(
        "--chain", action="store_true", help="pipeline as one Slurm job per stage, each after the previous (afterok)"
    )
    p.add_argument("--render-only", action="store_true", help="write and print the scripts / commands; submit nothing")
    p.add_argument("--backend", choices=["sbatch", "submitit", "nemo_run"], default="sbatch")
    p.add_argument("--out", type=Path, default=None, help="where rendered scripts go (default <run_dir>/slurm)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=slurm_2x8 +target=b200_128k")
    a = p.parse_args(argv)
    try:
        if problem := out_dir_problem(a.out):  # before composing: nothing is rendered for nothing
            raise LaunchError(problem)
        cfg = compose(a.overrides)
        if problems := time_limit_problems(cfg):
            raise LaunchError("; ".join(problems))
        launch(
            cfg, a.overrides, stage=a.stage, chain=a.chain, render_only=a.render_only, backend=a.backend, out_dir=a.out
        )
    except (LaunchError, ValueError) as e:
        print(f"autocompress-launch: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["launch", "main", "sbatch_submit", "submitit_submit", "step_for", "TorchrunStep"]

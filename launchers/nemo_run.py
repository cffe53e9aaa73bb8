"""NeMo-Run as a launch backend: ``autocompress-launch --backend nemo_run ...``.

The cluster config decides the executor, the job computes what the sbatch / local launchers compute
(the same ``python -m autocompress_nemo.search stages=[<stage>] <overrides>`` or its torchrun, from
``launchers/render.py``):

============================================  =====================================================
``cluster.kind``                               NeMo-Run executor
============================================  =====================================================
``local``                                      ``run.LocalExecutor`` (this machine; torchrun when
                                               ``cluster.processes_per_node > 1``, as the local launcher)
``local`` with ``cluster.container_image``     ``run.DockerExecutor`` (the image, ``container_mounts`` as
                                               volumes, ``gpus_per_node`` GPUs)
``slurm``                                      ``run.SlurmExecutor`` (pyxis container, the stage's nodes,
                                               GPUs and time limit; ``sbatch`` through a ``LocalTunnel``
                                               on a login node)
============================================  =====================================================

One NeMo-Run experiment per launch. On Slurm one task per stage, each submitted
``--dependency=afterok`` on the previous one (a stage has its own nodes, GPUs and time limit); locally and
in Docker the pipeline is one task (``python -m autocompress_nemo.search``, every stage in one process),
or one task per stage with ``--chain``. ``--render-only`` is NeMo-Run's dry run: it prints
the scripts and submits nothing. Experiments live under ``<run_dir>/nemo_run`` (NeMo-Run's
``base_dir``).

nemo-run 0.11.1 imports only with ``leptonai<0.47`` (the ``launch`` extra pins both).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from launchers.render import MODULE, LaunchError, job_for, local_command, parse_time, step_for

EXPERIMENT = "autocompress"


def _nemo_run() -> Any:
    try:
        import nemo_run
    except ImportError as e:
        raise LaunchError(
            f"--backend nemo_run needs nemo-run ({e}): pip install 'nemo-run' 'leptonai<0.47' "
            "(the project's `launch` extra)"
        ) from e
    return nemo_run


def executor_kind(cfg: Any) -> str:
    """``local``, ``docker`` or ``slurm``: which NeMo-Run executor ``cfg.cluster`` asks for."""
    cl = cfg.cluster
    if str(cl.kind) == "slurm":
        return "slurm"
    if str(cl.kind) == "local":
        return "docker" if str(cl.get("container_image") or "") else "local"
    raise LaunchError(f"cluster.kind={cl.kind!r}: the nemo_run backend knows local (Local / Docker) and slurm")


def _inline(workdir: str, cmd: list[str], env: list[tuple[str, str]] = ()) -> str:  # type: ignore[assignment]
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in env]
    # arguments naming a variable of the job's environment ($head_node_ip, $SLURM_JOB_ID) are expanded
    lines += [f"cd {shlex.quote(workdir)}", "exec " + " ".join(f'"{c}"' if "$" in c else shlex.quote(c) for c in cmd)]
    return "\n".join(lines) + "\n"


def script_for(cfg: Any, stage: str, overrides: list[str], workdir: str | None = None) -> Any:
    """The stage's command as a ``run.Script`` (inline bash: ``cd`` to the work directory, then the same
    command the other launchers run)."""
    run = _nemo_run()
    kind = executor_kind(cfg)
    if kind == "local":
        cmd = local_command(cfg, stage, overrides, python=sys.executable)
        return run.Script(inline=_inline(workdir or os.getcwd(), cmd))
    if kind == "docker":
        # the image's interpreter, in the container's work directory (the project installed in the image)
        cmd = local_command(cfg, stage, overrides, python="python")
        return run.Script(inline=_inline(str(cfg.cluster.get("container_workdir") or "/workspace"), cmd))
    job = job_for(cfg, [stage], overrides)
    step = job.steps[0]
    # one task per node; torchrun starts the node's ranks (as the sbatch template does), rendezvous at the
    # head node NeMo-Run's Slurm script resolves into $head_node_ip
    torchrun = [
        "torchrun",
        f"--nnodes={step.nodes}",
        f"--nproc-per-node={step.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$head_node_ip:{job.master_port}",
        "--rdzv-id=$SLURM_JOB_ID",
        "-m",
        job.module,
        *step.argv,
    ]
    return run.Script(inline=_inline(job.container_workdir, torchrun, job.env))


def executor_for(cfg: Any, stage: str, overrides: list[str], job_dir: Path) -> Any:
    """The NeMo-Run executor of ``stage`` on ``cfg.cluster`` (see the module docstring)."""
    run = _nemo_run()
    cl = cfg.cluster
    kind = executor_kind(cfg)
    if kind == "local":
        return run.LocalExecutor(ntasks_per_node=1)
    if kind == "docker":
        gpus = int(cl.get("gpus_per_node") or 0)
        return run.DockerExecutor(
            container_image=str(cl.container_image),
            num_gpus=gpus if gpus else None,
            runtime="nvidia" if gpus else None,
            ipc_mode="host",
            shm_size="16g",
            volumes=[str(m) for m in (cl.get("container_mounts") or [])],
            packager=run.Packager(),
            job_dir=str(job_dir),
        )
    job = job_for(cfg, [stage], overrides)
    step = job.steps[0]
    extra: dict[str, Any] = {}
    for key in ("qos", "constraint"):
        if cl.get(key):
            extra[key] = str(cl.get(key))
    return run.SlurmExecutor(
        account=str(cl.get("account") or "") or None,
        partition=str(cl.get("partition") or "") or None,
        job_name_prefix="acn-",
        nodes=step.nodes,
        ntasks_per_node=1,
        gpus_per_node=job.gpus_per_node,
        time=job.time_limit,
        container_image=job.container_image,
        container_mounts=[m for m in (step.mounts or job.container_mounts).split(",") if m],
        signal=f"B:USR1@{job.signal_seconds}" if job.requeue else None,
        tunnel=run.LocalTunnel(job_dir=str(job_dir)),
        packager=run.Packager(),
        retries=int(cl.get("max_requeues") or 0) if job.requeue else 0,
        **extra,
    )


def pipeline_script(cfg: Any, overrides: list[str], workdir: str | None = None) -> Any:
    """The whole pipeline as one task on this machine or in the image: ``python -m autocompress_nemo.search
    <overrides>`` (the stages of ``cfg.stages`` in one process, as ``make run``), under torchrun when
    ``cluster.processes_per_node > 1``."""
    run = _nemo_run()
    user = [o for o in overrides if not o.startswith("stages=")] + [f"stages=[{','.join(cfg.stages)}]"]
    docker = executor_kind(cfg) == "docker"
    python = "python" if docker else sys.executable
    n = int(cfg.cluster.get("processes_per_node") or 1)
    cmd = [python, "-m", MODULE, *user]
    if n > 1:
        cmd = ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={n}", "-m", MODULE, *user]
    wd = str(cfg.cluster.get("container_workdir") or "/workspace") if docker else (workdir or os.getcwd())
    return run.Script(inline=_inline(wd, cmd))


def launch(
    cfg: Any,
    overrides: list[str],
    *,
    stages: list[str],
    chain: bool = False,
    render_only: bool,
    out_dir: Path | None = None,
) -> list[str]:
    """Run (local, Docker) or submit (Slurm) ``stages`` as one NeMo-Run experiment; ``render_only``:
    NeMo-Run's dry run. On Slurm one task per stage, each after the previous (``afterok``: each stage has
    its own nodes and time limit); locally and in Docker the whole pipeline is one task, as
    ``python -m autocompress_nemo.search`` runs it, unless ``chain`` asks for one task per stage. Returns
    the tasks' final states (local, Docker) or the Slurm job ids."""
    run = _nemo_run()
    base = Path(out_dir or Path(str(cfg.run_dir)) / "nemo_run").resolve()
    base.mkdir(parents=True, exist_ok=True)
    kind = executor_kind(cfg)
    if kind == "slurm":
        for st in stages:
            parse_time(job_for(cfg, [st], overrides).time_limit)  # refuse a bad layout / image before submitting
    one_task = kind != "slurm" and not chain and len(stages) > 1
    tasks = ["pipeline"] if one_task else stages
    with run.Experiment(
        EXPERIMENT,
        base_dir=str(base),
        log_level="WARN",
        enable_goodbye_message=False,
        clean_mode=True,
    ) as exp:
        for st in tasks:
            exp.add(
                pipeline_script(cfg, overrides) if st == "pipeline" else script_for(cfg, st, overrides),
                executor=executor_for(cfg, st, overrides, base / "jobs"),
                name=st,
                tail_logs=False,
            )
        if render_only:
            exp.dryrun(log=True, delete_exp_dir=False)
            print(f"nemo_run: rendered {len(tasks)} task(s) under {exp._exp_dir}")
            return []
        exp.run(sequential=True, detach=kind == "slurm", tail_logs=False)
    if kind == "slurm":
        ids = [str(j.handle).rsplit("/", 1)[-1] for j in exp.jobs]
        for st, i in zip(stages, ids, strict=True):
            print(f"submitted {st}: job {i} (nemo_run, {exp._exp_dir})")
        return ids
    states = [str(j.state).split(" ")[0] for j in exp.jobs]
    for st, s in zip(tasks, states, strict=True):
        print(f"{st}: {s} (nemo_run {kind}, logs under {exp._exp_dir})")
    failed = [st for st, s in zip(tasks, states, strict=True) if s != "SUCCEEDED"]
    if failed:
        raise LaunchError(f"nemo_run {kind}: stage(s) {', '.join(failed)} did not succeed (logs under {exp._exp_dir})")
    return states


def step_summary(cfg: Any, stage: str, overrides: list[str]) -> str:
    """One line: where ``stage`` runs under this backend (for logs and tests)."""
    kind = executor_kind(cfg)
    if kind == "slurm":
        s = step_for(cfg, stage, overrides)
        return f"{stage}: SlurmExecutor {s.nodes} node(s) x {s.nproc_per_node} process(es)"
    return f"{stage}: {'DockerExecutor' if kind == 'docker' else 'LocalExecutor'}"

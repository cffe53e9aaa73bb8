"""Render sbatch scripts and torchrun command lines from the composed Hydra config.

One description of a job (``JobSpec``: resources, container, one ``StepSpec`` per stage)
feeds both the sbatch templates in ``slurm/`` and the submitit backend, so what a reviewer
reads is what runs. Every stage runs ``python -m autocompress_nemo.search stages=[<stage>]``
with the user's own overrides, so ``cluster=...`` changes where a job runs, never what it
computes.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.plan.layout import DISTRIBUTED_STAGES, STAGES, ParallelLayout, layout_for_stage, layout_problems

SLURM_DIR = Path(__file__).resolve().parent.parent / "slurm"
MODULE = "autocompress_nemo.search"
DEFAULT_TIME = "04:00:00"
ENGINE_STAGES = ("profile", "validate", "search", "evaluate")
"""Stages that measure models in the target's engine (search: the measured check before any weights
are sliced). Their engine worker runs in the engine's serving image; the stage itself, like every
other stage, runs in the training image."""


class LaunchError(ValueError):
    """A job that cannot be rendered or submitted as configured (the message says what to set)."""


@dataclass
class StepSpec:
    stage: str
    nodes: int
    nproc_per_node: int
    layout_text: str
    argv: list[str]
    """Arguments after ``-m <module>``: ``stages=[<stage>]``, the user's overrides, then (engine stages
    under Slurm) where the engine worker runs: ``target.engine.container`` / ``container_mounts``."""
    mounts: str = ""
    """``--container-mounts`` of this step ("" = the job's)."""
    engine_note: str = ""
    """Where the step's engine worker runs (a comment in the script)."""

    @property
    def args(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)


@dataclass
class JobSpec:
    job_name: str
    nodes: int
    gpus_per_node: int
    time_limit: str
    log_dir: str
    container_image: str
    container_mounts: str
    container_workdir: str
    steps: list[StepSpec]
    requeue: bool = True
    signal_seconds: int = 300
    max_requeues: int = 5
    master_port: int = 29500
    env: list[tuple[str, str]] = field(default_factory=list)
    sbatch_lines: list[str] = field(default_factory=list)
    module: str = MODULE
    config_note: str = ""


def parse_time(t: str) -> int:
    """Seconds in a Slurm time ``[D-]HH:MM:SS`` / ``MM:SS`` / ``MM``."""
    days, _, rest = str(t).rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if not 1 <= len(parts) <= 3:
        raise LaunchError(f"time limit {t!r}: use [D-]HH:MM:SS")
    if len(parts) == 1:
        secs = parts[0] * 60
    elif len(parts) == 2:
        secs = parts[0] * 60 + parts[1]
    else:
        secs = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return secs + (int(days) * 86400 if days else 0)


def format_time(seconds: int) -> str:
    d, r = divmod(int(seconds), 86400)
    h, r = divmod(r, 3600)
    m, s = divmod(r, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"


def stage_layout(cfg: Any, stage: str) -> ParallelLayout:
    """The stage's layout, validated against the model (raises ``LaunchError`` listing problems)."""
    layout = layout_for_stage(cfg.cluster, stage)
    if stage in DISTRIBUTED_STAGES:
        section = cfg.distill if stage == "distill" else cfg.search
        batch = cfg.search.calib_sequences if stage == "rank" else section.batch_size
        problems = layout_problems(
            layout,
            spec_from_model_config(cfg.model),
            seq_len=int(section.seq_len),
            global_batch=int(batch),
            micro_batch=int(cfg.cluster.micro_batch_size),
        )
        if problems:
            raise LaunchError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
    return layout


def engine_image(cfg: Any) -> str:
    """The serving image the engine worker runs in: ``target.engine.container``, else the cluster's
    ``engine_images[<engine>]`` unless ``target.engine.python`` names an interpreter; "" = none."""
    eng = cfg.target.engine
    if str(eng.get("container") or ""):
        return str(eng.container)
    if str(eng.get("python") or ""):
        return ""
    images = cfg.cluster.get("engine_images") or {}
    return str(images.get(str(eng.name), "") or "")


def _mounts(cfg: Any) -> str:
    return ",".join(str(m) for m in (cfg.cluster.get("container_mounts") or []))


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def _hydra_str(value: str) -> str:
    """``value`` as a Hydra override value: as is when Hydra reads it as that string, else quoted
    (a comma would make it a sweep, ``#`` in an enroot URI is not a value character)."""
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", value) and not re.fullmatch(r"[0-9.+-]+|true|false|null", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def engine_overrides(cfg: Any, stage: str, overrides: list[str]) -> list[str]:
    """For an engine stage on a Slurm cluster with a serving image: the overrides that run the engine
    worker in that image (``srun --container-image``, costs/engines/worker.py) with the job's own
    mounts, so the run directory is at the same path in both containers. Keys the user gave win."""
    if stage not in ENGINE_STAGES or str(cfg.cluster.kind) != "slurm":
        return []
    image = engine_image(cfg)
    if not image:
        return []
    out = []
    if not _given(overrides, "target.engine.container"):
        out.append(f"target.engine.container={_hydra_str(image)}")
    mounts = str(cfg.target.engine.get("container_mounts") or "") or _mounts(cfg)
    if mounts and not _given(overrides, "target.engine.container_mounts"):
        out.append(f"target.engine.container_mounts={_hydra_str(mounts)}")
    return out


def step_for(cfg: Any, stage: str, overrides: list[str]) -> StepSpec:
    layout = stage_layout(cfg, stage)
    user = [o for o in overrides if not o.startswith("stages=")]
    engine = engine_overrides(cfg, stage, user)
    mounts, note = _mounts(cfg), ""
    if engine or (stage in ENGINE_STAGES and str(cfg.target.engine.get("container") or "")):
        client = [f"{p}:{p}" for p in (cfg.cluster.get("slurm_client_mounts") or [])]
        mounts = ",".join(m for m in [mounts, *client] if m)
        note = f"engine {cfg.target.engine.name} worker in {engine_image(cfg)} (srun --container-image)"
    return StepSpec(
        stage,
        layout.nodes,
        layout.procs_per_node,
        layout.describe(),
        [f"stages=[{stage}]", *user, *engine],
        mounts=mounts,
        engine_note=note,
    )


def job_for(cfg: Any, stages: list[str], overrides: list[str], name: str | None = None) -> JobSpec:
    """The job that runs ``stages`` in order (one stage: a stage job; several: a pipeline job)."""
    cl = cfg.cluster
    for st in stages:
        if st not in STAGES:
            raise LaunchError(f"unknown stage {st!r}; stages: {', '.join(STAGES)}")
    if str(cl.kind) != "slurm":
        raise LaunchError(f"cluster.kind={cl.kind!r}: sbatch scripts are for cluster=slurm_*; use the local launcher")
    if not str(cl.container_image or ""):
        raise LaunchError(
            "cluster.container_image is empty: build the Dockerfile, import it with enroot "
            "(enroot import -o acn.sqsh dockerd://autocompress-nemo:0.1.0) and set "
            "cluster.container_image=<path to acn.sqsh> or export ACN_IMAGE"
        )
    if int(cl.gpus_per_node or 0) < 1:
        raise LaunchError(f"cluster {cl.name}: gpus_per_node must be >= 1 for a Slurm GPU job")
    steps = [step_for(cfg, st, overrides) for st in stages]
    limits = dict(cl.time_limits or {})
    seconds = sum(parse_time(limits.get(st, DEFAULT_TIME)) for st in stages)
    run_dir = str(cfg.run_dir)
    extra = [f"--partition={cl.partition}"] if cl.partition else []
    extra += [f"--account={cl.account}"] if cl.account else []
    extra += [f"--qos={cl.qos}"] if cl.qos else []
    extra += [f"--constraint={cl.constraint}"] if cl.constraint else []
    extra += [str(x) for x in (cl.sbatch_extra or [])]
    label = name or (stages[0] if len(stages) == 1 else "pipeline")
    return JobSpec(
        job_name=f"acn-{label}-{Path(run_dir).name}",
        nodes=max(s.nodes for s in steps),
        gpus_per_node=int(cl.gpus_per_node),
        time_limit=format_time(seconds),
        log_dir=str(cl.log_dir or f"{run_dir}/logs/slurm"),
        container_image=str(cl.container_image),
        container_mounts=",".join(str(m) for m in (cl.container_mounts or [])),
        container_workdir=str(cl.container_workdir),
        steps=steps,
        requeue=bool(cl.requeue),
        signal_seconds=int(cl.signal_seconds),
        max_requeues=int(cl.max_requeues),
        master_port=int(cl.master_port),
        env=[(str(k), str(v)) for k, v in dict(cl.env or {}).items()],
        sbatch_lines=extra,
        config_note=f"cluster={cl.name}; overrides: {' '.join(overrides) or '(none)'}",
    )


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(SLURM_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def render_sbatch(job: JobSpec) -> str:
    """The sbatch script for ``job`` (``stage.sbatch.j2`` for one step, else ``pipeline.sbatch.j2``)."""
    template = "stage.sbatch.j2" if len(job.steps) == 1 else "pipeline.sbatch.j2"
    return _env().get_template(template).render(job=job)


def local_command(cfg: Any, stage: str, overrides: list[str], python: str = "python") -> list[str]:
    """``cluster=local``: torchrun on this machine for a multi-process stage, else plain python."""
    layout = layout_for_stage(cfg.cluster, stage)
    argv = step_for(cfg, stage, overrides).argv
    if layout.world > 1:
        return [
            "torchrun",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={layout.procs_per_node}",
            "-m",
            MODULE,
            *argv,
        ]
    return [python, "-m", MODULE, *argv]

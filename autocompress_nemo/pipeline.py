"""Run directory and stage bookkeeping shared by every stage entry point.

A stage's artifact lives in ``<run_dir>/<stage>``. Its config hash covers the config
sections the stage reads and the checksums of the artifacts it consumes, so a change of
content upstream reruns everything downstream (a recomputed upstream artifact with
byte-identical content does not). A complete, intact artifact (manifest present,
every checksum holds) with the same hash is skipped; anything else is recomputed — a
truncated or corrupted artifact is reported and never used. Long stages keep their
checkpoints in ``<run_dir>/<stage>.ckpt/`` (outside the atomic artifact), so a killed
stage resumes where it stopped; the directory carries the stage's cache key (``fingerprint.json``)
and a checkpoint of other inputs is set aside (renamed), never resumed (:meth:`Run.checkpoint`).
Stages that read ``data`` also hash what the corpus files hold (``data/fingerprint.py``), not
only their paths. A run holds ``<run_dir>/.lock`` while it works (``rundir.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autocompress_nemo.rundir import clean_leftovers, launch_rank, locked, make_dir
from autocompress_nemo.utils import work
from autocompress_nemo.utils.artifacts import (
    artifact,
    hash_obj,
    is_complete,
    read_manifest,
    set_aside,
    verify_or_explain,
    write_json_atomic,
)
from autocompress_nemo.utils.memory import StagePeak

log = logging.getLogger("autocompress")

FINGERPRINT = "fingerprint.json"
ENGINE_PLACEMENT = ("python", "container", "container_mounts", "timeout_s")
"""``target.engine`` keys that say where the engine runs, never part of a cache key (the cost table
records the engine version it measured)."""
"""In a stage's checkpoint directory: the cache key of the inputs its checkpoints were made from."""


def cache_dir(cfg: DictConfig) -> Path:
    """Where a run keeps what it may recompute (token streams, data file hashes): ``cache_dir``
    when set (several runs may share it), else ``<run_dir>/.cache``."""
    given = OmegaConf.select(cfg, "cache_dir", default="") or ""
    return Path(str(given)).expanduser() if given else Path(str(cfg.run_dir)) / ".cache"


def _dist() -> Any:
    """``torch.distributed`` when a process group is up, else None (imported where used, so that this
    module imports without torch)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def is_rank0() -> bool:
    dist = _dist()
    return dist is None or dist.get_rank() == 0


def barrier() -> None:
    if (dist := _dist()) is not None:
        dist.barrier()


def rank0s(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself when not distributed): a decision every rank must
    take alike, made where rank 0 stands."""
    if (dist := _dist()) is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Artifact layouts that changed in a way older artifacts cannot serve: a stage listed here puts
# its version into its input hash, so a run directory written by older code recomputes the stage
# instead of handing the next stage files it cannot read. Bump a stage's number when its
# artifact's content changes meaning. rank 2: hybrid scores / permutations gained attention
# heads, dense-MLP neurons and hidden channels.
ARTIFACT_VERSIONS: dict[str, int] = {"rank": 3}


class Run:
    """The run directory of one pipeline invocation."""

    def __init__(self, cfg: DictConfig, say: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.dir = make_dir(str(cfg.run_dir))  # a file / unwritable parent: one line naming the path
        self.say = say or (lambda s: print(s, flush=True))
        self.wall: dict[str, float] = {}
        self.records: list[dict[str, Any]] = []
        """What this invocation did, stage by stage (:meth:`note`): the runner's returned record."""
        self._data_fp: str | None = None
        self.suffix = ""
        """Appended to every stage directory this run names: ``@<budget>`` for a member of a family
        (``search.budgets``, ``search/family.py``); empty otherwise."""

    def for_budget(self, cfg: DictConfig, suffix: str) -> Run:
        """This run as one budget of a family sees it: ``cfg`` (that budget's config) for the cache
        keys, ``suffix`` on the stage directories; the directory, lock and data fingerprint are shared."""
        out = copy.copy(self)
        out.cfg, out.suffix = cfg, suffix
        return out

    @contextlib.contextmanager
    def session(self) -> Iterator[Run]:
        """The run holds ``<run_dir>/.lock`` (a second run on the directory refuses, naming this
        one's pid); what killed stages left (``*.tmp-<pid>``) is removed first."""
        if launch_rank() != 0:  # rank 0 holds the lock for the whole torchrun job
            yield self
            return
        with locked(self.dir, self.say):
            clean_leftovers(self.dir, self.say)
            yield self

    def data_fingerprint(self) -> str:
        """What the corpus files hold (sizes, mtimes, content hashes cached per file), once per run."""
        if self._data_fp is None:
            from autocompress_nemo.data.fingerprint import data_fingerprint

            self._data_fp = data_fingerprint(self.cfg.data, cache_dir(self.cfg) / "data_hashes.json")
        return self._data_fp

    def section(self, *keys: str) -> dict[str, Any]:
        """The config sections ``keys`` as plain data: a stage's cache key (less the engine's placement)."""
        out: dict[str, Any] = {}
        for k in keys:
            v = OmegaConf.select(self.cfg, k)
            out[k] = OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
        target = out.get("target")
        if isinstance(target, dict) and isinstance(target.get("engine"), dict):  # where the engine runs, not what
            target["engine"] = {k: v for k, v in target["engine"].items() if k not in ENGINE_PLACEMENT}
        if isinstance(out.get("target.engine"), dict):
            out["target.engine"] = {k: v for k, v in out["target.engine"].items() if k not in ENGINE_PLACEMENT}
        search = out.get("search")
        if isinstance(search, dict) and not search.get("budgets"):  # no family: the keys of a run before them
            out["search"] = {k: v for k, v in search.items() if k not in ("budgets", "family_steps")}
        return out

    def config_hash(self, keys: tuple[str, ...], inputs: list[Path], name: str = "") -> str:
        ins = {}
        for p in inputs:  # what the inputs hold (their checksums), not only how they were made
            m = read_manifest(p)
            ins[p.name] = hash_obj(m.get("files")) if m else None
        key: dict[str, Any] = {"sections": self.section(*keys), "inputs": ins}
        if any(k == "data" or k.startswith("data.") for k in keys):  # the corpus's content, not only its paths
            key["data_content"] = self.data_fingerprint()
        if name in ARTIFACT_VERSIONS:
            key["artifact_version"] = ARTIFACT_VERSIONS[name]
        return hash_obj(key)

    def run_stage(
        self,
        stage: Any,
        ctx: Any,
        fn: Callable[[Any, Path], Any],
        inputs: list[Path] | None = None,
        method: str | None = None,
    ) -> Path:
        """Run a declared stage (``stages.Stage``): its cache key from ``stage.reads`` and the
        checksums of ``inputs``; ``fn(view, tmp_dir)`` gets a context whose config holds only
        ``stage.reads`` (``Context.for_stage``)."""
        view = ctx.for_stage(stage.reads)
        return self.stage(
            stage.dir_name(method) + self.suffix,
            lambda d: fn(view, d),
            stage.reads,
            inputs,
            rank0_only=stage.rank0_only,
            meta={"name": stage.name, "method": method, "budget": self.suffix.lstrip("@") or None},
        )

    def note(self, stage: str, status: str, /, **fields: Any) -> dict[str, Any]:
        """Add one row to :attr:`records`: ``stage`` (the artifact's directory name), ``status``
        (``ran``, ``skipped``, ``reused``, ``failed``, ``passed`` for a disabled stage, ``dropped``
        for a method that could not run) and ``key``, ``seconds``, ``artifact``, ``why`` as known."""
        row = {"stage": stage, "status": status, **fields}
        self.records.append(row)
        return row

    def reuse(self, stage: Any, inputs: list[Path] | None = None, method: str | None = None) -> Path | None:
        """The artifact of a declared stage that is not asked to run, when it is complete for the same
        inputs (a stage's result never depends on whether it ran in this invocation or an earlier one:
        a Slurm chain runs one stage per job); ``None`` otherwise."""
        final = self.dir / (stage.dir_name(method) + self.suffix)
        h = self.config_hash(stage.reads, inputs or [], stage.name)
        if is_complete(final, h):
            self.say(f"[{final.name}] reused: artifact complete for the same inputs ({final})")
            self.note(
                final.name,
                "reused",
                name=stage.name,
                method=method,
                budget=self.suffix.lstrip("@") or None,
                key=h,
                seconds=0.0,
                artifact=str(final),
            )
            return final
        return None

    def ckpt_dir(self, name: str) -> Path:
        d = self.dir / f"{name}.ckpt"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def checkpoint(self, stage: Any, inputs: list[Path] | None = None, method: str | None = None) -> Path:
        """The checkpoint directory of a declared stage, ``<run_dir>/<stage>.ckpt``, holding only
        checkpoints made from this stage's inputs: it records the stage's cache key (config sections
        read, input checksums, data content) in ``fingerprint.json``; a directory with another key
        (or none) is set aside as ``<stage>.ckpt.stale`` and reported in one line, never resumed."""
        d = self.dir / f"{stage.dir_name(method)}{self.suffix}.ckpt"
        if launch_rank() == 0:  # (before the process group is up, too: the other ranks wait in its init)
            fingerprinted(d, self.config_hash(stage.reads, inputs or [], stage.name), self.say)
        barrier()
        return d

    def stage(
        self,
        name: str,
        fn: Callable[[Path], dict[str, Any] | None],
        keys: tuple[str, ...],
        inputs: list[Path] | None = None,
        rank0_only: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Run ``fn(tmp_dir)`` unless ``<run_dir>/<name>`` is complete for the same inputs.

        ``rank0_only``: under torch.distributed only rank 0 runs ``fn`` (engine profiling: copies
        timed at once on one machine would disturb each other); the others wait at the barrier."""
        inputs = inputs or []
        final = self.dir / name
        h = self.config_hash(keys, inputs, name)
        row: dict[str, Any] = {**(meta or {"name": name}), "key": h, "artifact": str(final)}
        # Rank 0 decides: a rank that looked later could see the artifact rank 0 has just written,
        # skip, and leave rank 0 alone at the barrier below.
        if rank0s(is_complete(final, h)):
            self.say(f"[{name}] skipped: artifact complete for the same inputs ({final})")
            self.note(name, "skipped", seconds=0.0, **row)
            return final
        why: list[str] = []
        if final.exists() and is_rank0():
            problems = verify_or_explain(final)
            m = read_manifest(final)
            why = problems or ([f"config changed ({m.get('config_hash')} -> {h})"] if m else ["no manifest"])
            self.say(f"[{name}] recomputing: " + "; ".join(why))
        self.say(f"[{name}] running")
        t0, flops0 = time.time(), work.taken()
        try:
            with StagePeak() as peak:
                if is_rank0():
                    with artifact(final, stage=name, config_hash=h, inputs={p.name: str(p) for p in inputs}) as tmp:
                        fn(tmp)
                elif not rank0_only:  # other ranks compute too (collectives) but write into a scratch directory
                    with tempfile.TemporaryDirectory(prefix=f"{name}-rank") as scratch:
                        fn(Path(scratch))
                barrier()
        except BaseException as e:
            self.note(name, "failed", seconds=time.time() - t0, why=f"{type(e).__name__}: {e}"[:300], **row)
            raise
        self.wall[name] = time.time() - t0
        row.update(peak.fields())
        if work.taken() > flops0:  # what the stage counted (``utils/work.py``): its FLOP bound's numerator
            row["flops"] = work.taken() - flops0
        self.note(name, "ran", seconds=self.wall[name], **row, **({"why": "; ".join(why)} if why else {}))
        self.say(f"[{name}] done in {self.wall[name]:.1f} s -> {final}")
        return final


def fingerprinted(d: Path, fingerprint: str, say: Callable[[str], None] = print) -> Path:
    """``d`` as a checkpoint directory of ``fingerprint`` (``Run.checkpoint``)."""
    fp_file = d / FINGERPRINT
    if d.exists():
        old: Any = None
        if d.is_dir():
            try:
                old = json.loads(fp_file.read_text()).get("fingerprint")
            except (OSError, ValueError, AttributeError):
                old = None
            if old == fingerprint:
                return d
        if not (d.is_dir() and old is None and not any(d.iterdir())):  # an empty directory: nothing to set aside
            aside = set_aside(d, "stale")
            why = f"fingerprint {old}, now {fingerprint}" if old else "no fingerprint"
            say(f"[{d.name}] checkpoint made from other inputs ({why}): set aside as {aside}; starting over")
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(fp_file, {"fingerprint": fingerprint})
    return d

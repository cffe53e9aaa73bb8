"""Entry points into the configuration: ``compose`` for programs and tests, ``hydra_entry`` for
every stage's ``__main__``.

A stage's ``__main__`` reads::

    from autocompress_nemo.config.entry import hydra_entry

    @hydra_entry
    def main(cfg):            # cfg: the composed, validated RunConfig
        ...

    if __name__ == "__main__":
        main()

The target group is not in ``run.yaml``'s defaults list (so that ``+target=<name>`` works, as
the README shows); ``target=<name>`` is accepted too and no target means ``cpu_chat``. That is
a small rewrite of the command line before Hydra sees it (:func:`normalize_overrides`).
Unknown choices of a config group and every validation problem end in one message on stderr
and exit status 2, never a traceback — and before Hydra creates or writes anything in the run
directory (:func:`preflight`): a rejected command leaves a finished run's ``.hydra/`` as it was.
Hydra's flags (``--cfg job``, ``--help``, ``--info`` ...) work wherever they are placed
(:func:`flags_first`). Hydra's own messages that point the wrong way are answered first: a setting
the schema lacks given without ``+`` (``sed=1``: did you mean ``seed``, :func:`unknown_override`), a
group chosen twice (:func:`duplicate_choices`), a Slurm cluster run outside Slurm
(:func:`invocation_problems`). Every entry point ends the same way (:func:`run_task`): Ctrl-C says
"interrupted; rerun the same command to resume" (exit 130), a full disk is one line naming the path.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import hydra
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from autocompress_nemo.config.own_model import fill_model_from_file
from autocompress_nemo.config.resolve import CONF_DIR, available
from autocompress_nemo.config.store import register_configs
from autocompress_nemo.config.validate import ConfigError, validate

DEFAULT_TARGET = "cpu_chat"
CONFIG_NAME = "run"
GROUPS = ("model", "target", "search", "distill", "data", "cluster", "experiment")
TARGET_PARTS = ("hardware", "engine", "workload", "budget")
"""Groups a target composes; override one with e.g. ``engine@target.engine=roofline``."""
_TARGET_RE = re.compile(r"^(\+{0,2})target=(.*)$")
_CHOICE_RE = re.compile(r"^\+{0,2}([a-z_]+)(?:@([A-Za-z_.]+))?=(.*)$")


def normalize_overrides(args: Sequence[str]) -> list[str]:
    """``target=x`` -> ``+target=x``; no target at all -> ``+target=cpu_chat``.

    The target override is placed first among the overrides (before the first ``key=value``
    argument), so that configs appended after it — ``+experiment=...`` — may override it.
    Every other argument (overrides and Hydra flags such as ``--cfg job``) passes unchanged.
    """
    rest, targets = [], []
    for a in args:
        m = _TARGET_RE.match(a)
        if m:
            targets.append(("++" if m.group(1) == "++" else "+") + "target=" + m.group(2))
        else:
            rest.append(a)
    if not targets:
        targets = [f"+target={DEFAULT_TARGET}"]
    first = next((i for i, a in enumerate(rest) if "=" in a and not a.startswith("-")), len(rest))
    return rest[:first] + targets + rest[first:]


_VALUED_FLAGS = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--shell-completion",
    "-sc",
}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
SHOW_ONLY = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion", "-sc")
"""Flags that only print: no task runs, nothing is written, nothing is validated up front."""


def flags_first(args: Sequence[str]) -> list[str]:
    """Hydra's flags (and their values) before the overrides: Hydra's parser takes the overrides as
    one positional list, so ``a=1 --cfg job b=2`` would fail with "unrecognized arguments"."""
    flags, rest = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            nxt = args[i + 1] if i + 1 < len(args) else None
            takes = a in _VALUED_FLAGS or (a in ("--info", "-i") and nxt in _INFO_CHOICES)
            if takes and nxt is not None:
                flags.append(nxt)
                i += 1
        else:
            rest.append(a)
        i += 1
    return flags + rest


def check_choices(args: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for every ``group=name`` whose config does not exist, listing
    the available names (``model``, ``target``, ``search`` ... and a target's parts)."""
    if any(a.startswith(("hydra.searchpath", "+hydra.searchpath")) for a in args):
        return  # configs may come from elsewhere; let Hydra look
    problems = duplicate_choices(args)
    for a in args:
        m = _CHOICE_RE.match(a)
        if not m:
            continue
        group, package, value = m.groups()
        if group in TARGET_PARTS and package is None:
            problems.append(f"{group}={value}: a target's {group} is chosen with {group}@target.{group}={value}")
            continue
        if group not in GROUPS and not (group in TARGET_PARTS and package == f"target.{group}"):
            continue
        names = available(group)
        if value not in names:
            problems.append(f"unknown {group} {value!r}; available {group} configs: {', '.join(names)}")
    if problems:
        raise ConfigError(problems)


def duplicate_choices(args: Sequence[str]) -> list[str]:
    """One problem per config group *added* more than once (``+target=a target=b``: the target is
    always added, see :func:`normalize_overrides`): Hydra's own answer is advice in YAML defaults-list
    syntax. A group overridden twice without ``+`` (``model=a model=b``) is Hydra's "last one wins"."""
    chosen: dict[str, list[str]] = {}
    for a in args:
        m = _CHOICE_RE.match(a)
        if m and a.startswith("+") and (m.group(1) in GROUPS or m.group(1) in TARGET_PARTS):
            chosen.setdefault(m.group(1) + (f"@{m.group(2)}" if m.group(2) else ""), []).append(a)
    out = []
    for group, given in chosen.items():
        if len(given) > 1:
            name = group.split("@")[0]
            how = "+target=<name>" if name == "target" else f"{group}=<name>"
            out.append(
                f"{name} is chosen {len(given)} times ({', '.join(given)}); keep one {how}"
                + (" (a target's parts are changed with engine@target.engine=<name>, ...)" if name == "target" else "")
            )
    return out


_NOT_IN_STRUCT = re.compile(r"Could not override '([^']+)'|Key '([^']+)' is not in struct")


def unknown_override(message: str, overrides: Sequence[str]) -> str | None:
    """Hydra's "Could not override 'sed' ... Key 'sed' is not in struct" as one line naming the closest
    setting of the typed schema (``sed=1``: did you mean ``seed``?), or None for another error."""
    import dataclasses
    import difflib
    import typing

    from autocompress_nemo.config.schema import RunConfig

    m = _NOT_IN_STRUCT.search(message)
    if not m:
        return None
    key = m.group(1) or m.group(2)
    given = next((a for a in overrides if a.lstrip("+~").split("=", 1)[0] == key), key)
    cls: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None  # a free-form section: Hydra's word stands
        hints = typing.get_type_hints(cls)
        if part in hints:
            cls = hints[part]
            continue
        prefix = ".".join(parts[:i])
        names = list(hints)
        near = difflib.get_close_matches(part, names, n=1)
        section = prefix or "the run config"
        where = f"{prefix}." if prefix else ""
        return f"{given}: {section} has no setting {part!r}; " + (
            f"did you mean {where}{near[0]}?" if near else f"its settings are {', '.join(names)}"
        )
    return None


def compose(overrides: Sequence[str] | None = None) -> DictConfig:
    """The run config for ``overrides`` (command-line syntax), composed from the package's
    ``conf/`` with Hydra's compose API. Not validated: call ``validate(cfg)``.

    Raises :class:`ConfigError` for an unknown group choice or a composition error (a key the
    schema does not have, a value of the wrong type), and for a ``model=hf`` / ``model=gguf`` parent
    whose shape cannot be read from its own files (``own_model.py``; read ones are filled in).
    """
    args = normalize_overrides(list(overrides or []))
    check_choices(args)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="autocompress"):
        try:
            cfg = hydra.compose(config_name=CONFIG_NAME, overrides=args)
        except (HydraException, OmegaConfBaseException) as e:
            cause = f"\n{e.__cause__}" if e.__cause__ is not None and str(e.__cause__) not in str(e) else ""
            raise ConfigError([unknown_override(str(e) + cause, args) or _first_lines(str(e) + cause)]) from None
    fill_model_from_file(cfg, args)  # model=hf / model=gguf: the shape from the parent's own files
    return cfg


def hydra_entry(task_fn: Callable[[DictConfig], Any], lock_run_dir: bool = False) -> Callable[[], Any]:
    """Wrap ``task_fn(cfg)`` as a command-line program: returns ``main()``.

    ``main()`` rewrites the command line (:func:`normalize_overrides`), checks group choices,
    runs ``hydra.main`` on the package's ``conf/run.yaml`` (so ``--help``, ``--cfg job``,
    ``--multirun`` and every override work as in any Hydra app), validates the composed config
    and calls ``task_fn(cfg)``. Bad choices and invalid configs exit with status 2 and one
    message on stderr, before Hydra writes anything (:func:`preflight`). ``lock_run_dir``: take
    the run directory's lock before Hydra writes its config record there (a second run refuses).
    """

    @functools.wraps(task_fn)
    def main() -> Any:
        children_leave_ctrl_c_to_the_parent()
        note_ctrl_c()
        try:
            return _main()
        except KeyboardInterrupt:  # Ctrl-C before or between stages: the same line, no traceback
            interrupted()

    def _main() -> Any:
        register_configs()
        args = flags_first(normalize_overrides(sys.argv[1:]))
        try:
            check_choices(args)
        except ConfigError as e:
            _fail(e)
        if not any(a.startswith("hydra.job.name=") for a in args):
            args.append(f"hydra.job.name={_job_name(task_fn)}")
        run_dir = preflight(args, lock=lock_run_dir)
        sys.argv = [sys.argv[0], *args]

        @hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base="1.3")
        def _run(cfg: DictConfig) -> Any:
            try:
                from hydra.core.hydra_config import HydraConfig

                hc = HydraConfig.get()
                fill_model_from_file(cfg, list(hc.overrides.task), hc.runtime.choices.get("model"))
                validate_here(cfg, list(hc.overrides.task))
            except ConfigError as e:
                _fail(e)
            one_line_log_file_errors()
            return run_task(task_fn, cfg)

        try:
            return _run()
        finally:
            if run_dir is not None:
                from autocompress_nemo.rundir import release_lock

                release_lock(run_dir)

    return main


def preflight(args: Sequence[str], lock: bool = False) -> str | None:
    """Compose and validate the command line's overrides *before* Hydra runs: Hydra creates the run
    directory and writes ``.hydra/`` and the log file before the task starts, so a rejected command
    would otherwise leave debris (or overwrite a finished run's record). Exits with status 2 and one
    message on a problem. With ``lock``, takes the run directory's lock (a second run refuses,
    naming the holder's pid) and returns the run directory (the caller releases it). The previous
    config record is moved to ``.hydra/history/`` so every accepted invocation keeps its own.
    Skipped for flags that only print (``--cfg``, ``--help``) and for ``--multirun`` sweeps."""
    other_config = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun")
    if any(a in SHOW_ONLY or a in ("--multirun", "-m") or a in other_config for a in args):
        return None  # printing only, a sweep, or another primary config: Hydra's own handling
    if any(a.lstrip("+").startswith("hydra.searchpath") for a in args):
        return None  # configs from elsewhere: only Hydra can compose them
    overrides = [a for a in args if not a.startswith("-") and not a.lstrip("+~").startswith("hydra.")]
    try:
        cfg = compose(overrides)
        validate_here(cfg, overrides)
    except ConfigError as e:
        _fail(e)
    from autocompress_nemo.rundir import RunDirError, acquire_lock, archive_config_record, launch_rank, make_dir

    if cfg.dry_run or launch_rank() != 0:  # the other ranks of a torchrun job: rank 0 locks and records
        return None

    try:
        run_dir = str(make_dir(str(cfg.run_dir)))
        if lock:
            acquire_lock(run_dir, say=lambda s: print(s, flush=True))
        archive_config_record(run_dir)
    except (RunDirError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return run_dir if lock else None


INTERRUPTED = "interrupted; rerun the same command to resume"
"""What Ctrl-C ends with (exit status 130): finished stages are skipped, search and distill resume
from their checkpoints."""


def interrupted() -> None:
    """Ctrl-C: one line (rank 0 only), exit status 130 (128 + SIGINT), no traceback."""
    import signal

    from autocompress_nemo.rundir import launch_rank

    with contextlib.suppress(ValueError):  # a second Ctrl-C must not turn the exit into a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if launch_rank() == 0:
        print(f"\nautocompress: {INTERRUPTED}", file=sys.stderr, flush=True)
    sys.exit(130)


_CTRL_C: list[float] = []
"""When this process received SIGINT (``time.monotonic()``), by :func:`note_ctrl_c`'s handler."""


def note_ctrl_c() -> None:
    """SIGINT raises ``KeyboardInterrupt`` as Python's own handler does, and is noted: a library that
    turns the interrupt into another error (an ``ImportError`` from a C extension interrupted while it
    initialized, a checkpoint writer's failure) still ends as :func:`interrupted`. Main thread only, and
    only over Python's default handler."""
    import signal
    import threading
    import time

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def on_sigint(signum: int, frame: Any) -> None:
        _CTRL_C.append(time.monotonic())
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


_CHILDREN_QUIET = False


def children_leave_ctrl_c_to_the_parent() -> None:
    """Worker processes this process starts ignore SIGINT: a terminal's Ctrl-C reaches the whole process
    group, and each worker (Megatron's asynchronous checkpoint writers, data loaders) would print its own
    ``KeyboardInterrupt`` traceback while the parent already ends with :func:`interrupted`. Forked
    children ignore it from the fork on (``os.register_at_fork``); spawned ones (a fresh interpreter)
    are started with SIGINT ignored, which Python keeps at start-up (``multiprocessing.util.spawnv_passfds``
    wrapped: the parent ignores SIGINT only for the fork-and-exec itself). The parent stops its daemonic
    workers when it exits and waits for the others (a checkpoint being written is finished)."""
    global _CHILDREN_QUIET
    import multiprocessing.util
    import os
    import signal

    if _CHILDREN_QUIET or not hasattr(os, "register_at_fork"):
        return
    _CHILDREN_QUIET = True
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    spawn = multiprocessing.util.spawnv_passfds

    @functools.wraps(spawn)
    def spawn_ignoring_sigint(*args: Any, **kwargs: Any) -> Any:
        try:
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: signals cannot be changed here
            return spawn(*args, **kwargs)
        try:
            return spawn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, before)

    multiprocessing.util.spawnv_passfds = spawn_ignoring_sigint


def run_task(task_fn: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """``task_fn(cfg)`` with the endings every entry point shares: Ctrl-C is :func:`interrupted`; a
    full disk anywhere inside an exception — a distributed checkpoint's per-rank failures, a cause, a
    library's text — is one line naming the path (``rundir.describe_os_error``), exit status 2.
    ``AUTOCOMPRESS_DEBUG=1`` keeps the traceback."""
    import os

    from autocompress_nemo.rundir import describe_os_error, disk_error

    try:
        return task_fn(cfg)
    except KeyboardInterrupt:
        interrupted()
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a full disk
        if _CTRL_C and not os.environ.get("AUTOCOMPRESS_DEBUG"):
            interrupted()  # Ctrl-C that a library turned into another error
        if os.environ.get("AUTOCOMPRESS_DEBUG") or not disk_error(e, str(cfg.run_dir)):
            raise
        print(f"autocompress: error: {describe_os_error(e, str(cfg.run_dir))}", file=sys.stderr, flush=True)
        sys.exit(2)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if _CTRL_C and not isinstance(e, SystemExit | GeneratorExit) and not os.environ.get("AUTOCOMPRESS_DEBUG"):
            interrupted()
        if (
            isinstance(e, SystemExit | GeneratorExit)
            or os.environ.get("AUTOCOMPRESS_DEBUG")
            or not disk_error(e, str(cfg.run_dir))
        ):
            raise
        print(f"autocompress: error: {describe_os_error(e, str(cfg.run_dir))}", file=sys.stderr, flush=True)
        sys.exit(2)


def one_line_log_file_errors() -> None:
    """A log file that cannot be written (a full disk) is said once, in one line, instead of logging's
    "--- Logging error ---" traceback at every message; the run goes on, logging to the console."""
    import logging

    from autocompress_nemo.rundir import describe_os_error

    for h in logging.getLogger().handlers:
        if not isinstance(h, logging.FileHandler) or getattr(h, "_one_line_errors", False):
            continue

        def handle_error(record: logging.LogRecord, h: logging.FileHandler = h) -> None:
            if getattr(h, "_said", False):
                return
            h._said = True  # type: ignore[attr-defined]
            err = sys.exc_info()[1]
            what = describe_os_error(err, h.baseFilename) if isinstance(err, OSError) else str(err)
            print(
                f"autocompress: warning: cannot write the log file: {what}; logging to the console only",
                file=sys.stderr,
            )

        h.handleError = handle_error  # type: ignore[method-assign]
        h._one_line_errors = True  # type: ignore[attr-defined]


def invocation_problems(cfg: DictConfig, overrides: Sequence[str] = ()) -> list[str]:
    """Problems of running ``cfg`` *here*: a Slurm cluster config (``cluster=slurm_2x8``) outside a Slurm
    job is submitted by ``autocompress-launch``, not run on this machine (``dry_run=true`` plans it here)."""
    import os

    cl = cfg.get("cluster") or {}
    if str(cl.get("kind", "local")) != "slurm" or cfg.get("dry_run") or os.environ.get("SLURM_JOB_ID"):
        return []
    name = cl.get("name") or "slurm"
    rest = " ".join(a for a in overrides if not a.startswith(("cluster=", "+cluster=")))
    return [
        f"cluster={name} is a Slurm cluster and this is not a Slurm job: Slurm configs go through the "
        f"launcher, which renders and submits the sbatch job — autocompress-launch cluster={name} {rest} "
        "(--render-only prints the script, --stage <stage> runs one stage); run here with cluster=local, "
        "or plan with dry_run=true"
    ]


def validate_here(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """``validate(cfg)`` and :func:`invocation_problems`, reported together (the invocation first)."""
    here = invocation_problems(cfg, overrides)
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(here + e.problems) from None
    if here:
        raise ConfigError(here)


def _job_name(task_fn: Callable[..., Any]) -> str:
    """``search`` for ``python -m autocompress_nemo.search`` (names the log file in the run dir)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = main_spec.name if main_spec is not None else task_fn.__module__
    parts = [p for p in module.split(".") if p not in ("__main__", "autocompress_nemo")]
    return parts[-1] if parts else task_fn.__name__


def _fail(e: ConfigError) -> None:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _first_lines(msg: str, n: int = 12) -> str:
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return "\n    ".join(lines[:n])

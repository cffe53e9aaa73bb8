"""The run directory's guards (DESIGN.md section 2, issue 19).

- **One run per directory**: ``<run_dir>/.lock`` holds the pid, host and command of the run that
  uses the directory. A second run refuses, naming that pid; a lock whose process is gone (same
  host) is taken over and said so. The lock is re-entrant within one process (the entry point
  takes it before Hydra writes anything; the pipeline takes it again).
- **Leftovers of killed stages** (``<artifact>.tmp-<pid>``, ``<artifact>.old-<pid>``,
  ``.<file>.tmp-<pid>``) are removed when a run starts: with the lock held no other run writes here.
- **Filesystem problems** (a ``run_dir`` that is a file, an unwritable or read-only parent, a full
  disk) are one line naming the path (:class:`RunDirError`, :func:`describe_os_error`).
- **The config record**: Hydra writes ``<run_dir>/.hydra/{config,overrides,hydra}.yaml`` for every
  accepted invocation; the previous record is moved to ``.hydra/history/<time>/`` first, so each
  invocation keeps one record and a rejected command (validated before Hydra starts) writes none.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = ".lock"
_LEFTOVER = re.compile(r"\.(tmp|old)-(\d+)$")
_HELD: dict[Path, int] = {}
"""Locks this process holds: run directory -> how many times taken (re-entrant)."""


class RunDirError(ValueError):
    """A run directory that cannot be used; the message names the path and the fix."""


# -- filesystem ------------------------------------------------------------------------------------
_FIX = {
    errno.ENOSPC: "free space on that disk, or give run_dir (cache_dir for the token cache) on another one",
    errno.EDQUOT: "free space in your quota, or give run_dir (cache_dir for the token cache) on another disk",
    errno.EACCES: "make it writable, or give a run_dir you can write to",
    errno.EPERM: "make it writable, or give a run_dir you can write to",
    errno.EROFS: "the file system is read-only: give run_dir on a writable one",
    errno.ENOTDIR: "a path component is a file: give run_dir=<a directory path>",
    errno.EEXIST: "a file is in the way: move it, or give another run_dir",
}


_NO_SPACE_TEXT = (
    "No space left",
    "Not enough free space",
    "code: 28",
    "StorageFull",
    "[Errno 28]",
    "file write failed",
)
_QUOTA_TEXT = ("Disk quota", "[Errno 122]")


def os_errors(e: BaseException) -> Iterator[BaseException]:
    """``e`` and every exception inside it: its causes and contexts, and the per-rank failures of a
    distributed checkpoint (torch's ``CheckpointException.failures``, Megatron's wrappers), once each."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [y for y in (x.__cause__, x.__context__) if y is not None]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for f in failures.values():
                inner = getattr(f, "exception", f)  # a _WrappedException holds the original
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += [a for a in getattr(x, "args", ()) if isinstance(a, BaseException)]


def _text_errno(msg: str) -> int:
    if any(t in msg for t in _QUOTA_TEXT):
        return errno.EDQUOT
    if any(t in msg for t in _NO_SPACE_TEXT):
        return errno.ENOSPC
    return 0


LOW_SPACE = 64 << 20
"""Free bytes below which a failed write (whose errno a library dropped) is taken for a full disk."""


def _failed_write(e: BaseException) -> bool:
    """``e`` holds a write that failed without saying why: an ``OSError`` without an errno, a distributed
    checkpoint's failure, a library's "error: <class 'OSError'>" (Megatron's checkpoint writer logs the
    errno and raises only the class)."""
    for x in os_errors(e):
        if isinstance(x, OSError) or type(x).__name__ in ("CheckpointException", "CheckpointingException"):
            return True
        if "OSError" in str(x) or "write failed" in str(x):
            return True
    return False


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing ancestor); None when unknown."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return None


def find_disk_error(e: BaseException, where: str | os.PathLike[str] | None = None) -> OSError | None:
    """The full-disk (or quota) ``OSError`` inside ``e`` (:func:`os_errors`), the one naming a path
    first; an ``OSError`` made from a library's text (numpy's "Not enough free space", torch's
    "file write failed") when none is raised as such; and, given ``where`` (the directory being
    written), a write that failed without its errno on a file system with less than ``LOW_SPACE``
    free. None when ``e`` is not about a full disk."""
    found: list[OSError] = []
    for x in os_errors(e):
        code = x.errno if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) else _text_errno(str(x))
        if not code:
            continue
        if isinstance(x, OSError) and x.errno == code:
            found.append(x)
        else:
            found.append(OSError(code, os.strerror(code), getattr(x, "filename", None)))
    named = [x for x in found if x.filename is not None]
    if named or found:
        return (named or found)[0]
    if where is not None and _failed_write(e):
        free = free_bytes(where)
        if free is not None and free < LOW_SPACE:
            return OSError(errno.ENOSPC, f"No space left on device ({free:,} bytes free)", str(where))
    return None


def describe_os_error(e: BaseException, where: str | os.PathLike[str] | None = None) -> str:
    """One line for a filesystem error: what, the path, the fix. A full disk hidden inside another
    exception (a distributed checkpoint's per-rank failures, a library's text) is found and named
    (:func:`find_disk_error`); ``where``: the path to name when the error carries none (the file or
    directory being written)."""
    err: OSError
    if isinstance(e, OSError) and e.errno:
        err = e
    else:
        found = find_disk_error(e, where)
        if found is None and not isinstance(e, OSError):
            first = (str(e).strip().splitlines() or [""])[0]
            return f"{type(e).__name__}: {first}" + (f" (writing {where})" if where is not None else "")
        err = found or e  # type: ignore[assignment]  # e is an OSError here
    e = err
    code = e.errno or 0
    name = errno.errorcode.get(code, "")
    path = e.filename if e.filename is not None else where
    what = (e.strerror or str(e)) if code else str(e)
    fix = _FIX.get(code, "")
    return f"{what}{f' ({name})' if name else ''}: {path if path is not None else '(path unknown)'}" + (
        f"; {fix}" if fix else ""
    )


def disk_error(e: BaseException, where: str | os.PathLike[str] | None = None) -> int:
    """The errno of a full disk (or quota) anywhere inside ``e`` (:func:`find_disk_error`: raised as
    ``OSError``, inside a distributed checkpoint's failures or a cause, or reported by a library as text
    — torch's ``PytorchStreamWriter ... file write failed``, safetensors' ``code: 28``, numpy's "Not
    enough free space"; given ``where``, a write that failed without its errno where less than
    ``LOW_SPACE`` is free); 0 otherwise."""
    found = find_disk_error(e, where)
    return int(found.errno or 0) if found is not None else 0


def usable_problems(run_dir: str | os.PathLike[str], field: str = "run_dir") -> list[str]:
    """Why ``run_dir`` cannot hold a run (empty when it can): it is a file, a component of its path
    is a file, or the directory (or its nearest existing ancestor) is not writable. ``field``: the
    setting that names the directory (``run_dir``, ``cache_dir``), named in the message and the fix."""
    p = Path(run_dir).expanduser().absolute()
    fix = f"give {field}=<a directory path>"
    if p.exists() and not p.is_dir():
        return [f"{field}={run_dir}: {p} is a file, not a directory; {fix}"]
    anc = p
    while not anc.exists():
        if anc.is_symlink():  # a loop or a dangling link: exists() is False, mkdir would fail
            return [f"{field}={run_dir}: {anc} is a symlink to nothing (a loop or a dangling link); {fix}"]
        anc = anc.parent
    if not anc.is_dir():
        return [f"{field}={run_dir}: {anc} is a file, so {p} cannot be created; {fix}"]
    if not os.access(anc, os.W_OK | os.X_OK):
        what = (
            f"the {'run' if field == 'run_dir' else 'cache'} directory"
            if anc == p
            else f"{anc} (where {p} would be created)"
        )
        return [f"{field}={run_dir}: {what} is not writable; make it writable, or give a {field} you can write to"]
    return []


def make_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``run_dir`` created (with its parents); a filesystem error becomes :class:`RunDirError`."""
    p = Path(run_dir).expanduser()
    problems = usable_problems(p)
    if problems:
        raise RunDirError(problems[0])
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"run_dir={run_dir}: {describe_os_error(e)}") from None
    return p.resolve()


# -- the lock ----------------------------------------------------------------------------------------
def launch_rank() -> int:
    """This process's rank in its job: torch.distributed's when it is up, else the launcher's
    (``RANK``: torchrun, the spawn helper; 0 for a single process). Rank 0 alone locks and cleans."""
    dist = sys.modules.get("torch.distributed")  # not imported: not initialized either
    with contextlib.suppress(Exception):  # a broken torch.distributed: the launcher's word
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def read_lock(run_dir: Path) -> dict | None:
    try:
        got = json.loads((Path(run_dir) / LOCK).read_text())
        return got if isinstance(got, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}  # unreadable: written by nothing we know, treated as stale


def acquire_lock(run_dir: str | os.PathLike[str], say: Callable[[str], None] = print) -> Path:
    """Take ``<run_dir>/.lock`` for this process, or raise :class:`RunDirError` naming the live
    holder. A lock of a process that is gone (on this host), or an unreadable one, is taken over."""
    d = Path(run_dir).resolve()
    if _HELD.get(d):
        _HELD[d] += 1
        return d / LOCK
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
    }
    tmp = d / f".lock.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(me))
        for _ in range(3):
            if _link(tmp, d / LOCK):  # atomic: fails when a lock exists
                break
            else:
                held = read_lock(d)
                if held is None:
                    continue  # released meanwhile
                pid, host = held.get("pid"), held.get("host")
                if pid == os.getpid() and host == me["host"]:
                    break  # ours (taken before a fork or by an earlier call)
                if isinstance(pid, int) and host == me["host"] and _alive(pid):
                    raise RunDirError(
                        f"run directory {d} is in use by another run (pid {pid}, started {held.get('started')}: "
                        f"{held.get('command', '?')}); wait for it to finish, or give another run_dir"
                    )
                if isinstance(pid, int) and host != me["host"]:
                    raise RunDirError(
                        f"run directory {d} is locked by pid {pid} on host {host} (started {held.get('started')}); "
                        f"if that run is gone, delete {d / LOCK}"
                    )
                who = f"pid {pid} (no such process)" if isinstance(pid, int) else "an unreadable lock"
                say(f"[run] taking over the stale lock of {who}: {d / LOCK}")
                (d / LOCK).unlink(missing_ok=True)
        else:
            raise RunDirError(f"could not take the lock {d / LOCK}; if no run uses {d}, delete it")
    except OSError as e:
        raise RunDirError(f"run_dir={d}: {describe_os_error(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    _HELD[d] = 1
    return d / LOCK


def _link(src: Path, dest: Path) -> bool:
    """Create ``dest`` holding ``src``'s text, atomically; False when ``dest`` exists."""
    try:
        os.link(src, dest)
    except FileExistsError:
        return False
    except OSError as e:  # a file system without hard links: exclusive create instead
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        try:
            fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(src.read_text())
    return True


def release_lock(run_dir: str | os.PathLike[str]) -> None:
    d = Path(run_dir).resolve()
    n = _HELD.get(d, 0)
    if n > 1:
        _HELD[d] = n - 1
        return
    _HELD.pop(d, None)
    held = read_lock(d)
    if held and held.get("pid") == os.getpid():
        (d / LOCK).unlink(missing_ok=True)


@contextmanager
def locked(run_dir: str | os.PathLike[str], say: Callable[[str], None] = print) -> Iterator[Path]:
    acquire_lock(run_dir, say)
    try:
        yield Path(run_dir).resolve()
    finally:
        release_lock(run_dir)


# -- leftovers ---------------------------------------------------------------------------------------
def clean_leftovers(run_dir: str | os.PathLike[str], say: Callable[[str], None] = print) -> list[Path]:
    """Remove what killed stages left (``*.tmp-<pid>``, ``*.old-<pid>``) anywhere in the run
    directory: those of processes that are gone (a live one may be another rank of this job).
    Call with the lock held."""
    d = Path(run_dir)
    gone: list[Path] = []
    for p in sorted(d.rglob("*"), key=lambda q: len(q.parts)):
        m = _LEFTOVER.search(p.name)
        if not m or _alive(int(m.group(2))) or any(g in p.parents for g in gone):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            continue
        gone.append(p)
    if gone:
        names = ", ".join(str(p.relative_to(d)) for p in gone[:5]) + (" ..." if len(gone) > 5 else "")
        say(f"[run] removed {len(gone)} leftover(s) of killed stages: {names}")
    return gone


# -- the config record -------------------------------------------------------------------------------
def archive_config_record(run_dir: str | os.PathLike[str], subdir: str = ".hydra") -> Path | None:
    """Move the previous invocation's ``<run_dir>/.hydra/*.yaml`` to ``.hydra/history/<time>/``
    (its config.yaml's modification time) before Hydra writes the new one."""
    rec = Path(run_dir) / subdir
    files = [f for f in rec.glob("*.yaml") if f.is_file()] if rec.is_dir() else []
    if not files:
        return None
    cfg = rec / "config.yaml"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((cfg if cfg.exists() else files[0]).stat().st_mtime))
    dest = rec / "history" / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = rec / "history" / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for f in files:
        os.replace(f, dest / f.name)
    return dest

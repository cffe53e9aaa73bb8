"""What the corpus *holds*: a content fingerprint of every file ``cfg.data`` reads.

Cache keys of stages that read ``data`` include it (``pipeline.Run.config_hash``), so rewriting
the files under ``data.paths`` reruns those stages even though the config did not change, and
touching a file without changing it does not. Each file is hashed (sha256 of its bytes); the digest
is kept in a small JSON cache — in the process and, given ``cache_file``, on disk
(``<run_dir>/.cache/data_hashes.json``) — keyed by what every way of replacing a file's bytes
changes: the device and **inode** and the **ctime** (status change time, which no program can set:
``cp -p``, ``touch -r``, ``rsync -a``, ``tar x`` restore the modification time, never the ctime; a
copy or a restore through a new file has a new inode), plus size and mtime. A digest taken within
``RACY_NS`` of the file's last change is not trusted later (a rewrite in the same clock tick keeps the
ctime), so such a file is hashed again on the next call, as git treats "racily clean" files.
``bench/bench_fingerprint.py`` measures the cost (a few GB: seconds once, then stat calls only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from autocompress_nemo.data.corpus import corpus_files
from autocompress_nemo.utils.artifacts import hash_obj, write_json_atomic

CACHE_VERSION = 2
RACY_NS = 2_000_000_000
"""A digest taken less than this after the file's last change (ctime) is not reused: a rewrite in
the same timestamp tick would leave the stat unchanged."""
HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files hashed at once when several changed."""
_MEMO: dict[str, dict[str, Any]] = {}


def stat_key(st: os.stat_result) -> list[int]:
    """``[device, inode, size, mtime_ns, ctime_ns]``: what changes whenever a file's bytes are replaced
    (the inode for a new file, the ctime for a rewrite in place, whatever the mtime is set back to)."""
    return [int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns)]


def sha256_of(path: str | os.PathLike[str]) -> str:
    """sha256 of the file's bytes (``hashlib.file_digest``: a large buffer, the GIL released)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _load(cache_file: Path | None) -> dict[str, Any]:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        got = json.loads(cache_file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # a damaged cache only costs re-hashing
    if not isinstance(got, dict) or got.get("version") != CACHE_VERSION or not isinstance(got.get("files"), dict):
        return {}  # an older cache (keyed by size and mtime only): re-hash once
    return got["files"]


def _trusted(entry: Any, key: list[int]) -> str | None:
    """The digest of a cache entry that still describes the file (same stat key, not taken racily)."""
    if not isinstance(entry, dict) or entry.get("stat") != key or not isinstance(entry.get("sha256"), str):
        return None
    if int(entry.get("hashed_at_ns", 0)) - key[4] < RACY_NS:
        return None  # hashed within the file's last change's tick: a same-tick rewrite would look the same
    return str(entry["sha256"])


def _hash_entry(path: str, key: list[int]) -> dict[str, Any]:
    """A fresh cache entry of ``path`` (stat before ``key``): its digest, the stat after hashing and when
    the hash was taken (0 when the file changed while it was read: never trusted)."""
    hashed_at = time.time_ns()
    digest = sha256_of(path)
    after = stat_key(os.stat(path))
    return {"stat": after, "sha256": digest, "hashed_at_ns": hashed_at if after == key else 0}


def file_digests(files: list[Path], cache_file: Path | None = None) -> dict[str, str]:
    """``{absolute path: sha256}`` of ``files``, re-hashing every file whose inode, ctime, size or
    mtime changed (see the module docstring); the files to hash are hashed ``HASH_THREADS`` at a time
    (hashlib releases the GIL while it reads and hashes)."""
    disk = _load(cache_file)
    entries: dict[str, dict[str, Any]] = {}
    todo: dict[str, list[int]] = {}
    for f in files:
        path = str(Path(f).resolve())
        key = stat_key(os.stat(path))
        if _trusted(_MEMO.get(path), key):
            entries[path] = _MEMO[path]
        elif _trusted(disk.get(path), key):
            entries[path] = disk[path]
        else:
            todo[path] = key
    if len(todo) > 1 and HASH_THREADS > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(HASH_THREADS, len(todo))) as pool:
            entries.update(zip(todo, pool.map(_hash_entry, todo, todo.values()), strict=True))
    else:
        entries.update({path: _hash_entry(path, key) for path, key in todo.items()})
    changed = False
    for path, entry in entries.items():
        _MEMO[path] = entry
        if disk.get(path) != entry:
            disk[path] = entry
            changed = True
    if changed and cache_file is not None:
        # the cache is an optimisation; a read-only run directory is reported elsewhere
        with contextlib.suppress(OSError):
            write_json_atomic(cache_file, {"version": CACHE_VERSION, "files": disk})
    return {path: str(entry["sha256"]) for path, entry in entries.items()}


def data_fingerprint(data: Any, cache_file: Path | None = None) -> str:
    """One hash of the content of every file ``data`` (``cfg.data``) reads, in corpus order.

    Paths enter only relative to what was given (a moved corpus with the same files keeps its
    fingerprint; ``data.paths`` itself is in the config section the key already holds)."""
    files = corpus_files(data)
    digests = file_digests(files, cache_file)
    return hash_obj([[f.name, digests[str(Path(f).resolve())]] for f in files])

"""What the corpus *holds*, cheaply: a content fingerprint of every file ``cfg.data`` reads.

Cache keys of stages that read ``data`` include it (``pipeline.Run.config_hash``), so rewriting
the files under ``data.paths`` reruns those stages even though the config did not change, and
touching a file without changing it does not. Each file is hashed once (sha256); the digest is
kept with the file's size and modification time (nanoseconds) in a small JSON cache — in the
process and, given ``cache_file``, on disk (``<run_dir>/.cache/data_hashes.json``) — and reused
while size and mtime stay the same.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from autocompress_nemo.data.corpus import corpus_files
from autocompress_nemo.utils.artifacts import hash_obj, sha256_file, write_json_atomic

_MEMO: dict[str, tuple[int, int, str]] = {}


def _load(cache_file: Path | None) -> dict[str, list[Any]]:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        got = json.loads(cache_file.read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}  # a damaged cache only costs re-hashing


def file_digests(files: list[Path], cache_file: Path | None = None) -> dict[str, str]:
    """``{absolute path: sha256}`` of ``files``, re-hashing only files whose size or mtime changed."""
    disk = _load(cache_file)
    out: dict[str, str] = {}
    changed = False
    for f in files:
        key = str(Path(f).resolve())
        st = os.stat(key)
        size, mtime = int(st.st_size), int(st.st_mtime_ns)
        hit = _MEMO.get(key) or tuple(disk.get(key) or ())
        if len(hit) == 3 and hit[0] == size and hit[1] == mtime:
            digest = str(hit[2])
        else:
            digest = sha256_file(key)
        _MEMO[key] = (size, mtime, digest)
        if disk.get(key) != [size, mtime, digest]:
            disk[key] = [size, mtime, digest]
            changed = True
        out[key] = digest
    if changed and cache_file is not None:
        # the cache is an optimisation; a read-only run directory is reported elsewhere
        with contextlib.suppress(OSError):
            write_json_atomic(cache_file, disk)
    return out


def data_fingerprint(data: Any, cache_file: Path | None = None) -> str:
    """One hash of the content of every file ``data`` (``cfg.data``) reads, in corpus order.

    Paths enter only relative to what was given (a moved corpus with the same files keeps its
    fingerprint; ``data.paths`` itself is in the config section the key already holds)."""
    files = corpus_files(data)
    digests = file_digests(files, cache_file)
    return hash_obj([[f.name, digests[str(Path(f).resolve())]] for f in files])

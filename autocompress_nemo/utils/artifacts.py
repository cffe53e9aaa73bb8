"""Artifacts: atomic writes and manifests with checksums (DESIGN.md section 2).

An artifact is a directory. It is written under ``<name>.tmp-<pid>`` and renamed to
``<name>`` only when complete, with ``manifest.json`` listing: stage, config hash, input
hashes, package versions, wall time and a sha256 per file. ``is_complete`` re-checks the
checksums, so a truncated or corrupted artifact is never taken as done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_VERSIONED = ("torch", "megatron-core", "transformers", "gguf", "llama_cpp_python", "hydra-core", "autocompress-nemo")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def hash_obj(obj: Any) -> str:
    """Stable hash of a JSON-able object (config sections, input descriptions)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def package_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write a single file atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True, default=str))


def read_manifest(artifact_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    p = Path(artifact_dir) / MANIFEST
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, OSError):
        return None


def is_complete(artifact_dir: str | os.PathLike[str], config_hash: str | None = None) -> bool:
    """True when the manifest exists, matches ``config_hash`` (if given) and every checksum holds."""
    d = Path(artifact_dir)
    m = read_manifest(d)
    if m is None:
        return False
    if config_hash is not None and m.get("config_hash") != config_hash:
        return False
    for rel, digest in m.get("files", {}).items():
        f = d / rel
        if not f.is_file() or sha256_file(f) != digest:
            return False
    return True


def verify_or_explain(artifact_dir: str | os.PathLike[str]) -> list[str]:
    """Problems found in an artifact (empty = intact). Used to report why a stage reruns."""
    d = Path(artifact_dir)
    m = read_manifest(d)
    if m is None:
        return [f"{d}: no readable {MANIFEST}"]
    bad = []
    for rel, digest in m.get("files", {}).items():
        f = d / rel
        if not f.is_file():
            bad.append(f"{f}: missing")
        elif sha256_file(f) != digest:
            bad.append(f"{f}: checksum mismatch (truncated or corrupted)")
    return bad


@contextlib.contextmanager
def artifact(
    final_dir: str | os.PathLike[str],
    *,
    stage: str,
    config_hash: str,
    inputs: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """Yield a temporary directory; on success write the manifest and rename it into place.

    On an exception the temporary directory is removed and nothing at ``final_dir`` changes.
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    t0 = time.time()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {
        str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "stage": stage,
        "config_hash": config_hash,
        "inputs": inputs or {},
        "versions": package_versions(),
        "wall_s": round(time.time() - t0, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        **(extra or {}),
    }
    write_json_atomic(tmp / MANIFEST, manifest)
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def set_aside(path: str | os.PathLike[str], why: str) -> Path:
    """Rename ``path`` (a file or directory) to ``<path>.<why>`` so that nothing reads it again,
    keeping it for inspection; an earlier copy set aside for the same reason is replaced (a
    checkpoint can be large: one set-aside copy per reason, not one per rerun). Returns the new path."""
    p = Path(path)
    dest = p.with_name(f"{p.name}.{why}")
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    elif dest.exists() or dest.is_symlink():
        dest.unlink()
    os.replace(p, dest)
    return dest

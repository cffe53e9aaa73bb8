"""The cost of the data fingerprint (``data/fingerprint.py``): content hashes, cached per file by
inode + ctime (+ size + mtime).

    python bench/bench_fingerprint.py                 # a 2 GB corpus in a temporary directory, and the stdlib
    python bench/bench_fingerprint.py --gb 4 --dir /scratch/fp

Prints one JSON object:

- ``corpus``: the corpus written (bytes, files) and, in seconds, ``cold`` (every file hashed: the first
  run on a corpus, or after every file changed), ``warm_disk_cache`` (a new process: the digests come
  from ``data_hashes.json``, one stat per file), ``warm_memo`` (the same process again), ``one_file_changed``
  (one file rewritten with its mtime restored, ``cp -p`` style: that file alone is hashed again); the
warm timings are the best of ``REPEATS``;
  ``hash_gb_per_s`` the hashing rate of the cold run;
- ``stdlib``: the same for the default corpus (``data=stdlib``, the standard library's sources);
- ``old_hash_loop_s``: the previous hashing loop (``sha256`` over 1 MB reads) on the same corpus, for
  comparison with ``hashlib.file_digest``.

Timings are wall time on whatever else the machine runs; the corpus is read from the page cache when
it fits in memory (a cold disk adds its read time, which every later stage pays too).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autocompress_nemo.data import fingerprint as fp  # noqa: E402
from autocompress_nemo.data.corpus import corpus_files  # noqa: E402

REPEATS = 3


def write_corpus(root: Path, total_bytes: int, file_bytes: int) -> list[Path]:
    """``total_bytes`` of text-like bytes in files of ``file_bytes`` (one random block, repeated with
    a per-file header so no two files are equal)."""
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20).hex().encode()[: 1 << 20]
    files = []
    for i in range(max(1, total_bytes // file_bytes)):
        p = root / f"part_{i:05d}.txt"
        with open(p, "wb") as f:
            f.write(f"file {i}\n".encode())
            for _ in range(file_bytes // len(block)):
                f.write(block)
        files.append(p)
    return files


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 3)


def measure(files: list[Path], cache: Path) -> dict[str, float]:
    fp._MEMO.clear()
    cache.unlink(missing_ok=True)
    cold = timed(lambda: fp.file_digests(files, cache))
    # a digest taken within RACY_NS of a file's last change is not trusted: wait past it and hash once
    # more, as a later run would find the files
    wait = max(0.0, fp.RACY_NS / 1e9 - (time.time() - max(f.stat().st_ctime for f in files)))
    time.sleep(wait + 0.1)
    fp._MEMO.clear()
    fp.file_digests(files, cache)
    warm_disk, warm_memo = [], []
    for _ in range(REPEATS):  # the best of a few: the machine is shared
        fp._MEMO.clear()
        warm_disk.append(timed(lambda: fp.file_digests(files, cache)))
        warm_memo.append(timed(lambda: fp.file_digests(files, cache)))
    return {"cold": cold, "warm_disk_cache": min(warm_disk), "warm_memo": min(warm_memo)}


def old_hash_loop(files: list[Path]) -> float:
    def run() -> None:
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while b := fh.read(1 << 20):
                    h.update(b)

    return timed(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="corpus size in GB (default 2)")
    ap.add_argument("--file-mb", type=int, default=16, help="size of each file in MB (default 16)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the corpus (default: a temporary dir)")
    a = ap.parse_args()
    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_fingerprint_"))
    try:
        files = write_corpus(root / "corpus", int(a.gb * (1 << 30)), a.file_mb << 20)
        size = sum(f.stat().st_size for f in files)
        res = measure(files, root / "data_hashes.json")
        # one file rewritten with the same size and its mtime restored (cp -p / rsync -a / tar x)
        victim = files[len(files) // 2]
        st = victim.stat()
        data = bytearray(victim.read_bytes())
        data[-2] = ord("x") if data[-2] != ord("x") else ord("y")
        victim.write_bytes(bytes(data))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        fp._MEMO.clear()
        res["one_file_changed"] = timed(lambda: fp.file_digests(files, root / "data_hashes.json"))
        res["hash_gb_per_s"] = round(size / (1 << 30) / max(res["cold"], 1e-9), 2)
        old = old_hash_loop(files)
        std_files = corpus_files({"kind": "stdlib"})
        std_size = sum(f.stat().st_size for f in std_files)
        std = measure(std_files, root / "stdlib_hashes.json")
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "fingerprint",
                "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                "corpus": {"bytes": size, "files": len(files), **res},
                "old_hash_loop_s": old,
                "stdlib": {"bytes": std_size, "files": len(std_files), **std},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

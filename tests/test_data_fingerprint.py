"""Data fingerprints cannot be fooled by timestamps (issue 39): a file's digest is reused only while
its inode and ctime (and size and mtime) are unchanged, so a same-size rewrite whose modification time
is restored — ``cp -p``, ``touch -r``, ``rsync -a``, ``tar x`` of a new version — is hashed again.

Before issue 39 the cache was keyed by size and mtime alone: the rewrite below kept the old digest,
and a stage that read the data reused a stale artifact with exit status 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from autocompress_nemo.data import fingerprint as fp


@pytest.fixture(autouse=True)
def _fresh_memo():
    fp._MEMO.clear()
    yield
    fp._MEMO.clear()


def _settled(*paths) -> None:
    """Wait until every file's last change is older than the racy window (as a later run finds them)."""
    newest = max(os.stat(p).st_ctime_ns for p in paths)
    time.sleep(max(0.0, (newest + fp.RACY_NS - time.time_ns()) / 1e9) + 0.05)


def _fingerprint(corpus, cache):
    return fp.data_fingerprint({"kind": "files", "paths": [str(corpus)]}, cache)


def _corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("the first version of a document\n" * 50)
    (d / "b.txt").write_text("another document, never changed\n" * 50)
    return d


def test_a_same_size_rewrite_with_its_mtime_restored_is_hashed_again(tmp_path) -> None:
    corpus, cache = _corpus(tmp_path), tmp_path / "run" / ".cache" / "data_hashes.json"
    cache.parent.mkdir(parents=True)
    a = corpus / "a.txt"
    _settled(a, corpus / "b.txt")
    before = _fingerprint(corpus, cache)
    assert _fingerprint(corpus, cache) == before  # cached: the same
    st = a.stat()
    new = a.read_text().replace("first", "other")  # same length
    assert len(new) == st.st_size
    a.write_text(new)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r: the old modification time
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    fp._MEMO.clear()  # a new process: only the disk cache
    assert _fingerprint(corpus, cache) != before


def test_cp_p_of_a_new_version_over_the_file_is_hashed_again(tmp_path) -> None:
    if shutil.which("cp") is None:
        pytest.skip("the cp command is not on PATH (the test copies with cp -p as a user does)")
    corpus, cache = _corpus(tmp_path), tmp_path / "data_hashes.json"
    a, new = corpus / "a.txt", tmp_path / "a_new.txt"
    new.write_text((corpus / "a.txt").read_text().replace("first", "fixed"))
    os.utime(new, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))  # the new version carries the old mtime
    _settled(a, corpus / "b.txt", new)
    before = _fingerprint(corpus, cache)
    subprocess.run(["cp", "-p", str(new), str(a)], check=True)  # same size, same mtime, in place
    assert a.stat().st_mtime_ns == new.stat().st_mtime_ns
    fp._MEMO.clear()
    assert _fingerprint(corpus, cache) != before
    assert _fingerprint(corpus, cache) == _fingerprint(corpus, cache)


def test_a_replaced_file_with_a_new_inode_is_hashed_again(tmp_path) -> None:
    """rsync -a / tar x: a new file renamed over the old one, same size and mtime."""
    corpus, cache = _corpus(tmp_path), tmp_path / "data_hashes.json"
    a = corpus / "a.txt"
    _settled(a, corpus / "b.txt")
    before = _fingerprint(corpus, cache)
    st = a.stat()
    tmp = corpus / ".a.txt.new"
    tmp.write_text(a.read_text().replace("first", "final"))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, a)
    fp._MEMO.clear()
    assert _fingerprint(corpus, cache) != before


def test_touching_without_changing_keeps_the_fingerprint_and_settled_files_are_not_rehashed(
    tmp_path, monkeypatch
) -> None:
    corpus, cache = _corpus(tmp_path), tmp_path / "data_hashes.json"
    _settled(*corpus.iterdir())
    before = _fingerprint(corpus, cache)
    hashed: list[str] = []
    real = fp.sha256_of
    monkeypatch.setattr(fp, "sha256_of", lambda p: hashed.append(os.path.basename(p)) or real(p))
    fp._MEMO.clear()
    assert _fingerprint(corpus, cache) == before and hashed == []  # from the disk cache: stat calls only
    os.utime(corpus / "a.txt")  # touched: new mtime and ctime, same bytes
    assert _fingerprint(corpus, cache) == before and hashed == ["a.txt"]


def test_a_digest_taken_in_the_same_tick_as_the_last_change_is_not_trusted(tmp_path, monkeypatch) -> None:
    """A rewrite within one timestamp tick of the hash keeps even the ctime: such a digest is taken
    again next time (git's "racily clean" rule)."""
    corpus, cache = _corpus(tmp_path), tmp_path / "data_hashes.json"
    _fingerprint(corpus, cache)  # the files were written just now: racy
    entry = json.loads(cache.read_text())["files"][str((corpus / "a.txt").resolve())]
    assert entry["hashed_at_ns"] - entry["stat"][4] < fp.RACY_NS
    hashed: list[str] = []
    real = fp.sha256_of
    monkeypatch.setattr(fp, "sha256_of", lambda p: hashed.append(os.path.basename(p)) or real(p))
    fp._MEMO.clear()
    _fingerprint(corpus, cache)
    assert sorted(hashed) == ["a.txt", "b.txt"]


def test_an_old_size_and_mtime_cache_is_not_trusted(tmp_path) -> None:
    corpus, cache = _corpus(tmp_path), tmp_path / "data_hashes.json"
    a = str((corpus / "a.txt").resolve())
    st = os.stat(a)
    cache.write_text(json.dumps({a: [st.st_size, st.st_mtime_ns, "0" * 64]}))  # the pre-issue-39 format
    digests = fp.file_digests([corpus / "a.txt"], cache)
    assert digests[a] == fp.sha256_of(a) != "0" * 64

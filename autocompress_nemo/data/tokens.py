"""Tokenization of documents into one token stream, with an EOS between documents, and a cache.

A tokenizer is anything with ``encode(text) -> list[int]`` (a ``tokenizers`` /
``transformers`` tokenizer, or a test's fake), or the ``transformers`` call interface
(``tok(texts)["input_ids"]``). Special tokens are not added per document; the stream is
``doc_0 EOS doc_1 EOS ...``.

The cache stores the stream as ``<key>.tokens.npy`` (uint32) and the document start offsets
as ``<key>.offsets.npy``; the key hashes the tokenizer's fingerprint, the EOS id and every
document's id and text, so a different tokenizer or corpus never reads a stale cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.data.corpus import Document

CACHE_VERSION = 1
_BATCH_DOCS = 64


def eos_id_of(tokenizer: Any) -> int:
    """The tokenizer's EOS id (``eos_token_id``, or ``token_to_id("</s>")``-style lookups)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"{type(tokenizer).__name__} has no eos_token_id; pass eos_id explicitly")
    return int(eos)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A string that changes when the tokenizer's mapping changes.

    ``tokenizer.fingerprint`` if it has one; else a hash of its vocabulary (``get_vocab()``)
    and class name.
    """
    fp = getattr(tokenizer, "fingerprint", None)
    if isinstance(fp, str) and fp:
        return fp
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        raise ValueError(
            f"cannot fingerprint {type(tokenizer).__name__} for the token cache: give it a `fingerprint` "
            "string attribute or a get_vocab() method"
        )
    vocab = sorted(get_vocab().items())
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    return h.hexdigest()


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens.

    ``transformers`` tokenizers are called batched (``tok(texts)["input_ids"]``, much faster);
    anything else through ``encode(text)`` (a ``tokenizers.Encoding`` result gives its ``.ids``).
    """
    if hasattr(tokenizer, "batch_encode_plus") or (callable(tokenizer) and not hasattr(tokenizer, "encode")):
        batch = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [list(map(int, ids)) for ids in batch]
    if not hasattr(tokenizer, "encode"):
        raise TypeError(f"{type(tokenizer).__name__} has neither encode(text) nor the transformers call interface")
    out = []
    for t in texts:
        try:
            r = tokenizer.encode(t, add_special_tokens=False)
        except TypeError:  # encode(text) without keyword arguments
            r = tokenizer.encode(t)
        out.append(list(map(int, r.ids if hasattr(r, "ids") else r)))
    return out


def tokenize(docs: Sequence[Document], tokenizer: Any, eos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 [N], offsets int64 [len(docs)]): ``doc_0 EOS doc_1 EOS ...``.

    ``offsets[i]`` is where document ``i`` starts in ``tokens``.
    """
    eos = eos_id_of(tokenizer) if eos_id is None else int(eos_id)
    ids: list[list[int]] = []
    for i in range(0, len(docs), _BATCH_DOCS):  # the HF call interface is faster batched
        ids += encode_documents(tokenizer, [d.text for d in docs[i : i + _BATCH_DOCS]])
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=np.uint32)
    for off, x in zip(offsets, ids, strict=True):
        tokens[off : off + len(x)] = x
        tokens[off + len(x)] = eos
    return tokens, offsets


def cache_key(docs: Sequence[Document], tokenizer: Any, eos_id: int) -> str:
    """sha256 over the cache version, tokenizer fingerprint, EOS id and each document (id, text)."""
    h = hashlib.sha256(f"v{CACHE_VERSION}|{tokenizer_fingerprint(tokenizer)}|eos={eos_id}".encode())
    for d in docs:
        h.update(d.doc_id.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(d.text.encode("utf-8", "surrogatepass")).digest())
    return h.hexdigest()[:32]


def _save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """``arr`` to ``path`` through a temporary name; on a failed write (a full disk: numpy says "Not
    enough free space to write N bytes" without an errno or a path) the partial file is removed and
    the error is an ``OSError`` naming ``path``, with its errno."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, arr)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is not None and e.errno is not None:
            raise
        from autocompress_nemo.rundir import disk_error

        code = e.errno or disk_error(e) or errno.EIO
        raise OSError(code, os.strerror(code) + f" ({e})", str(path)) from e


def cached_tokenize(
    docs: Sequence[Document], tokenizer: Any, cache_dir: str | Path | None, eos_id: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``tokenize`` through an npy cache in ``cache_dir`` (no cache when ``None``).

    A cache file that cannot be read, or whose sizes do not match, is recomputed.
    """
    eos = eos_id_of(tokenizer) if eos_id is None else int(eos_id)
    if cache_dir is None:
        return tokenize(docs, tokenizer, eos)
    cache = Path(cache_dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OSError(errno.ENOTDIR, "the token cache directory is a file", str(cache)) from None
    key = cache_key(docs, tokenizer, eos)
    tok_path, off_path = cache / f"{key}.tokens.npy", cache / f"{key}.offsets.npy"
    if tok_path.exists() and off_path.exists():
        try:
            tokens = np.load(tok_path, mmap_mode="r")
            offsets = np.load(off_path)
            if (
                len(offsets) == len(docs)
                and (len(docs) == 0 or offsets[-1] < len(tokens))
                and tokens.dtype == np.uint32
                and (len(tokens) == 0 or tokens[-1] == eos)
            ):
                return np.asarray(tokens), offsets
        except (OSError, ValueError):
            pass  # unreadable / truncated: recompute below
    tokens, offsets = tokenize(docs, tokenizer, eos)
    _save_npy_atomic(off_path, offsets)
    _save_npy_atomic(tok_path, tokens)
    return tokens, offsets

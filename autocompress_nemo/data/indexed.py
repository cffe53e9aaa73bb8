"""Megatron indexed datasets (``data.kind=megatron``): already tokenized, blended by weight.

``<prefix>.bin`` + ``<prefix>.idx`` as Megatron's ``preprocess_data.py`` writes them, read with
``megatron.core.datasets.indexed_dataset.IndexedDataset``, tokenized with the parent's tokenizer
(a token id outside its vocabulary is refused). One document per indexed document, id
``<prefix name>:<document index>`` (0-based); an end-of-document token is appended unless the
document already ends with one (``--append-eod``). ``data.blend=[w1, prefix1, w2, prefix2, ...]``
mixes several: ``w_i`` is prefix ``i``'s share of the tokens of each side of the split; the prefix
that runs out first bounds the total, so no document is repeated (the others' documents are taken in
the stable-hash order of their ids). ``data.paths=[prefix, ...]`` is the same with equal weights.
The held-out rule is every format's (``document.is_heldout``: a stable hash of the document id).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.data.document import DataError, Document, is_heldout, stable_fraction


def blend_of(data: Any) -> list[tuple[float, str]]:
    """``[(weight, prefix)]`` of ``data.blend`` (or ``data.paths``, weight 1 each); raises
    :class:`DataError` for a malformed blend."""
    get = data.get if hasattr(data, "get") else lambda k, d=None: getattr(data, k, d)
    blend = list(get("blend", []) or [])
    if not blend:
        return [(1.0, str(p)) for p in (get("paths", []) or [])]
    if len(blend) % 2:
        raise DataError(
            f"data.blend={blend} has an odd number of entries; give weight, prefix pairs: [w1,prefix1,w2,prefix2]"
        )
    out = []
    for w, prefix in zip(blend[0::2], blend[1::2], strict=True):
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise DataError(f"data.blend: weight {w!r} (before {prefix!r}) is not a number; [w1,prefix1,...]") from None
        if not weight > 0:
            raise DataError(f"data.blend: weight {w!r} of {prefix!r} must be positive")
        out.append((weight, str(prefix)))
    return out


def prefix_of(given: str) -> Path:
    """A dataset prefix with a trailing ``.bin`` / ``.idx`` removed."""
    p = Path(given).expanduser()
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def indexed_files(data: Any) -> list[Path]:
    """The ``.bin`` / ``.idx`` files of the blend that exist (for the data fingerprint)."""
    try:
        blend = blend_of(data)
    except DataError:
        return []
    files = [Path(f"{prefix_of(p)}{s}") for _, p in blend for s in (".idx", ".bin")]
    return [f for f in files if f.is_file()]


def indexed_documents(given: str, vocab: int | None = None) -> list[tuple[str, np.ndarray]]:
    """``[(doc id, tokens)]`` of one indexed dataset, in document order."""
    prefix = prefix_of(given)
    for suffix in (".idx", ".bin"):
        if not Path(f"{prefix}{suffix}").is_file():
            raise DataError(
                f"data.blend: {prefix}{suffix} does not exist; give the prefix preprocess_data.py wrote "
                f"({prefix.name}.bin and {prefix.name}.idx), without the suffix"
            )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(str(prefix), mmap=True)
    except Exception as e:  # noqa: BLE001 - numpy / struct / assertion errors of a damaged index
        raise DataError(f"data.blend: {prefix}.idx / .bin is not a readable indexed dataset ({e})") from None
    bounds = ds.document_indices
    out = []
    for j in range(len(bounds) - 1):
        parts = [np.asarray(ds[s]) for s in range(int(bounds[j]), int(bounds[j + 1]))]
        toks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if vocab and len(toks) and int(toks.max()) >= vocab:
            raise DataError(
                f"data.blend: {prefix} document {j} holds token id {int(toks.max())}, outside the parent's "
                f"vocabulary of {vocab}: it was tokenized with another tokenizer; tokenize it with the parent's"
            )
        out.append((f"{prefix.name}:{j}", toks))
    if not out or not any(len(t) for _, t in out):
        raise DataError(f"data.blend: {prefix} holds no tokens; give a non-empty indexed dataset")
    return out


def _with_eos(toks: np.ndarray, eos: int) -> np.ndarray:
    return toks if len(toks) and int(toks[-1]) == eos else np.append(toks, eos)


def _blend_side(sources: list[tuple[float, list[tuple[str, np.ndarray]]]]) -> list[tuple[str, np.ndarray]]:
    """Documents of one side: each source's share of the tokens is its weight (see the module doc)."""
    total_w = sum(w for w, _ in sources)
    sizes = [sum(len(t) for _, t in docs) for _, docs in sources]
    scale = min(n / (w / total_w) for (w, _), n in zip(sources, sizes, strict=True))
    out: list[tuple[str, np.ndarray]] = []
    for (w, docs), n in zip(sources, sizes, strict=True):
        quota = w / total_w * scale
        if quota >= n:
            out += docs
            continue
        taken, count = [], 0
        for d in sorted(docs, key=lambda d: stable_fraction("blend:" + d[0])):
            if count >= quota:
                break
            taken.append(d)
            count += len(d[1])
        order = {doc_id: i for i, (doc_id, _) in enumerate(docs)}
        out += sorted(taken, key=lambda d: order[d[0]])
    return out


def _stream(docs: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(t) for _, t in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.concatenate([t for _, t in docs]).astype(np.uint32) if docs else np.zeros(0, np.uint32)
    return tokens, offsets


def indexed_corpus(
    data: Any, eos: int, vocab: int | None = None
) -> tuple[list[Document], list[Document], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train docs, held-out docs, train tokens, held-out tokens, train offsets, held-out offsets)``
    of ``data.kind=megatron`` (documents carry their id and no text: the data is already tokens)."""
    get = data.get if hasattr(data, "get") else lambda k, d=None: getattr(data, k, d)
    fraction = float(get("holdout_fraction", 0.05))
    named = set(get("heldout_files", []) or [])
    blend = blend_of(data)
    if not blend:
        raise DataError("data.kind=megatron needs data.blend=[w1,prefix1,...] (or data.paths=[prefix])")
    train_src, held_src = [], []
    for w, prefix in blend:
        docs = [(i, _with_eos(t, eos)) for i, t in indexed_documents(prefix, vocab)]
        train_src.append((w, [d for d in docs if not is_heldout(d[0], fraction, named)]))
        held_src.append((w, [d for d in docs if is_heldout(d[0], fraction, named)]))
    n_train, n_held = sum(len(d) for _, d in train_src), sum(len(d) for _, d in held_src)
    if not n_train or not n_held:
        raise DataError(
            f"the split of {n_train + n_held} indexed documents left {n_train} for training and {n_held} held out; "
            "change data.holdout_fraction or data.heldout_files"
        )
    sides = []
    for src in (train_src, held_src):
        kept = _blend_side([(w, d) for w, d in src if d])
        sides.append(([Document(i, "") for i, _ in kept], *_stream(kept)))
    (td, tt, to), (hd, ht, ho) = sides
    return td, hd, tt, ht, to, ho

"""Tokenized text: documents -> deterministic split -> token streams (cached) -> packed batches.

    from autocompress_nemo.data import build_corpus
    corpus = build_corpus(cfg.data, tokenizer, cache_dir="runs/.cache/tokens")
    train = corpus.train(seq_len=256)         # PackedDataset over calibration/distillation text
    for batch in train.batches(batch_size=4, seed=cfg.data.seed, start_step=resume_step): ...
    held = corpus.heldout(seq_len=256)        # held-out modules, for perplexity

The embedded default corpus is the Python standard library's own source (``data=stdlib``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.data.corpus import (
    DataError,
    Document,
    file_documents,
    is_heldout,
    load_documents,
    split_documents,
    stdlib_documents,
    stdlib_files,
)
from autocompress_nemo.data.packing import Batch, PackedDataset
from autocompress_nemo.data.tokens import cached_tokenize, eos_id_of, tokenize, tokenizer_fingerprint

__all__ = [
    "Batch",
    "Corpus",
    "DataError",
    "Document",
    "PackedDataset",
    "build_corpus",
    "cached_tokenize",
    "file_documents",
    "is_heldout",
    "load_documents",
    "split_documents",
    "stdlib_documents",
    "stdlib_files",
    "tokenize",
    "tokenizer_fingerprint",
]


@dataclass(frozen=True)
class Corpus:
    train_docs: list[Document]
    heldout_docs: list[Document]
    train_tokens: np.ndarray
    heldout_tokens: np.ndarray
    train_offsets: np.ndarray
    heldout_offsets: np.ndarray

    def train(self, seq_len: int) -> PackedDataset:
        return PackedDataset(_enough(self.train_tokens, seq_len, "training", len(self.train_docs)), seq_len)

    def heldout(self, seq_len: int) -> PackedDataset:
        return PackedDataset(_enough(self.heldout_tokens, seq_len, "held-out", len(self.heldout_docs)), seq_len)

    def summary(self) -> dict[str, Any]:
        return {
            "train_documents": len(self.train_docs),
            "heldout_documents": len(self.heldout_docs),
            "train_tokens": int(len(self.train_tokens)),
            "heldout_tokens": int(len(self.heldout_tokens)),
            "heldout_ids": [d.doc_id for d in self.heldout_docs],
        }


def _enough(tokens: np.ndarray, seq_len: int, side: str, docs: int) -> np.ndarray:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {side} text ({docs} documents) holds {len(tokens)} tokens, fewer than one sequence of "
            f"seq_len={seq_len} (+1 for the shifted labels); give more text, or shorten the sequences"
        )
    return tokens


def _get(c: Any, key: str, default: Any = None) -> Any:
    return c.get(key, default) if isinstance(c, dict) or hasattr(c, "get") else getattr(c, key, default)


def build_corpus(data: Any, tokenizer: Any, cache_dir: str | Path | None = None, eos_id: int | None = None) -> Corpus:
    """Load ``cfg.data``'s documents, split them, and tokenize both parts (through the cache).
    ``data.kind=megatron``: already tokens (``indexed.py``), checked against the tokenizer's vocabulary."""
    if _get(data, "kind") == "megatron":
        from autocompress_nemo.data.indexed import indexed_corpus

        eos = eos_id_of(tokenizer) if eos_id is None else int(eos_id)
        return Corpus(*indexed_corpus(data, eos, _vocab_size(tokenizer)))
    docs = load_documents(data)
    train, held = split_documents(
        docs, float(_get(data, "holdout_fraction", 0.05)), list(_get(data, "heldout_files", []) or [])
    )
    tt, to = cached_tokenize(train, tokenizer, cache_dir, eos_id)
    ht, ho = cached_tokenize(held, tokenizer, cache_dir, eos_id)
    return Corpus(train, held, tt, ht, to, ho)


def _vocab_size(tokenizer: Any) -> int | None:
    """The tokenizer's vocabulary size (``len(tok)``, or a test tokenizer's ``vocab``), if it has one."""
    n = getattr(tokenizer, "vocab", None)
    if isinstance(n, int):
        return n
    try:
        return len(tokenizer)
    except TypeError:
        return None

"""A document, the data error, and the held-out rule every data format shares.

A document is ``(doc_id, text)``. Whether it is held out for evaluation is decided by its id alone
(:func:`is_heldout`: named explicitly in ``data.heldout_files``, or
``sha256(id)[:8] / 2**32 < data.holdout_fraction``), so the split is the same on every machine, for
every seed, and does not move when other documents are added or removed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable relative name: decides order and the held-out split."""
    text: str


class DataError(ValueError):
    """Data that cannot be read; the message names the file and the fix."""


def stable_fraction(doc_id: str) -> float:
    """A number in [0, 1) from the document id alone: ``sha256(id)[:8] / 2**32``."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) / 2**32


def is_heldout(doc_id: str, fraction: float, named: Iterable[str] = ()) -> bool:
    """Held out when named explicitly or when ``stable_fraction(id) < fraction``."""
    return doc_id in set(named) or stable_fraction(doc_id) < fraction

"""Text decoding that never guesses silently.

- A file is read as ``data.encoding`` (UTF-8 unless set), strictly: one byte that is not valid in
  that encoding refuses the file (:class:`~autocompress_nemo.data.document.DataError`), naming the
  file, the byte offset and the encoding the bytes most likely are (charset-normalizer's detection,
  :func:`likely_encoding`), with the setting that reads it as that (``data.encoding=<codec>``) and
  the command that converts it (``iconv``).
- A byte-order mark is definitive: UTF-8, UTF-16 and UTF-32 files that start with one are decoded as
  what it says (the mark removed), whatever ``data.encoding`` is.
- Bytes that no encoding reads as text (random data, a compressed file) are refused as such.
- A Python source whose first lines declare its encoding (PEP 263 ``# -*- coding: ... -*-``) is read
  in the declared encoding: a declaration is not a guess.
"""

from __future__ import annotations

import codecs
import io
import tokenize
from pathlib import Path

from autocompress_nemo.data.document import DataError

DEFAULT_ENCODING = "utf-8"
DETECT_BYTES = 1 << 20
"""Bytes of a refused file charset-normalizer looks at (around the first bad byte)."""
_BOMS = (  # longest first: the UTF-32-LE mark starts with the UTF-16-LE one
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_WIDE = ("utf_16", "utf_32")


def bom_encoding(head: bytes) -> str | None:
    """The codec a byte-order mark at the start of ``head`` names (``utf-8-sig``, ``utf-16``,
    ``utf-32``), or None."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    return None


def wide_encoding(encoding: str | None) -> bool:
    """An encoding whose text holds NUL bytes (UTF-16 / UTF-32): NULs are not a sign of binary data."""
    if not encoding:
        return False
    try:
        name = codecs.lookup(encoding).name.replace("-", "_")
    except LookupError:
        return False
    return name.startswith(_WIDE)


def encoding_problem(encoding: str) -> str | None:
    """Why ``data.encoding`` is not a text codec Python knows (None when it is)."""
    try:
        info = codecs.lookup(encoding)
    except LookupError:
        return (
            f"data.encoding={encoding!r} is not an encoding Python knows; give a codec name such as "
            "utf-8, cp1252, latin-1, utf-16 or shift_jis"
        )
    if not getattr(info, "_is_text_encoding", True):
        return (
            f"data.encoding={encoding!r} is not a text encoding (it is {info.name}); give one such as utf-8 or cp1252"
        )
    return None


_PREFERRED = (
    "utf_8",
    "cp1252",
    "latin_1",
    "utf_16_le",
    "utf_16_be",
    "utf_32_le",
    "utf_32_be",
    "cp1251",
    "shift_jis",
    "gb18030",
)
"""Among code pages that decode the bytes to the *same* text (charset-normalizer's
``could_be_from_charset``), the name to give: the most common one."""


def likely_encodings(data: bytes, n: int = 3) -> list[str]:
    """The encodings ``data`` most likely is, best first, by charset-normalizer (Python codec names
    such as ``cp1252``, ``utf_16_le``); empty when nothing reads it as coherent text (random bytes,
    compressed data). A sample it finds too incoherent at its default threshold is tried once more at
    a looser one (real text with many punctuation bytes), before it is called not text."""
    from charset_normalizer import from_bytes

    sample = data[:DETECT_BYTES]
    results = list(from_bytes(sample) or from_bytes(sample, threshold=0.5))
    if results:  # a tie in charset-normalizer's own scores is given to the more common code page
        top = (results[0].chaos, results[0].coherence)
        tied = [m for m in results if (m.chaos, m.coherence) == top]
        rank = {p: i for i, p in enumerate(_PREFERRED)}
        tied.sort(key=lambda m: min(rank.get(str(e), len(rank)) for e in [m.encoding, *m.could_be_from_charset]))
        results = tied + [m for m in results if m not in tied]
    out: list[str] = []
    for match in results:
        same_text = [str(match.encoding), *map(str, match.could_be_from_charset)]
        name = next((p for p in _PREFERRED if p in same_text), str(match.encoding))
        if name not in out:
            out.append(name)
    return out[:n]


def likely_encoding(data: bytes) -> str | None:
    """The first of :func:`likely_encodings`, or None."""
    found = likely_encodings(data, 1)
    return found[0] if found else None


def _declared(data: bytes) -> str | None:
    """A Python source's PEP 263 declaration (None when it declares nothing, or nothing readable)."""
    try:
        enc, lines = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        return None
    return enc if lines and b"coding" in b"".join(lines) else None


def _sample(data: bytes, at: int) -> bytes:
    """Up to ``DETECT_BYTES`` of ``data`` around offset ``at`` (the detector's sample)."""
    start = max(0, min(at - DETECT_BYTES // 2, len(data) - DETECT_BYTES))
    return data[start : start + DETECT_BYTES]


def refusal(path: Path | str, data: bytes, err: UnicodeDecodeError, encoding: str) -> str:
    """The one line that refuses ``path``: the byte offset, the bytes, the likely encoding and the fix."""
    bad = " ".join(f"0x{b:02x}" for b in data[err.start : min(err.end, err.start + 4)])
    name = codecs.lookup(encoding).name
    guesses = [g for g in likely_encodings(_sample(data, err.start)) if codecs.lookup(g).name != name]
    head = f"data.paths: {path} is not {name} text: byte {err.start:,} ({bad}) {err.reason}"
    if not guesses:
        return (
            f"{head}, and charset-normalizer finds no encoding that reads it as text (random or binary data?); "
            "remove it from data.paths"
        )
    guess, others = guesses[0], guesses[1:]
    return (
        f"{head}; it looks like {guess} (charset-normalizer"
        + (f"; also possible: {', '.join(others)}" if others else "")
        + f"): set data.encoding={guess} to read it as that, "
        f"or convert it to UTF-8 (iconv -f {iconv_name(guess)} -t UTF-8 {path})"
    )


def iconv_name(encoding: str) -> str:
    """iconv's name of a Python codec (``utf-16-le`` -> ``UTF-16LE``, ``cp1252`` -> ``CP1252``)."""
    name = codecs.lookup(encoding).name.upper().replace("_", "-")
    return name[:-3] + name[-2:] if name.endswith(("-LE", "-BE")) else name


def decode_text(data: bytes, path: Path | str, encoding: str | None = None) -> str:
    """``data`` (the bytes of ``path``) as text: its byte-order mark's encoding, else ``encoding``
    (UTF-8 when None), strictly; a Python source's declared encoding where UTF-8 fails. Raises
    :class:`DataError` naming the file, the byte offset and the likely encoding."""
    enc = encoding or DEFAULT_ENCODING
    bom = bom_encoding(data[:4])
    if bom is not None:
        enc = bom
    try:
        return data.decode(enc)
    except UnicodeDecodeError as e:
        if bom is None and Path(str(path)).suffix == ".py" and (declared := _declared(data)) not in (None, enc):
            try:
                return data.decode(declared)
            except UnicodeDecodeError:
                pass
        raise DataError(refusal(path, data, e, enc)) from None


def read_text(path: Path, encoding: str | None = None) -> str:
    """The text of the file ``path`` (:func:`decode_text`)."""
    return decode_text(Path(path).read_bytes(), path, encoding)


def check_text(path: Path, encoding: str | None = None, limit: int | None = None) -> str | None:
    """Why ``path`` (its first ``limit`` bytes; all when None) does not decode, or None. Cheap: an
    incremental strict decoder, no document is built."""
    with open(path, "rb") as f:
        data = f.read() if limit is None else f.read(limit)
    whole = limit is None or len(data) < limit
    enc = bom_encoding(data[:4]) or encoding or DEFAULT_ENCODING
    try:
        codecs.getincrementaldecoder(enc)("strict").decode(data, final=whole)
    except UnicodeDecodeError as e:
        if bom_encoding(data[:4]) is None and Path(path).suffix == ".py" and _declared(data) not in (None, enc):
            return None  # a declared encoding: read (and checked) when the documents are loaded
        return refusal(path, data, e, enc)
    return None


def wide_without_bom(head: bytes) -> str | None:
    """``utf_16_le`` (etc.) when ``head`` (bytes with NULs, no byte-order mark) is UTF-16 / UTF-32 text
    by charset-normalizer, else None."""
    guess = likely_encoding(head)
    return guess if guess is not None and wide_encoding(guess) else None

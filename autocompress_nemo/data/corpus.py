"""Documents: the embedded stdlib corpus, user files, and the deterministic held-out split.

A document is one source file, one text file, one line of a JSONL file, or one row of a Parquet
file or saved dataset (``records.py``). Its ``doc_id`` is a stable relative name
(``json/decoder.py``, ``corpus.jsonl:17``, ``corpus.parquet:17``, ``my_dataset:17``): it decides
the order of the corpus (sorted) and whether the document is held out (``document.is_heldout``: a
stable hash of the id, plus an explicit list), so the split is the same on every machine and
independent of the seed. (The same texts in another container have other ids, hence another, equally
fixed, split.) Already-tokenized Megatron indexed datasets are ``indexed.py``.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from autocompress_nemo.data.document import DataError, Document, is_heldout, stable_fraction
from autocompress_nemo.data.encoding import bom_encoding, iconv_name, read_text, wide_encoding, wide_without_bom

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".parquet")
"""Suffixes read under a ``data.paths`` directory (``.parquet``: rows, see ``records.py``)."""
BINARY_FORMATS = (".parquet",)
"""Suffixes that are binary by design (not checked for NUL bytes)."""
BINARY_PROBE = 1 << 16
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}
)
"""Path components that remove a stdlib file: installed packages, test suites, IDLE."""


def stdlib_dir() -> Path:
    """The running Python's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``.py`` of the standard library except site-packages, test suites and idlelib,
    sorted by relative path (the same list on every machine with the same Python)."""
    root = root or stdlib_dir()
    files = [
        p
        for p in root.rglob("*.py")
        if not STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path, encoding: str | None = None) -> str:
    """Strictly decoded text (``encoding.decode_text``): a byte-order mark's encoding, else
    ``encoding`` (UTF-8); a file that is not valid in it is refused by name, offset and likely encoding."""
    return read_text(path, encoding)


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """The embedded default corpus: one document per stdlib source file (UTF-8, PEP 3120)."""
    root = root or stdlib_dir()
    return [Document(p.relative_to(root).as_posix(), _read_text(p)) for p in stdlib_files(root)]


def listed_files(base: Path) -> list[Path]:
    """The files a ``data.paths`` entry stands for: itself, the files of a saved dataset, or (a
    directory) every text file under it (``TEXT_SUFFIXES``), sorted by relative path."""
    from autocompress_nemo.data.records import is_saved_dataset

    if base.is_file():
        return [base]
    if is_saved_dataset(base):
        return sorted(p for p in base.iterdir() if p.is_file())
    return sorted(
        (p for p in base.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
        key=lambda p: p.relative_to(base).as_posix(),
    )


def corpus_files(data: object) -> list[Path]:
    """Every file the documents of ``cfg.data`` are read from (kind ``stdlib`` or ``files``; a
    path that does not exist is left out: loading the documents names it)."""
    kind = getattr(data, "kind", None) if not isinstance(data, dict) else data.get("kind")
    get = data.get if isinstance(data, dict) else lambda k, d=None: getattr(data, k, d)
    if kind == "stdlib":
        return stdlib_files()
    if kind == "megatron":
        from autocompress_nemo.data.indexed import indexed_files

        return indexed_files(data)
    out: list[Path] = []
    for given in list(get("paths", []) or []):
        base = Path(str(given)).expanduser()
        if base.exists():
            out += listed_files(base)
    return out


def file_documents(
    paths: Sequence[str | Path], jsonl_field: str = "text", encoding: str | None = None
) -> list[Document]:
    """Documents from files and directories (recursively: .txt .md .rst .py .jsonl .parquet), and
    from directories written by ``datasets.Dataset.save_to_disk``.

    A ``.jsonl`` file gives one document per non-empty line, its text under ``jsonl_field``; a
    ``.parquet`` file or a saved dataset one per row, its text in the column ``jsonl_field``.
    Ids are relative to the directory given (a file given directly keeps its name). A text file
    with NUL bytes (binary), text that is not valid in ``encoding`` (UTF-8 when None; a byte-order
    mark decides for UTF-8/16/32), and an empty file given directly are refused (:class:`DataError`).
    """
    from autocompress_nemo.data.records import dataset_documents, is_saved_dataset, parquet_documents

    docs: list[Document] = []
    for given in paths:
        base = Path(given).expanduser()
        if not base.exists():
            raise DataError(missing_path_message(base, "data.paths"))
        if is_saved_dataset(base):
            docs += dataset_documents(base, base.name, jsonl_field)
            continue
        if base.is_file() and base.stat().st_size == 0:
            raise DataError(f"data path {base} is empty (0 bytes); give a file with text")
        files, root = listed_files(base), (base.parent if base.is_file() else base)
        for f in files:
            rel = f.relative_to(root).as_posix() if base.is_dir() else f.name
            if f.suffix == ".parquet":
                docs += parquet_documents(f, rel, jsonl_field)
                continue
            if is_binary(f, encoding):
                raise DataError(binary_message(f))
            if f.suffix == ".jsonl":
                docs += _jsonl_documents(f, rel, jsonl_field, encoding)
            else:
                docs.append(Document(rel, _read_text(f, encoding)))
    if not docs:
        raise DataError(f"no text documents found under {list(map(str, paths))} (suffixes: {', '.join(TEXT_SUFFIXES)})")
    return sorted(docs, key=lambda d: d.doc_id)


def is_binary(path: Path, encoding: str | None = None) -> bool:
    """NUL bytes in the first 64 KB (a text format that holds them is not text) — unless the file
    starts with a UTF-16 / UTF-32 byte-order mark or ``encoding`` is UTF-16 / UTF-32, whose text
    holds NULs."""
    with open(path, "rb") as f:
        head = f.read(BINARY_PROBE)
    if bom_encoding(head[:4]) in ("utf-16", "utf-32") or wide_encoding(encoding):
        return False
    return b"\0" in head


def binary_message(path: Path) -> str:
    """Why ``path`` (NUL bytes, no UTF-16/32 byte-order mark) is refused, and the fix: UTF-16 / UTF-32
    text without a byte-order mark is named as such (read it with ``data.encoding``, or convert it)."""
    if path.suffix in (".bin", ".idx"):
        return (
            f"data.paths: {path} is binary, not text (NUL bytes in its first 64 KB); it looks like a Megatron "
            "indexed dataset: use data=megatron 'data.blend=[1.0,<prefix>]', or remove it from data.paths"
        )
    with open(path, "rb") as f:
        wide = wide_without_bom(f.read(BINARY_PROBE))
    if wide is not None:
        return (
            f"data.paths: {path} is {wide} text without a byte-order mark (NUL bytes between its characters); "
            f"set data.encoding={wide} to read it, or convert it to UTF-8 "
            f"(iconv -f {iconv_name(wide)} -t UTF-8 {path})"
        )
    return f"data.paths: {path} is binary, not text (NUL bytes in its first 64 KB); remove it from data.paths"


def missing_path_message(path: Path, where: str) -> str:
    """``<where>: <path> does not exist`` — or, for a symlink that resolves to nothing, what it points
    to: a symlink loop, or a dangling link."""
    import errno
    import os

    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (
                f"{where}: {path} is a symlink loop ({_link_chain(path)}); point the link at a file or "
                f"directory, or fix {where}"
            )
        if path.is_symlink():
            return f"{where}: {path} is a symlink to {os.readlink(path)}, which does not exist; fix the link or {where}"
    return f"{where}: {path} does not exist; fix {where}"


def _link_chain(path: Path, limit: int = 6) -> str:
    """``a -> b -> a``: the links a symlink loop goes through (at most ``limit``)."""
    import os

    seen, cur, chain = set(), Path(path), [str(path)]
    while cur.is_symlink() and len(chain) <= limit:
        target = Path(os.readlink(cur))
        cur = target if target.is_absolute() else cur.parent / target
        chain.append(str(target))
        key = os.path.normpath(str(cur.absolute()))
        if key in seen:
            break
        seen.add(key)
    return " -> ".join(chain)


def _jsonl_documents(path: Path, rel: str, key: str, encoding: str | None = None) -> list[Document]:
    out = []
    for i, line in enumerate(_read_text(path, encoding).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise DataError(f"{path}:{i}: no string field {key!r}; set data.jsonl_field to the text's key")
        out.append(Document(f"{rel}:{i}", obj[key]))
    return out


def split_documents(
    docs: Sequence[Document], holdout_fraction: float, heldout_ids: Sequence[str] = ()
) -> tuple[list[Document], list[Document]]:
    """(calibration/distillation documents, held-out evaluation documents), order kept."""
    named = set(heldout_ids)
    missing = sorted(named - {d.doc_id for d in docs})
    if missing:
        raise DataError(f"data.heldout_files not in the corpus: {missing}")
    train = [d for d in docs if not is_heldout(d.doc_id, holdout_fraction, named)]
    held = [d for d in docs if is_heldout(d.doc_id, holdout_fraction, named)]
    if len(docs) == 1 and not (train and held):
        raise DataError(
            f"the corpus is one document ({docs[0].doc_id}): a text file is one document, and one document "
            "cannot be split into training and held-out text; give two or more files (one held out with "
            "data.heldout_files=[<name>]), or a JSONL file with one document per line"
        )
    if not train or not held:
        raise DataError(
            f"the split of {len(docs)} documents left {len(train)} for training and {len(held)} held out; "
            "change data.holdout_fraction or data.heldout_files"
        )
    return train, held


def limit_documents(docs: Sequence[Document], max_documents: int, keep: Iterable[str] = ()) -> list[Document]:
    """At most ``max_documents`` (0 = all), chosen by the stable hash (not alphabetically, which
    would keep only one corner of the corpus); ids in ``keep`` (the named held-out files) are
    always kept. The result stays sorted by id."""
    if max_documents <= 0 or max_documents >= len(docs):
        return list(docs)
    named = set(keep)
    kept = [d for d in docs if d.doc_id in named]
    others = sorted(
        (d for d in docs if d.doc_id not in named), key=lambda d: (stable_fraction("limit:" + d.doc_id), d.doc_id)
    )
    return sorted(kept + others[: max(0, max_documents - len(kept))], key=lambda d: d.doc_id)


def load_documents(data: object) -> list[Document]:
    """The documents of ``cfg.data`` (kind ``stdlib`` or ``files``), sorted by id."""
    kind = getattr(data, "kind", None) if not isinstance(data, dict) else data.get("kind")
    get = data.get if isinstance(data, dict) else lambda k, d=None: getattr(data, k, d)
    if kind == "stdlib":
        docs = stdlib_documents()
    elif kind == "files":
        docs = file_documents(
            list(get("paths", []) or []), str(get("jsonl_field", "text")), str(get("encoding", "") or "") or None
        )
    else:
        raise DataError(f"data.kind={kind!r} has no text documents; use stdlib or files (megatron: build_corpus)")
    return limit_documents(docs, int(get("max_documents", 0) or 0), list(get("heldout_files", []) or []))

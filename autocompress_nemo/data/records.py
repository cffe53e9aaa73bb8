"""Record formats: Parquet files and saved Hugging Face datasets, one document per row.

- **Parquet** (``.parquet``, read with ``pyarrow``): the text in the column ``data.jsonl_field``
  (the field JSONL lines use). Ids ``<file>:<row>`` (1-based, as JSONL's ``<file>:<line>``).
- **a saved dataset** (a directory written by ``datasets.Dataset.save_to_disk``; needs the
  ``datasets`` package): the text in column ``data.jsonl_field``. Ids ``<directory>:<row>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autocompress_nemo.data.document import DataError, Document


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return path.is_dir() and (
        ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
        or (path / "dataset_dict.json").is_file()
    )


def _records(path: Path, rel: str, column: str, values: Sequence[Any], columns: Sequence[str]) -> list[Document]:
    if column not in columns:
        raise DataError(
            f"{path}: no column {column!r} (columns: {', '.join(map(str, columns))}); "
            "set data.jsonl_field to the text's column"
        )
    if not len(values):
        raise DataError(f"{path} holds no rows; give a file with text")
    out = []
    for i, v in enumerate(values, start=1):
        if not isinstance(v, str):
            raise DataError(
                f"{path}: row {i} column {column!r} is {type(v).__name__}, not text; "
                "set data.jsonl_field to a text column"
            )
        out.append(Document(f"{rel}:{i}", v))
    return out


def parquet_documents(path: Path, rel: str, column: str) -> list[Document]:
    """One document per row of a Parquet file, its text in ``column``."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow; `pip install pyarrow`") from None
    try:
        f = pq.ParquetFile(str(path))
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError ...
        raise DataError(f"{path} is not a readable Parquet file ({e}); write it again") from None
    names = f.schema_arrow.names
    values = f.read(columns=[column]).column(column).to_pylist() if column in names else []
    return _records(path, rel, column, values, names)


def dataset_documents(directory: Path, rel: str, column: str) -> list[Document]:
    """One document per row of a dataset saved with ``Dataset.save_to_disk``."""
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{directory} is a DatasetDict (splits {splits}); give one split's directory, e.g. "
            f"{directory / (splits[0] if splits else 'train')}"
        )
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{directory}: reading a saved dataset needs the `datasets` package; `pip install datasets`"
        ) from None
    try:
        ds = datasets.load_from_disk(str(directory))
    except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError, ArrowInvalid ...
        raise DataError(f"{directory} is not a readable saved dataset ({e}); save it again with save_to_disk") from None
    names = list(ds.column_names)
    return _records(directory, rel, column, ds[column] if column in names else [], names)

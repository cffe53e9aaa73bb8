"""Bring your own data (issue 18): JSONL, Parquet, saved datasets and Megatron indexed datasets feed
the same tokens for the same text, and bad data is refused with a message naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autocompress_nemo.context import ByteTokenizer
from autocompress_nemo.data import DataError, Document, build_corpus, load_documents, tokenize

TEXTS = [f"document {i}: " + " ".join(f"word{i * j % 17}" for j in range(20 + i)) for i in range(24)]
VOCAB = 512


def _jsonl(path, texts=TEXTS, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _parquet(path, texts=TEXTS, field="text"):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), str(path))
    return path


def _dataset(path, texts=TEXTS, field="text"):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({field: texts, "id": list(range(len(texts)))}).save_to_disk(str(path))
    return path


def _indexed(prefix, token_docs):
    """``<prefix>.bin`` / ``.idx`` written by Megatron's own builder, one document per list."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for toks in token_docs:
        b.add_document(torch.tensor(toks, dtype=torch.int32), [len(toks)])
    b.finalize(f"{prefix}.idx")
    return prefix


def _files(path, field="text"):
    return {"kind": "files", "paths": [str(path)], "jsonl_field": field, "holdout_fraction": 0.2}


def test_every_format_feeds_the_same_tokens_for_the_same_text(tmp_path):
    tok = ByteTokenizer(VOCAB)
    sources = {
        "jsonl": _jsonl(tmp_path / "c.jsonl"),
        "parquet": _parquet(tmp_path / "c.parquet"),
        "dataset": _dataset(tmp_path / "c_ds"),
    }
    streams = {}
    for name, path in sources.items():
        docs = load_documents(_files(path))
        assert sorted(d.text for d in docs) == sorted(TEXTS), name
        # rows / lines are numbered alike, so the documents come in the same order
        assert [d.doc_id.rsplit(":", 1)[1] for d in docs] == [
            d.doc_id.rsplit(":", 1)[1] for d in load_documents(_files(sources["jsonl"]))
        ]
        streams[name] = tokenize(docs, tok)[0]
    assert all(np.array_equal(streams["jsonl"], s) for s in streams.values())

    # Megatron indexed: the same texts tokenized (with EOD, as preprocess_data.py --append-eod does)
    eos = tok.eos_token_id
    prefix = _indexed(tmp_path / "c_text_document", [tok.encode(t) + [eos] for t in TEXTS])
    corpus = build_corpus({"kind": "megatron", "blend": [1.0, str(prefix)], "holdout_fraction": 0.2}, tok)
    for docs, tokens, offsets in (
        (corpus.train_docs, corpus.train_tokens, corpus.train_offsets),
        (corpus.heldout_docs, corpus.heldout_tokens, corpus.heldout_offsets),
    ):
        ends = [*offsets[1:], len(tokens)]
        for d, start, end in zip(docs, offsets, ends, strict=True):
            j = int(d.doc_id.rsplit(":", 1)[1])
            expect = tokenize([Document("x", TEXTS[j])], tok)[0]
            assert np.array_equal(tokens[start:end], expect), d.doc_id
    assert len(corpus.train_docs) + len(corpus.heldout_docs) == len(TEXTS)
    assert corpus.heldout_docs and corpus.train_docs


def test_the_split_is_a_stable_hash_of_the_document_id(tmp_path):
    from autocompress_nemo.data import is_heldout

    tok = ByteTokenizer(VOCAB)
    corpus = build_corpus(_files(_parquet(tmp_path / "c.parquet")), tok)
    assert sorted(d.doc_id for d in corpus.heldout_docs) == sorted(
        f"c.parquet:{i}" for i in range(1, len(TEXTS) + 1) if is_heldout(f"c.parquet:{i}", 0.2)
    )
    again = build_corpus(_files(tmp_path / "c.parquet"), tok)
    assert np.array_equal(again.train_tokens, corpus.train_tokens)


def test_blend_weights_set_each_prefix_share(tmp_path):
    tok = ByteTokenizer(VOCAB)
    a = _indexed(tmp_path / "a", [[1 + i % 50] * 40 + [tok.eos_token_id] for i in range(60)])
    b = _indexed(tmp_path / "b", [[100 + i % 50] * 40 for i in range(60)])  # no EOD: appended
    corpus = build_corpus({"kind": "megatron", "blend": [3, str(a), 1, str(b)], "holdout_fraction": 0.1}, tok)
    t = corpus.train_tokens
    share_a = np.isin(t, np.arange(1, 51)).sum() / (t != tok.eos_token_id).sum()
    assert 0.7 < share_a < 0.8
    assert {d.doc_id.split(":")[0] for d in corpus.train_docs} == {"a", "b"}
    assert int((t == tok.eos_token_id).sum()) == len(corpus.train_docs)  # one EOD per document


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "is empty (0 bytes)"),
        ("binary", "is binary, not text"),
        ("jsonl_field", "no string field 'body'; set data.jsonl_field"),
        ("parquet_column", "no column 'body' (columns: text, id); set data.jsonl_field"),
        ("dataset_column", "no column 'body' (columns: text, id); set data.jsonl_field"),
        ("parquet_empty", "holds no rows"),
        ("not_parquet", "is not a readable Parquet file"),
        ("dataset_dict", "is a DatasetDict (splits ['train']); give one split's directory"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path, case, message):
    if case == "empty":
        (path := tmp_path / "e.txt").write_text("")
    elif case == "binary":
        (path := tmp_path / "b.txt").write_bytes(b"abc\0def" * 10)
    elif case == "jsonl_field":
        path = _jsonl(tmp_path / "c.jsonl")
    elif case == "parquet_column":
        path = _parquet(tmp_path / "c.parquet")
    elif case == "dataset_column":
        path = _dataset(tmp_path / "ds")
    elif case == "parquet_empty":
        path = _parquet(tmp_path / "c.parquet", texts=[])
    elif case == "not_parquet":
        (path := tmp_path / "c.parquet").write_bytes(b"PAR1 not really")
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "dd"
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(path))
    field = "body" if case.endswith(("field", "column")) else "text"
    with pytest.raises(DataError) as e:
        load_documents(_files(path, field))
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_too_short_for_the_sequence_length(tmp_path):
    corpus = build_corpus(_files(_jsonl(tmp_path / "c.jsonl")), ByteTokenizer(VOCAB))
    with pytest.raises(DataError, match=r"fewer than one sequence of seq_len=100000 \(\+1"):
        corpus.train(100_000)
    with pytest.raises(DataError, match="held-out text"):
        corpus.heldout(100_000)


def test_bad_indexed_data_is_refused(tmp_path):
    tok = ByteTokenizer(VOCAB)
    with pytest.raises(DataError, match=r"does not exist; give the prefix preprocess_data.py wrote"):
        build_corpus({"kind": "megatron", "blend": [1.0, str(tmp_path / "missing")]}, tok)
    with pytest.raises(DataError, match="odd number of entries; give weight, prefix pairs"):
        build_corpus({"kind": "megatron", "blend": [1.0, "a", 2.0]}, tok)
    with pytest.raises(DataError, match="weight 'x' .* is not a number"):
        build_corpus({"kind": "megatron", "blend": ["x", "a"]}, tok)
    big = _indexed(tmp_path / "big", [[5, 6, 9999]] * 4)
    with pytest.raises(DataError, match="token id 9999, outside the parent's vocabulary of 512"):
        build_corpus({"kind": "megatron", "blend": [1.0, str(big)]}, tok)


def test_validation_names_bad_data_before_any_stage(tmp_path):
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.config.validate import collect_problems

    (tmp_path / "e.txt").write_text("")
    (tmp_path / "b.txt").write_bytes(b"\0" * 100)
    base = ["model=tiny_llama", "+target=tiny_cpu", "engine@target.engine=roofline"]
    probs = collect_problems(compose([*base, "data=files", f"data.paths=[{tmp_path / 'e.txt'},{tmp_path / 'b.txt'}]"]))
    assert any("is empty (0 bytes)" in p for p in probs), probs
    assert any("is binary, not text" in p for p in probs), probs
    probs = collect_problems(compose([*base, "data=megatron", f"data.blend=[1.0,{tmp_path / 'nope'}]"]))
    assert any("nope.idx does not exist" in p for p in probs), probs
    prefix = _indexed(tmp_path / "ok", [[1, 2, 3]] * 50)
    probs = collect_problems(compose([*base, "data=megatron", f"data.blend=[1.0,{prefix}]"]))
    assert not [p for p in probs if "data" in p], probs
    parquet = _parquet(tmp_path / "c.parquet")
    probs = collect_problems(compose([*base, "data=files", f"data.paths=[{parquet}]", "data.jsonl_field=body"]))
    assert any("no column 'body'" in p for p in probs), probs

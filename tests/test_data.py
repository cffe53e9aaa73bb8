"""Text data: stdlib corpus, file loader, deterministic split, tokenization + cache, packing and
the seeded, resumable batch order. Tokenizers here are tiny fakes (bytes -> ids)."""

from __future__ import annotations

import json
import sysconfig

import numpy as np
import pytest

from autocompress_nemo.data import (
    DataError,
    Document,
    PackedDataset,
    build_corpus,
    cached_tokenize,
    file_documents,
    split_documents,
    stdlib_files,
    tokenize,
)
from autocompress_nemo.data.corpus import limit_documents, stable_fraction


class ByteTokenizer:
    """encode(text) -> UTF-8 bytes + 1; id 0 is EOS."""

    fingerprint = "bytes+1/v1"
    eos_token_id = 0

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [b + 1 for b in text.encode()]


class CallTokenizer:
    """The transformers call interface: tok(texts, add_special_tokens=False)["input_ids"]."""

    eos_token_id = 999

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(128)}

    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [[ord(c) % 128 for c in t] for t in texts]}


def docs(*texts: str) -> list[Document]:
    return [Document(f"d{i}.txt", t) for i, t in enumerate(texts)]


def test_stdlib_files_are_the_standard_library_without_tests():
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert "json/decoder.py" in rel and "textwrap.py" in rel
    for r in rel:
        parts = r.split("/")
        assert not {"site-packages", "test", "tests", "idlelib", "idle_test"} & set(parts[:-1]), r
        assert not parts[-1].startswith("test_")


def test_split_is_deterministic_disjoint_and_names_win():
    corpus = [Document(f"m{i}.py", "x") for i in range(400)]
    train, held = split_documents(corpus, 0.1, ["m3.py"])
    assert "m3.py" in {d.doc_id for d in held}
    assert {d.doc_id for d in train}.isdisjoint({d.doc_id for d in held})
    assert len(train) + len(held) == 400
    assert 20 <= len(held) <= 65  # ~10% of 400, by hash
    again = split_documents(list(reversed(corpus)), 0.1, ["m3.py"])
    assert {d.doc_id for d in again[1]} == {d.doc_id for d in held}  # depends on ids only
    assert all(stable_fraction(d.doc_id) < 0.1 or d.doc_id == "m3.py" for d in held)
    with pytest.raises(DataError, match="not in the corpus: \\['nope.py'\\]"):
        split_documents(corpus, 0.1, ["nope.py"])


def test_limit_documents_spreads_over_the_corpus():
    corpus = [Document(f"{c}{i}.py", "x") for c in "abcdefgh" for i in range(50)]
    kept = limit_documents(corpus, 40)
    assert len(kept) == 40 and [d.doc_id for d in kept] == sorted(d.doc_id for d in kept)
    assert len({d.doc_id[0] for d in kept}) >= 6  # not just the alphabetical head
    assert kept == limit_documents(corpus, 40)
    with_named = limit_documents(corpus, 40, keep=["h49.py"])
    assert len(with_named) == 40 and "h49.py" in {d.doc_id for d in with_named}


def test_tokenize_puts_eos_between_documents():
    tokens, offsets = tokenize(docs("ab", "", "c"), ByteTokenizer())
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [98, 99, 0, 0, 100, 0]
    assert offsets.tolist() == [0, 3, 4]
    t2, o2 = tokenize(docs("ab", "c"), CallTokenizer())
    assert t2.tolist() == [97, 98, 999, 99, 999] and o2.tolist() == [0, 3]


def test_cache_reuses_and_is_keyed_by_tokenizer_and_files(tmp_path):
    tok = ByteTokenizer()
    d = docs("hello", "world")
    a = cached_tokenize(d, tok, tmp_path)
    calls = tok.calls
    b = cached_tokenize(d, tok, tmp_path)
    assert tok.calls == calls  # read from the cache
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert len(list(tmp_path.glob("*.tokens.npy"))) == 1
    cached_tokenize(docs("hello", "world!"), tok, tmp_path)  # a changed file: a new entry
    other = ByteTokenizer()
    other.fingerprint = "bytes+1/v2"
    cached_tokenize(d, other, tmp_path)  # another tokenizer: a new entry
    assert len(list(tmp_path.glob("*.tokens.npy"))) == 3
    # a truncated cache file is recomputed, never used
    for p in tmp_path.glob("*.tokens.npy"):
        p.write_bytes(p.read_bytes()[:20])
    c = cached_tokenize(d, tok, tmp_path)
    assert tok.calls > calls and np.array_equal(c[0], a[0])


def test_packed_dataset_shapes_and_shift():
    ds = PackedDataset(np.arange(23, dtype=np.uint32), seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    assert ds[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert ds[3].tolist() == [15, 16, 17, 18, 19, 20]
    b = next(ds.batches(batch_size=2, seed=0))
    assert b.tokens_BT1.shape == (2, 6) and b.tokens_BT1.dtype == np.int64
    assert np.array_equal(b.inputs_BT[:, 1:], b.labels_BT[:, :-1])
    with pytest.raises(IndexError):
        ds[4]


def test_batches_are_seeded_resumable_and_dp_invariant():
    ds = PackedDataset(np.arange(10_001, dtype=np.uint32), seq_len=10)  # 1000 sequences
    run = [b.tokens_BT1 for b in ds.batches(batch_size=8, seed=7, num_steps=300)]  # crosses 2 epochs
    resumed = [b.tokens_BT1 for b in ds.batches(batch_size=8, seed=7, start_step=137, num_steps=163)]
    assert all(np.array_equal(x, y) for x, y in zip(run[137:], resumed, strict=True))
    other = next(ds.batches(batch_size=8, seed=8)).tokens_BT1
    assert not np.array_equal(run[0], other)
    # one epoch (125 steps) visits every sequence exactly once
    firsts = np.concatenate([x[:, 0] for x in run[:125]]) // 10
    assert sorted(firsts.tolist()) == list(range(1000))
    # data-parallel ranks split the same global batch
    parts = [next(ds.batches(batch_size=8, seed=7, start_step=5, dp_rank=r, dp_size=4)).tokens_BT1 for r in range(4)]
    assert np.array_equal(np.concatenate(parts), run[5])
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        next(ds.batches(batch_size=8, seed=7, dp_size=3))
    with pytest.raises(ValueError, match="do not fill one batch"):
        next(PackedDataset(np.arange(30), 10).batches(batch_size=4, seed=0))


def test_file_loader_text_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("beta")
    (sub / "skip.bin").write_bytes(b"\x00")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}) + "\n")
    got = file_documents([tmp_path])
    assert [(d.doc_id, d.text) for d in got] == [
        ("a.txt", "alpha"),
        ("c.jsonl:1", "gamma"),
        ("c.jsonl:3", "delta"),
        ("sub/b.md", "beta"),
    ]
    assert [d.doc_id for d in file_documents([tmp_path / "a.txt"])] == ["a.txt"]
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: no string field 'text'; set data.jsonl_field"):
        file_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(DataError, match="does not exist; fix data.paths"):
        file_documents([tmp_path / "missing"])


def test_build_corpus_on_the_stdlib(tmp_path):
    data = {"kind": "stdlib", "holdout_fraction": 0.1, "heldout_files": ["textwrap.py"], "max_documents": 30}
    tok = ByteTokenizer()
    corpus = build_corpus(data, tok, cache_dir=tmp_path)
    s = corpus.summary()
    assert s["train_documents"] + s["heldout_documents"] == 30 and s["heldout_documents"] >= 1
    assert corpus.train_tokens[-1] == 0 and len(corpus.train(64)) > 10
    again = build_corpus(data, ByteTokenizer(), cache_dir=tmp_path)
    assert np.array_equal(again.train_tokens, corpus.train_tokens)
    assert again.summary()["heldout_ids"] == s["heldout_ids"] and "textwrap.py" in s["heldout_ids"]


def test_default_stdlib_split_from_the_shipped_config():
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.data import load_documents

    data = compose([]).data
    docs = load_documents(data)
    train, held = split_documents(docs, data.holdout_fraction, list(data.heldout_files))
    held_ids = {d.doc_id for d in held}
    assert set(data.heldout_files) <= held_ids
    assert 0.03 < len(held) / len(docs) < 0.10
    assert sum(len(d.text) for d in train) > 5_000_000  # megabytes of real text to calibrate on

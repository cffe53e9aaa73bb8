"""Bring your own parent: ``model=hf model.source.path=DIR`` / ``model=gguf model.source.path=FILE.gguf``.

``conf/model/hf.yaml`` and ``conf/model/gguf.yaml`` leave every shape field unset (``???``; where the
schema has a default, Hydra's merge keeps that placeholder, so ``--cfg job`` shows it). Right after
composition (:func:`fill_model_from_file`, called by ``config.entry.compose`` and by every stage's
entry point before ``validate``) the shape fields are read from the file itself (``models/shape.py``:
``config.json``, or the GGUF metadata through ``gguf.GGUFReader``). A field given on the command
line (``model.heads=8``) stays, but must agree with the file, or the command is refused with a
message naming both values. A shipped model YAML sets every field and is left alone.
The model's ``name`` (and so ``run_dir``) is the directory's or file's name
(``${source_name:${model.source.path}}``, a resolver registered with the configs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# the ``cfg.model`` fields a parent's own files decide (``dtype``: what the file stores)
from autocompress_nemo.arch.from_config import SHAPE_FIELDS as SHAPE_FIELDS


def source_name(path: Any) -> str:
    """A run-directory-safe name of a model path: its last component without ``.gguf``."""
    name = Path(str(path or "")).expanduser().name.removesuffix(".gguf")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def register_resolvers() -> None:
    """``${source_name:PATH}`` (idempotent)."""
    if not OmegaConf.has_resolver("source_name"):
        OmegaConf.register_new_resolver("source_name", source_name)


def _unset(model: DictConfig, key: str) -> bool:
    """The field exists and is ``???`` (``key in model`` is False for such a field)."""
    return key in model.keys() and OmegaConf.is_missing(model, key)


_OVERRIDE = re.compile(r"^[+~]{0,2}model\.([A-Za-z_]+)=")
_CHOICE = re.compile(r"^\+{0,2}model=(.*)$")


def given_fields(overrides: Sequence[str]) -> set[str]:
    """The ``model.<field>`` keys set on the command line."""
    return {m.group(1) for a in overrides if (m := _OVERRIDE.match(a))}


def model_choice(overrides: Sequence[str]) -> str | None:
    """The ``model=<name>`` choice of the command line (the last one), if any."""
    found = [m.group(1) for a in overrides if (m := _CHOICE.match(a))]
    return found[-1] if found else None


def reads_from_file(model: Any, choice: str | None = None) -> bool:
    """``model.source`` is a file and the shape is left to it (``model=hf`` / ``model=gguf``, or
    ``hidden`` / ``vocab`` unset)."""
    if not isinstance(model, DictConfig) or "source" not in model:
        return False
    kind = OmegaConf.select(model, "source.kind", default="none")
    return kind in ("hf", "gguf") and (choice in ("hf", "gguf") or _unset(model, "hidden") or _unset(model, "vocab"))


def _same(given: Any, have: Any) -> bool:
    if isinstance(have, float) or isinstance(given, float):
        try:
            return math.isclose(float(given), float(have), rel_tol=1e-6)
        except (TypeError, ValueError):
            return False
    return given == have


def file_problems(model: DictConfig, given: set[str]) -> tuple[dict[str, Any], list[str]]:
    """``(fields read from the file, problems)`` for a model whose shape comes from its file;
    ``given``: the fields set on the command line (each must agree with the file)."""
    from autocompress_nemo.config import resolve
    from autocompress_nemo.models.shape import ModelFileError, read_model_fields, tokenizer_problem

    kind = str(model.source.kind)
    what = "Hugging Face directory" if kind == "hf" else "GGUF file"
    if not str(OmegaConf.select(model, "source.path", default="") or ""):
        return {}, [
            f"model={kind} reads the parent's shape from its own files, but model.source.path is empty; "
            f"give model.source.path=<{what}>"
        ]
    path = resolve.model_file(model)
    if path is None or not path.exists():
        return {}, [f"model.source.path={path} does not exist; give model.source.path=<{what}>"]
    try:
        fields = read_model_fields(kind, path)
        tok = tokenizer_problem(kind, path)
    except ModelFileError as e:
        return {}, [f"model.source.path: {e}"]
    problems = [f"model.source.path: {tok}"] if tok else []
    where = path / "config.json" if kind == "hf" else path
    for key, have in fields.items():
        if key in given and not _unset(model, key) and not _same(model[key], have):
            problems.append(
                f"model.{key}={model[key]!r} but {where} says {key} {have!r}: the shape comes from the file; "
                f"drop model.{key}= from the command line, or give the file of the model you mean"
            )
    return fields, problems


def fill_model_from_file(cfg: DictConfig, overrides: Sequence[str] = (), choice: str | None = None) -> None:
    """Set the shape fields of ``cfg.model`` from its file (in place) unless ``overrides`` (the
    command line) gives them; raise ``ConfigError`` naming every problem (unreadable file,
    unsupported family, no tokenizer, a given field that disagrees with the file)."""
    from autocompress_nemo.config.validate import ConfigError

    model = cfg.get("model") if isinstance(cfg, DictConfig) else None
    if not reads_from_file(model, choice or model_choice(overrides)):
        return
    assert isinstance(model, DictConfig)
    given = given_fields(overrides)
    fields, problems = file_problems(model, given)
    if problems:
        raise ConfigError(problems)
    for key, value in fields.items():
        if key not in given or _unset(model, key):
            model[key] = value

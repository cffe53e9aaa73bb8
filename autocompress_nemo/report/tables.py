"""``results`` normalization and the Markdown of ``report.md`` (schema: ``report/__init__.py``)."""

from __future__ import annotations

import copy
import math
from typing import Any

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.report.compat import from_pipeline, looks_like_pipeline

MODEL_ORDER = ("parent", "autocompress", "minitron_pp")
DISPLAY = {"parent": "Parent", "autocompress": "AutoCompress", "minitron_pp": "Minitron++"}
COST_METRICS = ("prefill_ms", "decode_ms", "response_latency_ms", "throughput_tps", "memory_bytes")
UNITS = {
    "prefill_ms": "ms",
    "decode_ms": "ms",
    "response_latency_ms": "ms",
    "throughput_tps": "tok/s",
    "memory_bytes": "MiB",
    "ttft_ms": "ms",
    "tpot_ms": "ms",
    "params": "M",
}
NO_SOURCE = "source not recorded"
PARENT_NOTE = "the parent: the reference the students' budgets are set against, not checked"


# ---------------------------------------------------------------------------------------------
# normalization
# ---------------------------------------------------------------------------------------------
def spec_of(entry: dict[str, Any]) -> ArchSpec | None:
    arch = entry.get("arch")
    if isinstance(arch, ArchSpec):
        return arch
    if isinstance(arch, dict) and "blocks" in arch:
        return ArchSpec.from_dict(arch)
    return None


def _normalize_model(key: str, entry: dict[str, Any]) -> dict[str, Any]:
    e = dict(entry)
    e.setdefault("label", DISPLAY.get(key, key))
    spec = spec_of(e)
    if spec is not None:
        e["arch"] = spec.to_dict()
        e.setdefault("params", param_count(spec))
    ec = e.get("engine_check") or {}
    if e.get("measured") is None and ec.get("measured") is not None:
        e["measured"] = dict(ec["measured"])
    if e.get("measured") is not None:
        e["measured"].setdefault("source", ec.get("source") or NO_SOURCE)
    if e.get("predicted") is not None:
        e["predicted"] = dict(e["predicted"])
        e["predicted"].setdefault("source", NO_SOURCE)
    elif ec.get("predicted") is not None:
        e["predicted"] = dict(ec["predicted"])
    e.setdefault("checks", ec.get("checks"))
    if "pass" not in e:
        e["pass"] = ec.get("pass")
    if key == "parent":  # the reference the budgets are set against (0.6x of it), not a candidate
        e["checks"] = [
            {**c, "pass": None, "reference": True, "note": c.get("note") or PARENT_NOTE} for c in e.get("checks") or []
        ]
        e["pass"] = None
    e.setdefault("accuracy", {})
    return e


def normalize(results: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``results`` with every model entry filled in (params, measured/checks from
    ``engine_check``, labels) and missing sections present as empty values."""
    res = copy.deepcopy(results)
    if looks_like_pipeline(res):
        res = from_pipeline(res)
    models = res.get("models") or {}
    keys = [k for k in MODEL_ORDER if models.get(k)] + [k for k in models if k not in MODEL_ORDER and models[k]]
    res["models"] = {k: _normalize_model(k, models[k]) for k in keys}
    for key, default in (
        ("target", {}),
        ("tokens", {}),
        ("wall_time_s", {}),
        ("search_trajectory", []),
        ("notes", []),
        ("run", {}),
        ("cost_model_validation", None),
    ):
        if res.get(key) is None:
            res[key] = default
    return res


# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------
def fmt(v: Any, metric: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if metric == "memory_bytes":
            return f"{v / 2**20:,.1f}"
        if metric == "params":
            return f"{v / 1e6:,.2f}"
        if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1000:
            return f"{int(v):,}"
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    return str(v)


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def block_width(b: Block) -> str:
    """A block's widths in words: ``8h/4kv``, ffn ``1536``, ``32x512+1024`` experts, ``removed``."""
    return "removed" if b.removed else kind_of(b).words(b)


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------

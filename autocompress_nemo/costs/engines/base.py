"""One small interface every serving engine implements (DESIGN.md section 3, "Cost model").

An engine adapter can tell whether it serves an ArchSpec (``check_servable``) and measure
a model of that spec under a workload (``measure``): prefill time for the workload's input
length, time per decode step at the workload's decode context and batch, and memory by
part as the engine itself reports it. Raw timings and their spread travel with the result.

The *decode context* is the KV length a decode step sees. Unless the engine settings say
otherwise (``decode_context: full``) it is the mean position over the response,
``input_len + output_len // 2``: then ``ttft + output_len * tpot`` estimates the
response latency of the workload. Memory is always sized for ``context_len`` x ``batch``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.loaders import GENERIC, HfLoader
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.config.engine import (
    EngineCapabilities,
    EngineConfig,
    EngineSettings,
    capabilities_of,
    engine_config_of,
)

MEMORY_PARTS = ("weights", "kv", "compute", "output", "state")


@dataclass
class Workload:
    batch: int = 1
    input_len: int = 256
    output_len: int = 64
    context_len: int = 1024

    @classmethod
    def from_config(cls, w: Any) -> Workload:
        return cls(int(w.batch), int(w.input_len), int(w.output_len), int(w.context_len))

    def decode_context(self, mode: str = "mean") -> int:
        """KV length seen by a timed decode step: ``input_len + output_len // 2`` ("mean") or ``context_len - 1``."""
        if mode == "full":
            return self.context_len - 1
        if mode != "mean":
            raise ValueError(f"decode_context must be 'mean' or 'full', got {mode!r}")
        return min(self.input_len + self.output_len // 2, self.context_len - 1)


def robust(samples: list[float], percentile: float) -> float:
    """The robust timing statistic: the ``percentile``-th percentile (low: drift on a shared machine only adds)."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), percentile))


def spread(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "n": int(a.size),
        "min": float(a.min()),
        "p10": float(np.percentile(a, 10)),
        "median": float(np.median(a)),
        "max": float(a.max()),
        "rel_iqr": float((np.percentile(a, 75) - np.percentile(a, 25)) / max(np.median(a), 1e-12)),
    }


@dataclass
class Measurement:
    """What one engine run of one model reports.

    ``prefill_ms``: one prefill of ``input_len`` tokens x ``batch`` sequences.
    ``decode_ms``: one decode step of ``batch`` sequences at ``decode_context``.
    ``memory``: bytes by part (weights, kv, compute, output, state) as the engine reports them.
    """

    prefill_ms: float
    decode_ms: float
    memory: dict[str, float]
    raw: dict[str, list[float]] = field(default_factory=dict)
    spread: dict[str, dict[str, float]] = field(default_factory=dict)
    estimated: bool = False
    """True when no engine ran (roofline): every number is "estimated, not measured"."""
    wall_s: float = 0.0
    ratio: dict[str, float] = field(default_factory=dict)
    """Per phase: the median ratio to the reference timed in the same rounds (``paired.py``); empty
    when no reference was timed. Then ``prefill_ms`` / ``decode_ms`` are ``ratio x scale``."""
    ratio_spread: dict[str, dict[str, float]] = field(default_factory=dict)
    absolute: dict[str, float] = field(default_factory=dict)
    """The model's own timing statistic (the method without a reference), when a reference was timed."""
    scale: dict[str, float] = field(default_factory=dict)
    """The reference times the ratios are expressed in."""
    reference: dict[str, Any] = field(default_factory=dict)
    """The reference: name, its absolute times in this call, their variation between rounds, load average."""
    flags: list[str] = field(default_factory=list)
    """Why this measurement is not to be trusted blindly (a spread ratio, a reference that varied)."""

    @classmethod
    def from_samples(
        cls,
        raw: dict[str, list[float]],
        percentile: float,
        memory: dict[str, float],
        extra: dict[str, list[float]],
        wall_s: float,
    ) -> Measurement:
        """A timed run: ``prefill_ms`` / ``decode_ms`` the ``percentile``-th percentile of their
        samples (NaN when the run was not timed, ``raw`` empty), the spread of every ``*_ms``
        series, ``extra`` (e.g. memory read-outs) kept next to the raw samples."""
        return cls(
            prefill_ms=robust(raw["prefill_ms"], percentile) if raw else float("nan"),
            decode_ms=robust(raw["decode_ms"], percentile) if raw else float("nan"),
            memory=memory,
            raw={**raw, **extra},
            spread={k: spread(v) for k, v in raw.items() if k.endswith("_ms")},
            wall_s=wall_s,
        )

    @property
    def memory_bytes(self) -> float:
        return float(sum(self.memory.values()))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["memory_bytes"] = self.memory_bytes
        return d


def capability_problems(spec: ArchSpec, caps: Any, parent: ArchSpec | None = None) -> list[str]:
    """Reasons ``spec`` violates the declared capabilities (empty list: servable).

    ``caps``: ``EngineCapabilities`` or a dict / config node of its keys (``capabilities_of``).
    When ``parent`` is given, per-block differences are judged against it (vary_* flags);
    otherwise against the first block of each kind.
    """
    caps = capabilities_of(caps).for_parent(parent or spec)  # a hybrid's own override set (Nemotron-H loader)
    out: list[str] = []
    kinds = set(caps.block_kinds)
    for k in sorted(spec.kinds() - kinds):
        out.append(f"block kind {k!r} is not served (engine runs {sorted(kinds)})")
    ref: dict[str, Any] = {}
    for b in parent.blocks if parent else spec.blocks:
        if not b.removed:
            ref.setdefault(b.kind, b)
    from autocompress_nemo.blocks import kind_of  # torch behind it: engine classes are read without it

    for i, b in enumerate(spec.blocks):
        out += kind_of(b).capability_problems(i, b, ref.get(b.kind), caps)
    kept = {b.kind for b in spec.blocks if not b.removed}
    for k in caps.keep_first_of:
        if k not in kept and (parent is None or any(b.kind == k and not b.removed for b in parent.blocks)):
            out.append(
                f"the model keeps no {k} block (keep_first_of: the engine needs at least one; llama.cpp nemotron_h "
                "aborts on a zero-size cache)"
            )
    if not caps.mlp_with_moe and {"mlp", "moe"} <= kept:
        mlps = [i for i, b in enumerate(spec.blocks) if b.kind == "mlp" and not b.removed]
        out.append(
            f"dense MLP block(s) {mlps} in a model with MoE blocks (mlp_with_moe=False: llama.cpp "
            "nemotron_h_moe reads every feed-forward layer as MoE and refuses a dense one)"
        )
    if spec.is_dense_layered():
        layers = spec.layers()
        if caps.first_block_full and layers and layers[0][0].removed:
            out.append("layer 0 has no attention (first_block_full: llama.cpp deci fails to load it)")
        if caps.last_block_full and layers and layers[-1][1].removed:
            out.append(f"layer {len(layers) - 1} (last) has no ffn (last_block_full: llama.cpp deci crashes)")
        if caps.attention_needs_ffn:
            for j, (a, m) in enumerate(layers):
                if not a.removed and m.removed:
                    out.append(
                        f"layer {j}: attention without ffn (attention_needs_ffn: llama.cpp deci "
                        "drops the attention output)"
                    )
        if all(a.removed for a, _ in layers) and "attention" in kinds:
            out.append("no layer keeps attention (the engine cannot create a context)")
    return out


class Engine:
    """Base class of the engine adapters.

    ``cfg`` is the target's ``engine`` section, kept typed (``config/schema.py::EngineConfig``, its
    ``settings`` and ``capabilities`` read as attributes), ``hardware`` its ``hardware`` section.
    Subclasses implement ``measure`` and may add engine-specific checks to ``check_servable``.
    """

    name = "base"
    estimated = False
    decode_steps = 64
    """Timed decode steps when ``settings.decode_steps`` is 0."""
    student_format = "hf"
    """The file the engine loads a student from: ``hf`` (a Hugging Face directory) or ``gguf``; the
    export stage writes it (``stages/export.py``)."""
    own_quantizer = False
    """Quantized ``engine.dtype`` values are produced by the engine's own quantizer, and the student is
    evaluated on that quantized file (llama.cpp)."""
    kv_cell_align = 0
    """The engine allocates KV cells in multiples of this (llama.cpp: 256); 0: exactly context x batch."""
    gpu_only = False
    """It runs on NVIDIA GPUs only (TensorRT-LLM)."""
    hf_loader: HfLoader = GENERIC
    """What its Hugging Face loader reads of a heterogeneous config (``arch/loaders.py``): the export
    writes that, and refuses what it would misread."""

    # -- what the rest of the package asks an engine without building one (``engine_class(name)``) --
    @classmethod
    def norm_dtype(cls, dtype: str) -> str:
        """The dtype the engine stores norm weights in, for weights of ``dtype``."""
        return dtype

    @classmethod
    def ffn_align(cls, dtype: str) -> int:
        """The multiple an ffn width must be so the engine stores ``down`` in ``dtype`` without a fallback type."""
        return 1

    @classmethod
    def target_problems(cls, engine: dict[str, Any], hardware: dict[str, Any]) -> list[str]:
        """What this engine cannot do with the target's ``engine`` / ``hardware`` sections (plain
        dicts, before anything is built): checked by ``config/validate.py``."""
        return []

    @classmethod
    def model_problems(cls, engine: dict[str, Any], model: dict[str, Any], hardware: dict[str, Any]) -> list[str]:
        """What this engine cannot serve of the configured ``model`` section (``config/validate.py``)."""
        return []

    def __init__(self, cfg: Any, hardware: Any = None) -> None:
        self.cfg: EngineConfig = engine_config_of(cfg)
        self.hardware = hardware

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.cfg.capabilities

    @property
    def settings(self) -> EngineSettings:
        return self.cfg.settings

    def timed_decode_steps(self) -> int:
        """``settings.decode_steps``, or this engine's default when it is 0."""
        return self.settings.decode_steps or self.decode_steps

    def decode_context(self, workload: Workload) -> int:
        """The KV length a timed decode step sees (``settings.decode_context``)."""
        return workload.decode_context(self.settings.decode_context)

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        """Reasons ``spec`` cannot be served (empty: servable)."""
        return capability_problems(spec, self.capabilities, parent)

    def require_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> None:
        problems = self.check_servable(spec, parent)
        if problems:
            raise ValueError(f"{self.name} cannot serve {spec.name or 'this model'}: " + "; ".join(problems))

    def measure(self, spec: ArchSpec, workload: Workload, weights: dict[str, np.ndarray] | None = None) -> Measurement:
        raise NotImplementedError

    def measure_many(
        self,
        specs: list[ArchSpec],
        workload: Workload,
        *,
        rounds: int | None = None,
        log: Any = None,
        reference: ArchSpec | None = None,
        scale: dict[str, float] | None = None,
    ) -> list[Measurement]:
        """Measure several models. Engines that interleave rounds override this and time every model
        against ``reference`` (``paired.py``); here each model is measured alone and ``reference`` is
        not timed (the results carry no ratio)."""
        return [self.measure(s, workload) for s in specs]

    def version(self) -> str:
        return ""

    def device(self) -> str:
        hw = self.hardware
        return (
            str(getattr(hw, "device", "") or platform.processor() or platform.machine()) if hw else platform.machine()
        )

    def provenance(self) -> dict[str, Any]:
        """Engine-side provenance fields of a cost table."""
        return {
            "engine": self.name,
            "engine_version": self.version(),
            "device": self.device(),
            "threads": int(self.cfg.threads),
            "dtype": str(self.cfg.dtype),
            "kv_dtype": str(self.cfg.kv_dtype),
            "flash_attn": bool(self.cfg.flash_attn),
            "estimated": self.estimated,
        }


class CpuTimedEngine(Engine):
    """An engine timed on this machine's CPU: a fixed thread count and a choice of clock.

    ``clock``: ``thread_cpu`` (the compute thread's CPU time, robust on a shared machine when
    one thread computes) or ``wall``; ``auto`` picks thread_cpu at 1 thread. Both are
    provenance fields a cost table must match.

    It times in its worker process (``python -m`` its own module, ``worker.py``): the parent sends
    the models there; ``in_worker`` is True in that process, which times them itself."""

    def __init__(
        self, cfg: Any, hardware: Any = None, workdir: str | os.PathLike[str] | None = None, *, in_worker: bool = False
    ) -> None:
        super().__init__(cfg, hardware)
        self.runs = 0
        self._workdir = Path(workdir) if workdir else None
        self.in_worker = in_worker

    @property
    def workdir(self) -> Path:
        """Where model files, requests and weights for the worker go (a temporary directory unless given)."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"acn-{self.name}-"))
        self._workdir.mkdir(parents=True, exist_ok=True)
        return self._workdir

    def threads(self) -> int:
        t = int(self.cfg.threads or 0)
        if not t and self.hardware is not None:
            t = int(getattr(self.hardware, "threads", 0) or 0)
        return t or (os.cpu_count() or 1)

    def clock(self) -> str:
        c = self.settings.clock
        if c == "auto":
            return "thread_cpu" if self.threads() == 1 else "wall"
        if c not in ("wall", "thread_cpu"):
            raise ValueError(f"engine.settings.clock={c!r}: use auto, wall or thread_cpu")
        return c

    def provenance(self) -> dict[str, Any]:
        p = super().provenance()
        p.update(threads=self.threads(), clock=self.clock())
        return p

    def uses_reference(self) -> bool:
        r = str(self.settings.reference)
        if r not in ("parent", "none"):
            raise ValueError(f"engine.settings.reference={r!r}: use parent or none")
        return r == "parent"

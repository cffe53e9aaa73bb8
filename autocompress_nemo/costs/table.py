"""The cost table: per-block latency lookup + memory constants, as a JSON data file with provenance.

Layout (``cost_table.json``)::

    provenance: engine, engine_version, device, threads, clock, dtype, kv_dtype, flash_attn,
                workload {batch, input_len, output_len, context_len}, decode_context,
                settings, parent (ArchSpec hash), date, estimated, label
    parent:     the parent ArchSpec (dict)
    intercept:  {prefill_ms, decode_ms}   overhead outside the blocks (embedding, LM head, ...)
    layer_overhead: {prefill_ms, decode_ms}  cost of an empty layer (both blocks removed)
    blocks:     [{block: {...}, prefill_ms, decode_ms, source}]  additive cost of one block option
    memory:     {output_bytes, compute_bytes: [{block, bytes}], compute_base_bytes,
                 weights_overhead_bytes}
    runs:       every engine run: name, layers, statistic, raw samples, spread, memory

A table is valid only for what its provenance records: ``CostTable.check(expected)``
raises :class:`ProvenanceMismatch` naming every field that differs from the target's.
``prefill_ms`` is the time of one prefill of ``input_len`` tokens (per token: divide by
``input_len``); ``decode_ms`` one decode step at ``decode_context`` and ``batch``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, Block, block_from_dict
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.utils.artifacts import hash_obj, write_json_atomic

ESTIMATED_LABEL = "estimated, not measured"
MEASURED_LABEL = "measured"
PHASES = ("prefill_ms", "decode_ms")
# provenance fields that must match the target (date and label are informative only)
MATCH_FIELDS = (
    "engine",
    "engine_version",
    "device",
    "threads",
    "clock",
    "dtype",
    "kv_dtype",
    "flash_attn",
    "workload",
    "decode_context",
    "settings",
    "parent",
    "estimated",
)


class ProvenanceMismatch(ValueError):
    """A cost table was built for another engine / device / workload / parent than the target."""


def spec_hash(spec: ArchSpec) -> str:
    d = spec.to_dict()
    d.pop("name", None)
    d.pop("extra", None)
    return hash_obj(d)


def _block_key(b: Block) -> str:
    return json.dumps({k: v for k, v in sorted(b.__dict__.items())}, sort_keys=True)


@dataclass
class CostTable:
    provenance: dict[str, Any]
    parent: ArchSpec
    intercept: dict[str, float]
    layer_overhead: dict[str, float]
    blocks: list[dict[str, Any]]
    memory: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    # -- io -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance,
            "parent": self.parent.to_dict(),
            "intercept": self.intercept,
            "layer_overhead": self.layer_overhead,
            "blocks": self.blocks,
            "memory": self.memory,
            "runs": self.runs,
        }

    def save(self, path: str | Path) -> Path:
        write_json_atomic(path, self.to_dict())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, expected: dict[str, Any] | None = None) -> CostTable:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"cost table {p} does not exist; build it with `python -m autocompress_nemo.profile +target=<name>`"
            )
        d = json.loads(p.read_text())
        t = cls(
            provenance=d["provenance"],
            parent=ArchSpec.from_dict(d["parent"]),
            intercept=d["intercept"],
            layer_overhead=d["layer_overhead"],
            blocks=d["blocks"],
            memory=d["memory"],
            runs=d.get("runs", []),
        )
        if expected is not None:
            t.check(expected, source=str(p))
        return t

    # -- provenance ---------------------------------------------------------------
    @property
    def estimated(self) -> bool:
        return bool(self.provenance.get("estimated", False))

    def reference_times(self) -> dict[str, float] | None:
        """The reference's (the parent's) prefill and decode times during profiling, which the table's
        costs are ratios of (``None``: a table of absolute times)."""
        ref = self.provenance.get("reference") or {}
        if not all(isinstance(ref.get(p), (int, float)) for p in PHASES):
            return None
        return {p: float(ref[p]) for p in PHASES}

    @property
    def label(self) -> str:
        return ESTIMATED_LABEL if self.estimated else MEASURED_LABEL

    def check(self, expected: dict[str, Any], source: str = "cost table") -> None:
        """Raise :class:`ProvenanceMismatch` listing every field in which this table differs from ``expected``."""
        bad = []
        for k in MATCH_FIELDS:
            if k not in expected:
                continue
            have, want = self.provenance.get(k), expected[k]
            if json.dumps(have, sort_keys=True, default=str) != json.dumps(want, sort_keys=True, default=str):
                bad.append(f"  {k}: table has {have!r}, target needs {want!r}")
        if bad:
            raise ProvenanceMismatch(
                f"{source} does not match the target ({len(bad)} field(s) differ):\n"
                + "\n".join(bad)
                + "\nRebuild it for this target with `python -m autocompress_nemo.profile +target=<name>` "
                "(or point to a table built for it)."
            )

    # -- lookup -------------------------------------------------------------------
    def _entries(self, kind: str) -> list[tuple[Block, dict[str, Any]]]:
        cache = self.__dict__.setdefault("_cache", {})
        if kind not in cache:
            cache[kind] = [(block_from_dict(e["block"]), e) for e in self.blocks if e["block"]["kind"] == kind]
        return cache[kind]

    def block_latency(self, b: Block, phase: str) -> float:
        """Additive latency (ms) of block ``b`` in ``phase`` (prefill_ms or decode_ms); 0 when removed.

        Exact lookup when the option was profiled; a block of separately profiled parts (MoE: routed
        + shared) is the sum of its parts; otherwise its kind interpolates from the profiled options
        (``Kind.interpolate``: mlp piecewise-linear in ``F``, attention ``a + b*H + c*G`` by least
        squares).
        """
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        memo = self.__dict__.setdefault("_latency_memo", {})  # blocks are frozen: (block, phase) -> ms
        if (b, phase) not in memo:
            memo[(b, phase)] = self._lookup_latency(b, phase)
        return memo[(b, phase)]

    def _lookup_latency(self, b: Block, phase: str) -> float:
        if b.removed:
            return 0.0
        entries = self._entries(b.kind)
        key = _block_key(b)
        for eb, e in entries:
            if _block_key(eb) == key:
                return float(e[phase])
        kind = kind_of(b)
        parts = kind.parts(b)
        if b not in parts:  # e.g. an MoE block = routed part + shared part, profiled separately
            return sum(self.block_latency(p, phase) for p in parts)
        est = kind.interpolate(b, [(eb, float(e[phase])) for eb, e in entries])
        if est is not None:
            return est
        raise KeyError(
            f"cost table has no entry for {b} and cannot interpolate it; "
            f"profiled {b.kind} options: {[eb for eb, _ in entries]}"
        )

    def compute_bytes(self, spec: ArchSpec) -> float:
        """Workspace (llama.cpp compute buffer) of ``spec``: the median of the profiling runs' values
        (hybrid tables; the midpoint of the probed range in older ones) when the range is within
        ``compute_band`` of constant; otherwise the largest memory-probe value among
        the options it uses (the peak follows its widest layer), at least the floor probe's.
        An unprofiled width takes the probe of the nearest wider profiled option of its kind."""
        rng = self.memory.get("compute_range")
        if rng and rng[1] > 0 and (rng[1] - rng[0]) <= float(self.memory.get("compute_band", 0.1)) * rng[1]:
            # constant up to allocator effects: the median over the profiling runs where the table has
            # it (a few runs' buffers come out larger; the rest share one value), else the midpoint
            typical = self.memory.get("compute_median_bytes")
            return float(typical) if typical else 0.5 * (float(rng[0]) + float(rng[1]))
        best = float(self.memory.get("compute_base_bytes", 0.0))
        per = [(block_from_dict(e["block"]), float(e["bytes"])) for e in self.memory.get("compute_bytes", [])]
        for b in spec.blocks:
            if b.removed:
                continue
            same = [v for pb, v in per if pb == b]
            if not same:
                size = kind_of(b).size
                wider = [(size(pb), v) for pb, v in per if pb.kind == b.kind and size(pb) >= size(b)]
                same = [min(wider)[1]] if wider else [max((v for pb, v in per if pb.kind == b.kind), default=0.0)]
            best = max(best, same[0])
        return best


MEASURED_SETTINGS = ("n_batch", "n_ubatch", "decode_context", "max_num_tokens", "max_num_batched_tokens", "reference")
"""``EngineSettings`` fields that change what the engine measures (not only how precisely)."""


def expected_settings(engine_cfg: Any) -> dict[str, Any]:
    """The provenance's ``settings``, compared when a table is loaded: the ``MEASURED_SETTINGS`` of
    ``engine_cfg`` (the target's ``engine`` section) and its serving tensor-parallel size."""
    from autocompress_nemo.config.engine import engine_config_of

    cfg = engine_config_of(engine_cfg)
    return {**{k: getattr(cfg.settings, k) for k in MEASURED_SETTINGS}, "tensor_parallel": int(cfg.tensor_parallel)}


def make_provenance(
    engine_prov: dict[str, Any],
    workload: dict[str, int],
    decode_context: int,
    settings: dict[str, Any],
    parent: ArchSpec,
) -> dict[str, Any]:
    """Provenance of a table: engine fields + workload + settings + parent hash + date + label."""
    est = bool(engine_prov.get("estimated", False))
    return {
        **engine_prov,
        "workload": dict(workload),
        "decode_context": int(decode_context),
        "settings": dict(settings),
        "parent": spec_hash(parent),
        "parent_name": parent.name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "estimated": est,
        "label": ESTIMATED_LABEL if est else MEASURED_LABEL,
    }

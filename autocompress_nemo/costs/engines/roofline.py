"""Analytic roofline estimate, for targets whose device is not at hand (planning only).

Every number from here is labelled "estimated, not measured": ``Measurement.estimated`` is
True and tables built from it carry ``provenance.estimated = true`` and that label, which
every report prints.

Per block, each phase is bound by compute or by memory traffic, whichever is slower::

    t = max(FLOPs / (P * eff), bytes / (BW * eff))

with ``P`` = ``hardware.peak_tflops``, ``BW`` = ``hardware.mem_bandwidth_gbs`` and ``eff`` =
``engine.settings.efficiency`` (an assumption, default 0.7). Costs add over blocks (each
block's kernels run one after another). ``B`` batch, ``I`` input length, ``C`` decode
context, ``P_b`` a block's active parameters, ``b_w`` / ``b_kv`` bytes per weight / KV element:

- prefill FLOPs ``2 * P_b * B * I`` + attention ``2 * H * d * B * I^2`` (causal QK^T and AV);
  bytes ``P_b * b_w`` + KV written ``2 * G * d * B * I * b_kv``.
- decode FLOPs ``2 * P_b * B`` + attention ``4 * H * d * B * C``; bytes ``P_b' * b_w`` (MoE:
  the experts touched by ``B`` tokens under uniform routing, ``E * (1 - (1 - k/E)^B)`` — so the
  time of a routed expert's weights depends on tokens per expert ``B*k/E``) + KV read
  ``2 * G * d * B * C * b_kv`` + Mamba state read and written ``2 * state``.
- Mamba-2 adds the recurrence ``4 * Hm * Pm * N`` FLOPs per token (state update ``h = a*h + B x``
  and read-out ``C h``; the chunked scan's intra-chunk work is not counted).
- MoE blocks are priced as two parts (``blocks/moe.moe_parts``: routed, shared), each its own
  roofline ``max``, as they run as separate kernels (``analytic_table``).
- outside the blocks: LM head ``2 * V * h * B`` FLOPs and ``V * h * b_w`` bytes per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autocompress_nemo.arch.counts import block_params
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MambaBlock, MoeBlock
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload

VERSION = "roofline-v1"


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct routed experts read by one decode step of ``B`` tokens, each picking ``k`` of ``E``
    uniformly: ``E * (1 - (1 - k/E)^B)`` (``k`` at ``B = 1``; tends to ``E`` as ``B*k/E`` grows)."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


class RooflineEngine(Engine):
    name = "roofline"
    estimated = True

    def __init__(self, cfg: Any, hardware: Any = None) -> None:
        super().__init__(cfg, hardware)
        peak = float(getattr(hardware, "peak_tflops", 0.0) or 0.0)
        bw = float(getattr(hardware, "mem_bandwidth_gbs", 0.0) or 0.0)
        if peak <= 0 or bw <= 0:
            raise ValueError(
                f"roofline estimate needs hardware.peak_tflops and hardware.mem_bandwidth_gbs "
                f"(hardware {getattr(hardware, 'name', '?')!r} has {peak} TFLOP/s, {bw} GB/s); set them from the datasheet"
            )
        eff = float(self.settings.efficiency)
        self.flops_per_ms = peak * 1e12 * eff / 1e3
        self.bytes_per_ms = bw * 1e9 * eff / 1e3

    def version(self) -> str:
        return VERSION

    def _t(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_ms, nbytes / self.bytes_per_ms)

    def block_ms(self, b: Block, hidden: int, wl: Workload) -> tuple[float, float]:
        """(prefill_ms, decode_ms) of one block (0 when removed)."""
        if b.removed:
            return 0.0, 0.0
        bw = mem.bytes_per_element(str(self.cfg.dtype))
        bkv = mem.bytes_per_element(str(self.cfg.kv_dtype))
        c = self.decode_context(wl)
        active = block_params(b, hidden, active=True)
        pf_flops, pf_bytes = 2.0 * active * wl.batch * wl.input_len, block_params(b, hidden) * bw
        dc_flops = 2.0 * active * wl.batch
        dc_bytes = active * bw
        if isinstance(b, MoeBlock) and b.num_experts:
            touched = expected_experts_touched(b.num_experts, b.top_k, wl.batch)
            dc_bytes = (
                block_params(b, hidden, active=True)
                + (touched - b.top_k)
                * (block_params(b, hidden) - block_params(b, hidden, active=True))
                / max(1, b.num_experts - b.top_k)
            ) * bw
        if isinstance(b, AttentionBlock):
            hd = b.num_heads * b.head_dim
            pf_flops += 2.0 * hd * wl.batch * wl.input_len**2
            pf_bytes += 2 * b.num_kv_groups * b.head_dim * wl.batch * wl.input_len * bkv
            dc_flops += 4.0 * hd * wl.batch * c
            dc_bytes += 2 * b.num_kv_groups * b.head_dim * wl.batch * c * bkv
        if isinstance(b, MambaBlock):
            dc_bytes += 2 * mem.block_state_bytes(b, wl.batch, "f32")
            scan = 4.0 * b.num_heads * b.head_dim * b.state_size  # per token: h = a*h + B x, y = C h
            pf_flops += scan * wl.batch * wl.input_len
            dc_flops += scan * wl.batch
        return self._t(pf_flops, pf_bytes), self._t(dc_flops, dc_bytes)

    def outside_ms(self, spec: ArchSpec, wl: Workload) -> tuple[float, float]:
        """(prefill_ms, decode_ms) of the LM head (logits of one token per sequence per phase)."""
        bw = mem.bytes_per_element(str(self.cfg.dtype))
        t = self._t(2.0 * spec.vocab * spec.hidden * wl.batch, spec.vocab * spec.hidden * bw)
        return t, t

    def measure(self, spec: ArchSpec, workload: Workload, weights: dict[str, np.ndarray] | None = None) -> Measurement:
        """Estimated (not measured) latency and memory of ``spec``."""
        self.require_servable(spec)
        pf, dc = self.outside_ms(spec, workload)
        for b in spec.blocks:
            p, d = self.block_ms(b, spec.hidden, workload)
            pf, dc = pf + p, dc + d
        dtype, kv = str(self.cfg.dtype), str(self.cfg.kv_dtype)
        tokens = self.settings.max_num_tokens or workload.input_len * workload.batch
        memory = {
            "weights": mem.weight_bytes(spec, dtype, norm_dtype=dtype),
            "kv": mem.kv_cache_bytes(spec, workload.context_len, workload.batch, kv),
            "state": mem.ssm_state_bytes(spec, workload.batch, "f32"),
            "compute": mem.workspace_estimate(spec, min(tokens, workload.input_len * workload.batch)),
            "output": float(mem.output_buffer_bytes(spec.vocab, workload.batch)),
        }
        return Measurement(
            prefill_ms=pf, decode_ms=dc, memory=memory, raw={"prefill_ms": [pf], "decode_ms": [dc]}, estimated=True
        )


def analytic_table(engine: RooflineEngine, parent: ArchSpec, workload: Workload, options: list[Block]) -> Any:
    """A cost table straight from the analytic model (no profiling runs: the roofline is additive by
    construction): one entry per distinct block option among ``options`` and the parent's blocks,
    MoE blocks as their two parts (``blocks/moe.moe_parts``). Intercept = the LM head; no per-layer
    overhead; workspace = ``memory.workspace_estimate`` at the prefill tokens (a constant).
    Provenance says ``estimated: true`` and the label "estimated, not measured"."""
    from autocompress_nemo.blocks import kind_of
    from autocompress_nemo.costs.table import CostTable, expected_settings, make_provenance

    seen: dict[Block, dict[str, Any]] = {}
    for b in [*options, *parent.blocks]:
        for p in kind_of(b).parts(b):
            if p.removed or p in seen:
                continue
            pf, dc = engine.block_ms(p, parent.hidden, workload)
            seen[p] = {"block": p.__dict__, "prefill_ms": pf, "decode_ms": dc, "source": "roofline"}
    pf, dc = engine.outside_ms(parent, workload)
    dtype = str(engine.cfg.dtype)
    tokens = engine.settings.max_num_tokens or workload.input_len * workload.batch
    work = mem.workspace_estimate(parent, min(tokens, workload.input_len * workload.batch))
    memory = {
        "output_bytes": float(mem.output_buffer_bytes(parent.vocab, workload.batch)),
        "compute_bytes": [],
        "compute_base_bytes": work,
        "compute_range": [work, work],
        "weights_overhead_bytes": 0.0,
        "kv_tokens": workload.context_len * workload.batch,
        "norm_dtype": dtype if mem.bytes_per_element(dtype) >= 2 else "bf16",
    }
    prov = make_provenance(
        {**engine.provenance(), "estimated": True},
        workload.__dict__,
        engine.decode_context(workload),
        expected_settings(engine.cfg),
        parent,
    )
    return CostTable(
        provenance=prov,
        parent=parent,
        intercept={"prefill_ms": pf, "decode_ms": dc},
        layer_overhead={"prefill_ms": 0.0, "decode_ms": 0.0},
        blocks=list(seen.values()),
        memory=memory,
    )

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
  experts touched by ``B`` tokens, ``min(E, B * k)``) + KV read ``2 * G * d * B * C * b_kv``
  + Mamba state read and written ``2 * state``.
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
        eff = float(self.setting("efficiency", 0.7))
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
        c = wl.decode_context(str(self.setting("decode_context", "mean")))
        active = block_params(b, hidden, active=True)
        pf_flops, pf_bytes = 2.0 * active * wl.batch * wl.input_len, block_params(b, hidden) * bw
        dc_flops = 2.0 * active * wl.batch
        dc_bytes = active * bw
        if isinstance(b, MoeBlock) and b.num_experts:
            touched = min(b.num_experts, wl.batch * b.top_k)
            dc_bytes = (block_params(b, hidden, active=True) + (touched - b.top_k) * (
                block_params(b, hidden) - block_params(b, hidden, active=True)) / max(1, b.num_experts - b.top_k)) * bw
        if isinstance(b, AttentionBlock):
            hd = b.num_heads * b.head_dim
            pf_flops += 2.0 * hd * wl.batch * wl.input_len ** 2
            pf_bytes += 2 * b.num_kv_groups * b.head_dim * wl.batch * wl.input_len * bkv
            dc_flops += 4.0 * hd * wl.batch * c
            dc_bytes += 2 * b.num_kv_groups * b.head_dim * wl.batch * c * bkv
        if isinstance(b, MambaBlock):
            dc_bytes += 2 * mem.block_state_bytes(b, wl.batch, "f32")
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
        tokens = int(self.setting("max_num_tokens", workload.input_len * workload.batch))
        memory = {
            "weights": mem.weight_bytes(spec, dtype, norm_dtype=dtype),
            "kv": mem.kv_cache_bytes(spec, workload.context_len, workload.batch, kv),
            "state": mem.ssm_state_bytes(spec, workload.batch, "f32"),
            "compute": mem.workspace_estimate(spec, min(tokens, workload.input_len * workload.batch)),
            "output": float(mem.output_buffer_bytes(spec.vocab, workload.batch)),
        }
        return Measurement(prefill_ms=pf, decode_ms=dc, memory=memory, raw={"prefill_ms": [pf], "decode_ms": [dc]},
                           estimated=True)

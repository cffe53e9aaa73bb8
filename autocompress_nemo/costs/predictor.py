"""Predictor: two faces over one cost table (DESIGN.md section 3).

Exact face: ``Predictor(table, target).predict(spec)`` -> latency per phase, response latency,
throughput, memory by part.

Differentiable face (for the router): every additive metric ``m`` is

    m(spec) = constant_cost(spec, m) + sum over blocks b of block_cost(b, m)

and for per-decision option probabilities ``p_dk`` the expected cost is

    E[m] = constant_cost(spec, m) + sum_d sum_k p_dk * block_cost(option_dk, m)

— linear in the probabilities, so the gradient w.r.t. ``p_dk`` is ``block_cost(option_dk, m)``.

Metrics (``B`` batch, ``I`` input length, ``O`` output length):

- ``prefill_ms`` = ``ttft_ms``: one prefill of ``I`` tokens x ``B``; time to first token.
- ``decode_ms`` = ``tpot_ms``: one decode step of ``B`` sequences at the decode context.
- ``response_latency_ms`` = ``ttft + O * tpot``.
- ``memory_bytes``: weights + KV at full context x ``B`` + SSM state + workspace + buffers;
  a block's share is its weights + its KV/state; workspace (a max over the layers, not a
  sum) and buffers are in ``constant_cost``.
- ``params``: parameter count.
- ``throughput_tps`` = ``1000 * B / decode_ms`` is not additive. A throughput budget
  ``>= X tok/s`` is the equivalent per-step time budget ``decode_ms <= 1000 * B / X``;
  ``resolve_budget`` performs that conversion, so the router only sees additive costs.
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.counts import block_params, embedding_params
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.costs import memory as mem
from autocompress_nemo.costs.gguf_types import is_quantized
from autocompress_nemo.costs.table import CostTable

ADDITIVE = ("prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "response_latency_ms", "memory_bytes", "params")
LOWER_IS_BETTER = (*ADDITIVE,)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


class Predictor:
    """Predict costs of ArchSpecs from a cost table for one target (the target's ``workload``
    and ``engine`` sections give batch, lengths and dtypes)."""

    def __init__(self, table: CostTable, target: Any = None) -> None:
        self.table = table
        wl = table.provenance["workload"]
        self.batch = int(wl["batch"])
        self.input_len = int(wl["input_len"])
        self.output_len = int(wl["output_len"])
        self.context_len = int(wl["context_len"])
        eng = _get(target, "engine") if target is not None else None
        self.dtype = str(_get(eng, "dtype", None) or table.provenance.get("dtype", "f16"))
        self.kv_dtype = str(_get(eng, "kv_dtype", None) or table.provenance.get("kv_dtype", "f16"))
        self.norm_dtype = str(table.memory.get("norm_dtype", "f32"))
        self.state_dtype = "f32"
        self.conv_extra = int(table.memory.get("conv_extra", 0))  # engine's extra conv-state columns
        # KV tokens at full context and batch as the engine allocates them (padding included)
        self.kv_tokens = int(table.memory.get("kv_tokens", self.context_len * self.batch))
        self.runtime_per_weight = float(table.memory.get("runtime_per_weight_byte", 0.0))  # vLLM on CPU

    @property
    def estimated(self) -> bool:
        return self.table.estimated

    # -- additive pieces --------------------------------------------------------------
    def block_cost(self, block: Block, metric: str) -> float:
        """The additive contribution of one block option to ``metric`` (see module docstring)."""
        if metric in ("prefill_ms", "ttft_ms"):
            return self.table.block_latency(block, "prefill_ms")
        if metric in ("decode_ms", "tpot_ms"):
            return self.table.block_latency(block, "decode_ms")
        if metric == "response_latency_ms":
            return self.table.block_latency(block, "prefill_ms") + self.output_len * self.table.block_latency(
                block, "decode_ms"
            )
        if metric == "memory_bytes":
            return (
                (1.0 + self.runtime_per_weight)
                * mem.block_weight_bytes(block, self.table.parent.hidden, self.dtype, self.norm_dtype)
                + mem.block_kv_bytes(block, self.kv_tokens, 1, self.kv_dtype)
                + mem.block_state_bytes(block, self.batch, self.state_dtype, self.conv_extra)
            )
        if metric == "params":
            return float(block_params(block, self.table.parent.hidden))
        raise ValueError(_metric_error(metric))

    def constant_cost(self, spec: ArchSpec, metric: str) -> float:
        """Everything outside the blocks: intercept + one empty-layer overhead per layer
        (latency), embedding/LM head weights + workspace + buffers (memory)."""
        n_layers = spec.num_layers
        lat = {
            p: self.table.intercept[p] + n_layers * self.table.layer_overhead[p] for p in ("prefill_ms", "decode_ms")
        }
        if metric in ("prefill_ms", "ttft_ms"):
            return lat["prefill_ms"]
        if metric in ("decode_ms", "tpot_ms"):
            return lat["decode_ms"]
        if metric == "response_latency_ms":
            return lat["prefill_ms"] + self.output_len * lat["decode_ms"]
        if metric == "memory_bytes":
            parts = self.memory_parts(spec)
            return (
                (1.0 + self.runtime_per_weight) * parts["weights_outside_blocks"]
                + parts["compute"]
                + float(self.table.memory.get("output_bytes", 0.0))
            )
        if metric == "params":
            return float(embedding_params(spec))
        raise ValueError(_metric_error(metric))

    def memory_parts(self, spec: ArchSpec) -> dict[str, float]:
        """Bytes by part: weights, kv, state, compute (workspace), output (buffers)."""
        m = self.table.memory
        outside = mem.embedding_weight_bytes(spec, self.dtype, self.norm_dtype) + float(
            m.get("weights_overhead_bytes", 0)
        )
        blocks_w = sum(mem.block_weight_bytes(b, spec.hidden, self.dtype, self.norm_dtype) for b in spec.blocks)
        if self.norm_dtype == "f32" and is_quantized(self.dtype) and spec.is_dense_layered():
            # a llama.cpp quantization: the whole file's bytes are exact (per-layer Q4_K_M types),
            # the per-block prices an average; the difference is counted outside the blocks
            exact = mem.weight_bytes(spec, self.dtype) + float(m.get("weights_overhead_bytes", 0))
            outside = exact - blocks_w
        return {
            "weights": outside + blocks_w,
            "weights_outside_blocks": outside,
            "kv": mem.kv_cache_bytes(spec, self.kv_tokens, 1, self.kv_dtype),
            "state": mem.ssm_state_bytes(spec, self.batch, self.state_dtype, self.conv_extra),
            "compute": self.table.compute_bytes(spec),
            # runtime buffers: a constant, plus (vLLM on CPU) a share of the weights (costs/profile/pairs.py)
            "output": float(m.get("output_bytes", 0.0)) + self.runtime_per_weight * (outside + blocks_w),
        }

    # -- exact face -------------------------------------------------------------------
    def cost(self, spec: ArchSpec, metric: str) -> float:
        return self.constant_cost(spec, metric) + sum(self.block_cost(b, metric) for b in spec.blocks)

    def predict(self, spec: ArchSpec) -> dict[str, Any]:
        """Every metric of ``spec``: prefill/ttft, decode/tpot, response latency, throughput, memory by part."""
        prefill = self.cost(spec, "prefill_ms")
        decode = self.cost(spec, "decode_ms")
        parts = self.memory_parts(spec)
        mem_parts = {k: parts[k] for k in ("weights", "kv", "state", "compute", "output")}
        return {
            "prefill_ms": prefill,
            "ttft_ms": prefill,
            "decode_ms": decode,
            "tpot_ms": decode,
            "response_latency_ms": prefill + self.output_len * decode,
            "throughput_tps": 1000.0 * self.batch / decode if decode > 0 else float("inf"),
            "memory_bytes": sum(mem_parts.values()),
            "memory": mem_parts,
            # upper bound: the largest workspace the engine reported for any probe
            "memory_bytes_max": sum(mem_parts.values())
            - mem_parts["compute"]
            + max(mem_parts["compute"], float((self.table.memory.get("compute_range") or [0, 0])[1])),
            "params": float(sum(block_params(b, spec.hidden) for b in spec.blocks) + embedding_params(spec)),
            "estimated": self.estimated,
            "label": self.table.label,
        }

    # -- differentiable face -----------------------------------------------------------
    def expected(
        self,
        options: list[list[Block]],
        probs: list[Any],
        spec: ArchSpec,
        metrics: tuple[str, ...] = ("prefill_ms", "decode_ms", "response_latency_ms", "memory_bytes"),
    ) -> dict[str, Any]:
        """``constant_cost(spec, m) + sum_d sum_k probs[d][k] * block_cost(options[d][k], m)`` per metric.

        ``spec``: the model whose blocks outside the decisions are fixed (typically the parent);
        its blocks are *not* added — pass ``fixed_blocks`` decisions as one-option lists if any
        block is outside the search. Returns torch scalars; gradients flow to ``probs``.
        """
        import torch

        if len(options) != len(probs):
            raise ValueError(f"expected(): {len(options)} decisions but {len(probs)} probability vectors")
        out: dict[str, Any] = {}
        for m in metrics:
            total = torch.zeros((), dtype=torch.float64)
            for opts, p in zip(options, probs, strict=True):
                if p.shape[-1] != len(opts):
                    raise ValueError(f"expected(): {len(opts)} options but probabilities of shape {tuple(p.shape)}")
                costs = torch.tensor([self.block_cost(b, m) for b in opts], dtype=torch.float64)
                total = total + (p.to(torch.float64) * costs).sum()
            out[m] = total + self.constant_cost(spec, m)
        return out


def _metric_error(metric: str) -> str:
    if metric == "throughput_tps":
        return (
            "throughput_tps is not additive over blocks; express it as the per-step time "
            "decode_ms = 1000 * batch / throughput (resolve_budget does this)"
        )
    return f"unknown metric {metric!r}; additive metrics: {ADDITIVE}"


def resolve_budget(budget: Any, parent: dict[str, Any], batch: int | None = None) -> dict[str, float]:
    """Absolute budget values per metric from ``target.budget`` (a BudgetConfig or its constraints list).

    ``"0.6x"`` means 0.6 times the parent's value of the same metric, where ``parent`` is the
    parent's prediction or measurement made the same way (``Predictor.predict`` output or
    a validation row). A throughput constraint ``T`` (tok/s, higher is better) becomes the
    per-step time ``decode_ms <= 1000 * batch / T`` (``"1.5x"`` throughput: ``decode_ms <=
    parent_decode_ms / 1.5``); if a decode_ms budget is also given the tighter one wins.
    """
    constraints = _get(budget, "constraints", budget) or []
    b = int(batch or parent.get("batch", 1) or 1)
    out: dict[str, float] = {}
    from autocompress_nemo.config.resolve import parse_budget

    for c in constraints:
        metric, value = str(_get(c, "metric")), _get(c, "value")
        parsed = parse_budget(metric, value)  # the one budget parser: numbers, '0.6x', '12GB', '40ms'
        rel = parsed.is_relative
        num = float(parsed.relative if rel else parsed.absolute)  # type: ignore[arg-type]
        if metric == "throughput_tps":
            if rel:
                if "decode_ms" not in parent:
                    raise ValueError("budget throughput_tps relative to the parent needs the parent's decode_ms")
                v = float(parent["decode_ms"]) / num
            else:
                v = 1000.0 * b / num
            metric, absval = "decode_ms", v
        else:
            if rel and metric not in parent:
                raise ValueError(
                    f"budget {metric}: relative value {value!r} needs the parent's {metric}; "
                    f"the parent's figures have {sorted(k for k in parent if not k.startswith('_'))}"
                )
            absval = num * float(parent[metric]) if rel else num
            if metric == "tpot_ms":
                metric = "decode_ms"
            if metric == "ttft_ms":
                metric = "prefill_ms"
        if metric not in ADDITIVE:
            raise ValueError(_metric_error(metric))
        out[metric] = min(out.get(metric, float("inf")), absval)
    return out

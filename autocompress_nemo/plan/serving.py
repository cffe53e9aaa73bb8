"""Serving-side figures for the dry run: memory at the target's context, the budget-sized
student, the smallest model of the search space, and which budget constraints a plan can check.

Memory formulas come from ``costs/memory.py`` (weights, KV cache, SSM state, workspace,
buffers) and counts from ``arch/counts.py``; the workspace is an uncalibrated estimate
(estimated, not measured) until the engine's cost table calibrates it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autocompress_nemo.arch import counts
from autocompress_nemo.arch.spec import ArchSpec, Block, MlpBlock, MoeBlock
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.config.engine import EngineCapabilities, capabilities_of, settings_of
from autocompress_nemo.costs import memory
from autocompress_nemo.costs.engines.trtllm import MAX_NUM_TOKENS

EXPERT_ALIGN = 8
"""The budget-sized student keeps a multiple of 8 routed experts per block, so EP=8 divides it."""
CHECKABLE = ("memory_bytes", "params")


def serving_memory(spec: ArchSpec, target: Any) -> dict[str, Any]:
    """Serving memory at the workload's full context ``C`` and batch ``B`` (bytes), by part,
    from ``costs/memory.py`` (the formulas live there):
    ``weights`` (engine dtype; GPU engines keep norms in the same dtype), ``kv_cache``
    (``kv_dtype``), ``ssm_state`` (``engine.settings.ssm_cache_dtype``, default ``kv_dtype``),
    ``workspace`` (uncalibrated estimate over ``min(max_num_tokens, B*C)`` tokens; ``max_num_tokens``
    0 = TensorRT-LLM's default 8192) and
    ``buffers`` (fp32 logits of B sequences)."""
    eng, wl = target.engine, target.workload
    ctx, batch = int(wl.context_len), int(wl.batch)
    settings = settings_of(eng.settings)
    dtype, kv = str(eng.dtype), str(eng.kv_dtype)
    state = settings.ssm_cache_dtype or kv
    tokens = min(settings.max_num_tokens or MAX_NUM_TOKENS, ctx * batch)
    out: dict[str, Any] = {
        "weights": memory.weight_bytes(spec, dtype, norm_dtype=dtype),
        "kv_cache": memory.kv_cache_bytes(spec, ctx, batch, kv),
        "ssm_state": memory.ssm_state_bytes(spec, batch, state),
        "workspace": memory.workspace_estimate(spec, tokens),
        "buffers": float(memory.output_buffer_bytes(spec.vocab, batch)),
    }
    out["total"] = sum(out.values())
    out["label"] = "estimated, not measured"
    return out


def _limit(value: Any, parent_value: float, metric: str = "memory_bytes") -> float:
    """A budget value (a number, ``"0.6x"`` relative to the parent measured the same way, or a
    quantity with a unit such as ``"180GB"``), through the one budget parser."""
    from autocompress_nemo.config.resolve import parse_budget

    return parse_budget(metric, value).limit(parent_value)


def _constraints(target: Any) -> list[tuple[str, Any]]:
    return [(str(c.metric), c.value) for c in target.budget.constraints]


def meets(
    spec: ArchSpec, serving: dict[str, Any], parent: ArchSpec, parent_serving: dict[str, Any], target: Any
) -> bool:
    """True when ``spec`` meets every memory / parameter constraint of the target's budget."""
    for metric, value in _constraints(target):
        if metric == "memory_bytes" and serving["total"] > _limit(value, parent_serving["total"]):
            return False
        if metric == "params" and counts.param_count(spec) > _limit(value, counts.param_count(parent), "params"):
            return False
    return True


def check_budget(
    smallest: ArchSpec, smallest_serving: dict[str, Any], parent: ArchSpec, parent_serving: dict[str, Any], target: Any
) -> dict[str, Any]:
    """Is the budget reachable within the search space? The smallest servable model must meet
    every constraint a plan can check (memory, parameters); latency and throughput need the
    engine's cost table and are listed as not checked."""
    checks, ok = [], True
    for metric, value in _constraints(target):
        if metric == "memory_bytes":
            lim = _limit(value, parent_serving["total"])
            good = smallest_serving["total"] <= lim
            checks.append(
                f"memory_bytes <= {lim / 1e9:,.2f} GB: smallest model needs {smallest_serving['total'] / 1e9:,.2f} GB "
                f"({'reachable' if good else 'NOT reachable'}; parent {parent_serving['total'] / 1e9:,.2f} GB)"
            )
        elif metric == "params":
            lim = _limit(value, counts.param_count(parent), "params")
            good = counts.param_count(smallest) <= lim
            checks.append(
                f"params <= {lim / 1e9:,.2f} B: smallest model has {counts.param_count(smallest) / 1e9:,.2f} B "
                f"({'reachable' if good else 'NOT reachable'})"
            )
        else:
            checks.append(
                f"{metric} <= {value}: not checked in a dry run (needs the engine's cost table: "
                "python -m autocompress_nemo.profile)"
            )
            continue
        ok = ok and good
    return {"ok": ok, "checks": checks}


def _with_experts(parent: ArchSpec, n: int) -> ArchSpec:
    spec = parent
    for i, b in enumerate(parent.blocks):
        if isinstance(b, MoeBlock) and not b.removed and b.num_experts:
            spec = spec.replace_block(
                i, MoeBlock(n, b.expert_ffn, min(b.top_k, n), b.shared_ffn, b.latent, b.activation)
            )
    return spec


def _with_ffn(parent: ArchSpec, f: int) -> ArchSpec:
    spec = parent
    for i, b in enumerate(parent.blocks):
        if isinstance(b, MlpBlock) and not b.removed:
            spec = spec.replace_block(i, MlpBlock(f, b.activation))
    return spec


def budget_student(
    parent: ArchSpec, target: Any, serve: Callable[[ArchSpec], dict[str, Any]]
) -> tuple[ArchSpec | None, str]:
    """A uniform student that just meets the memory / parameter budget, for planning only (the
    search picks per-block shapes). It shrinks the dimension the engine lets vary that holds
    most parameters: routed experts per MoE block (multiples of 8), else the dense ffn width
    (multiples of the engine's ffn alignment). Returns (None, reason) when none applies."""
    caps = capabilities_of(target.engine.capabilities).for_parent(parent)  # a hybrid's own override set
    parent_serving = serve(parent)
    if meets(parent, parent_serving, parent, parent_serving, target):
        return parent, "the parent already meets the memory/parameter budget; nothing must be cut for memory"
    moe = [b for b in parent.blocks if isinstance(b, MoeBlock) and not b.removed and b.num_experts]
    mlp = [b for b in parent.blocks if isinstance(b, MlpBlock) and not b.removed]
    if moe and caps.vary_experts:
        e0, k = moe[0].num_experts, max(b.top_k for b in moe)
        options = [n for n in range(e0 - e0 % EXPERT_ALIGN, max(k, 1) - 1, -EXPERT_ALIGN) if n >= k]
        for n in options:
            s = _with_experts(parent, n)
            if meets(s, serve(s), parent, parent_serving, target):
                p0, p1 = counts.param_count(parent), counts.param_count(s)
                return s, (
                    f"keep {n} of {e0} routed experts in each of the {len(moe)} MoE blocks "
                    f"({(p0 - p1) / 1e9:,.2f} B parameters cut, {p1 / 1e9:,.2f} B left; attention, "
                    f"Mamba and shared experts untouched)"
                )
        return None, f"even {k} routed experts per MoE block (top-k) do not meet the budget"
    if mlp and caps.vary_ffn:
        f0, align = mlp[0].ffn, max(caps.ffn_align, 1)
        for f in range(f0 - f0 % align, 0, -align):
            s = _with_ffn(parent, f)
            if meets(s, serve(s), parent, parent_serving, target):
                return s, f"ffn width {f} of {f0} in each of the {len(mlp)} MLP blocks"
        return None, f"no ffn width (multiples of {align}) meets the budget"
    return None, "the engine cannot vary routed experts or ffn widths; no uniform student estimated"


def _min_block(b: Block, caps: EngineCapabilities) -> Block:
    """The smallest shape of one block that the engine's capabilities let the search reach."""
    return b if b.removed else kind_of(b).min_block(b, caps)


def smallest_servable(parent: ArchSpec, caps: Any) -> ArchSpec:
    """The smallest model of the search space: the search's own space where it covers the model
    (``search/space.py``), else every block at the minimum the engine's capabilities allow
    (first / last block kept full where the engine requires it)."""
    caps = capabilities_of(caps).for_parent(parent)
    try:
        from autocompress_nemo.search.space import apply_choices, build_space

        decisions = build_space(parent, caps)
        return apply_choices(parent, decisions, [0] * len(decisions))
    except (ImportError, ValueError):
        pass
    n = len(parent.blocks)
    spec = parent
    for i, b in enumerate(parent.blocks):
        if (i == 0 and caps.first_block_full) or (i == n - 1 and caps.last_block_full):
            continue
        spec = spec.replace_block(i, _min_block(b, caps))
    return spec

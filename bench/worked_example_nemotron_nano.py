"""Issue-6 worked example: what the cost model says about shrinking Nemotron 3 Nano's shared expert
vs its routed experts at the ``rtx5080_coding`` budget. Prints JSON.

Everything here is **estimated, not measured**: no GPU, no engine run. The cost table is the
analytic roofline (``costs/engines/roofline.analytic_table``) for the target's hardware (RTX 5080:
225 TFLOP/s BF16 dense, 960 GB/s), engine dtype (NVFP4 weights, FP8 KV) and workload (batch 1,
31744-token prompt, 1024-token answer, 32K context); the search space is the one TensorRT-LLM
can serve (``engine.capabilities`` of ``rtx5080_coding``), minus top-k (see below).

No weights exist here, so there is no router search (it needs distillation gradients). The
decision logic is the extraction stage's: start from the parent, ``extract.repair.repair``
(give up what loses least importance per unit of normalized cost saved on the violated
budgets) and ``extract.repair.grow``, against the exact predictor, with an importance *proxy*
in place of activation scores. Two proxies, both reported:

- ``params``: a unit's importance is proportional to its parameters (every weight equal);
- ``routing_mass``: parameters times the share of tokens the unit processes under uniform
  routing (``k/E`` for a routed expert's weights, 1 for the shared expert and other blocks) —
  the scale the activation-based scores of ``rank/importance.py`` (routing mass x output) have.

Each proxy runs on the full space (attention / Mamba block removal included, as TensorRT-LLM can
serve it) and on the MoE decisions alone (``moe_only``: attention and Mamba blocks kept), which
isolates the routed-vs-shared question.

Top-k is held at the parent's: neither proxy can price what a smaller top-k loses (it removes
no parameters); its cost figure is still printed.

Run: ``python bench/worked_example_nemotron_nano.py`` (a few seconds).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from functools import cache
from typing import Any

from autocompress_nemo.arch.counts import block_params, param_count
from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec, Block, MoeBlock
from autocompress_nemo.config.entry import compose
from autocompress_nemo.costs.engines.base import Workload
from autocompress_nemo.costs.engines.roofline import RooflineEngine, analytic_table
from autocompress_nemo.costs.predictor import Predictor, resolve_budget
from autocompress_nemo.extract.repair import grow, repair
from autocompress_nemo.search.space import apply_choices, build_space

METRICS = ("response_latency_ms", "memory_bytes", "prefill_ms", "decode_ms")


def fast_predict(pred: Predictor, parent: ArchSpec):  # noqa: ANN201
    """``Predictor.cost`` for the budget metrics with per-block costs memoized (the same sums)."""

    @cache
    def bc(b: Block, m: str) -> float:
        return pred.block_cost(b, m)

    const = {m: pred.constant_cost(parent, m) for m in METRICS}

    def predict(spec: ArchSpec) -> dict[str, float]:
        return {m: const[m] + sum(bc(b, m) for b in spec.blocks) for m in METRICS}

    return predict, bc


def importance_rows(parent: ArchSpec, decisions: list, proxy: str) -> list[list[float]]:
    h = parent.hidden

    def imp(d: Any, o: Block) -> float:
        p = float(block_params(o, h))
        if proxy == "routing_mass" and d.kind == "moe_routed" and isinstance(o, MoeBlock) and o.num_experts:
            return float(block_params(o, h, active=True))  # k/E of each routed expert's weights
        return p

    return [[imp(d, o) for o in d.options] for d in decisions]


def unit_blocks(moe: MoeBlock) -> dict[str, MoeBlock]:
    """The parent MoE block's parts with one unit less of each dimension (priced by the same table)."""
    from autocompress_nemo.blocks.moe import moe_parts

    routed, shared = moe_parts(moe)
    return {
        "expert": dataclasses.replace(routed, num_experts=moe.num_experts - 1),
        "expert_neuron": dataclasses.replace(routed, expert_ffn=moe.expert_ffn - 1),
        "top_k": dataclasses.replace(routed, top_k=moe.top_k - 1),
        "shared_neuron": dataclasses.replace(shared, shared_ffn=moe.shared_ffn - 1),
        "no_shared": dataclasses.replace(shared, shared_ffn=0),
    }


def unit_costs(bc: Any, parent_moe: MoeBlock, h: int) -> dict[str, Any]:
    """Cost saved by removing one unit of each MoE dimension from the parent block (finite differences)."""
    from autocompress_nemo.blocks.moe import moe_parts

    routed, shared = moe_parts(parent_moe)

    def diff(a: Block, b: Block) -> dict[str, float]:
        return {
            "ms_response": bc(a, "response_latency_ms") - bc(b, "response_latency_ms"),
            "ms_per_decode_step": bc(a, "decode_ms") - bc(b, "decode_ms"),
            "ms_prefill": bc(a, "prefill_ms") - bc(b, "prefill_ms"),
            "bytes": bc(a, "memory_bytes") - bc(b, "memory_bytes"),
            "params": block_params(a, h) - block_params(b, h),
        }

    u = unit_blocks(parent_moe)
    one_expert, expert_neuron = diff(routed, u["expert"]), diff(routed, u["expert_neuron"])
    shared_neuron, topk = diff(shared, u["shared_neuron"]), diff(routed, u["top_k"])
    whole_shared = diff(shared, u["no_shared"])
    # compare at equal parameters: one routed expert vs the same number of shared-expert parameters
    n_eq = one_expert["params"] / max(shared_neuron["params"], 1)
    eq = {k: v * n_eq for k, v in shared_neuron.items()}
    return {
        "one_routed_expert": one_expert,
        "one_routed_expert_ffn_neuron_all_experts": expert_neuron,
        "one_shared_expert_neuron": shared_neuron,
        "whole_shared_expert": whole_shared,
        "top_k_minus_one": topk,
        "shared_neurons_with_one_experts_params": {"neurons": n_eq, **eq},
        "per_million_params": {
            "routed_expert": {k: v / one_expert["params"] * 1e6 for k, v in one_expert.items() if k != "params"},
            "shared_expert": {k: v / shared_neuron["params"] * 1e6 for k, v in shared_neuron.items() if k != "params"},
        },
    }


def run(
    proxy: str, space: str, parent: ArchSpec, decisions: list, predict: Any, budgets: dict[str, float]
) -> dict[str, Any]:
    if space == "moe_only":
        decisions = [d for d in decisions if d.kind.startswith("moe")]
    imp = importance_rows(parent, decisions, proxy)
    start = [d.parent_option for d in decisions]
    log: list[str] = []
    try:
        choices, n_rep = repair(parent, decisions, start, predict, budgets, imp, log=log.append)
    except ValueError as e:
        return {"importance_proxy": proxy, "space": space, "infeasible": str(e)}
    choices, n_grow = grow(parent, decisions, choices, predict, budgets, imp, threshold=0.02, log=log.append)
    child = apply_choices(parent, decisions, choices)
    c = predict(child)
    per_moe = []
    for i, (pb, cb) in enumerate(zip(parent.blocks, child.blocks, strict=True)):
        if isinstance(pb, MoeBlock):
            assert isinstance(cb, MoeBlock)
            per_moe.append(
                {
                    "block": i,
                    "routed_experts_kept": cb.num_experts,
                    "of": pb.num_experts,
                    "expert_ffn": cb.expert_ffn,
                    "top_k": cb.top_k,
                    "shared_ffn_kept": cb.shared_ffn,
                    "shared_of": pb.shared_ffn,
                }
            )
    kinds: dict[str, int] = {}
    for line in log:
        i = int(line.split("decision ")[1].split(" ")[0])
        kinds[f"{line.split(':')[0]}_{decisions[i].kind}"] = (
            kinds.get(f"{line.split(':')[0]}_{decisions[i].kind}", 0) + 1
        )
    return {
        "importance_proxy": proxy,
        "space": space,
        "repair_steps": n_rep,
        "grow_steps": n_grow,
        "steps_by_kind": kinds,
        "child_pattern": child.pattern,
        "child_params": param_count(child),
        "predicted": {m: c[m] for m in METRICS},
        "budgets": budgets,
        "meets_budget": all(c[m] <= b * (1 + 1e-9) for m, b in budgets.items()),
        "shared_expert_full_in_blocks": sum(1 for r in per_moe if r["shared_ffn_kept"] == r["shared_of"]),
        "moe_blocks": len(per_moe),
        "per_moe_block": per_moe,
    }


def main() -> None:
    cfg = compose(["+target=rtx5080_coding", "model=nemotron3_nano", "dry_run=true"])
    parent = spec_from_model_config(cfg.model)
    target = cfg.target
    engine = RooflineEngine(target.engine, target.hardware)  # the trtllm target's dtypes, the analytic model
    wl = Workload.from_config(target.workload)
    caps = {**dict(target.engine.capabilities), "vary_top_k": False}
    decisions = build_space(parent, caps)
    moe = next(b for b in parent.blocks if isinstance(b, MoeBlock))
    options = [o for d in decisions for o in d.options] + list(unit_blocks(moe).values())
    table = analytic_table(engine, parent, wl, options)
    pred = Predictor(table, target)
    predict, bc = fast_predict(pred, parent)
    parent_cost = {**pred.predict(parent), "batch": wl.batch}
    budgets = resolve_budget(target.budget, parent_cost, wl.batch)
    out = {
        "label": table.label,
        "note": "estimated, not measured: analytic roofline (no GPU, no engine run); decisions by repair/grow "
        "with an importance proxy, not by the router (no weights)",
        "model": parent.name,
        "target": target.name,
        "engine_capabilities_used": {k: caps[k] for k in sorted(caps) if k.startswith(("vary", "remove"))},
        "workload": dataclasses.asdict(wl),
        "dtype": str(target.engine.dtype),
        "kv_dtype": str(target.engine.kv_dtype),
        "parent": {
            "params": param_count(parent),
            **{m: parent_cost[m] for m in METRICS},
            "memory_parts": parent_cost["memory"],
        },
        "budgets": budgets,
        "decisions": {k: sum(1 for d in decisions if d.kind == k) for k in sorted({d.kind for d in decisions})},
        "unit_costs_per_moe_block": unit_costs(bc, moe, parent.hidden),
        "runs": [
            run(p, sp, parent, decisions, predict, budgets)
            for sp in ("full", "moe_only")
            for p in ("params", "routing_mass")
        ],
    }
    json.dump(out, sys.stdout, indent=1, default=float)
    print()


if __name__ == "__main__":
    main()

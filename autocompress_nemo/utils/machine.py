"""This machine's float32 matmul rate, the denominator of every FLOP bound the benchmarks print
(``bench/bench_pipeline.py``, ``bench/bench_local.py``): the best of ``repeats`` timed products after
three untimed ones (on a shared machine load only adds time, so the best is the stable statistic)."""

from __future__ import annotations

import time
from typing import Any


def matmul_flops_per_s(rows: int, k: int, n: int, repeats: int = 10) -> float:
    """FLOP/s of ``[rows, k] x [k, n]`` in float32 on the CPU (or the default device's torch)."""
    import torch

    x, w = torch.randn(rows, k), torch.randn(k, n)
    for _ in range(3):
        x @ w
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t)
    return 2 * rows * k * n / best


def ffn_matmul_flops_per_s(spec: Any, rows: int, repeats: int = 10) -> float:
    """The rate on a model's own widest MLP shape, ``[rows, hidden] x [hidden, ffn]``."""
    ffn = max((getattr(b, "ffn", 0) or 0) for b in spec.blocks) or 4 * spec.hidden
    return matmul_flops_per_s(rows, spec.hidden, ffn, repeats)

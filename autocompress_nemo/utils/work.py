"""The arithmetic a stage did, counted where it is done: ``add(flops)`` from the stage's code (the
trainer, rank's hooked forward); the runner reads :func:`taken` around each stage and records it as
``flops`` (``record.json``), so ``bench/bench_pipeline.py`` can set each compute stage's seconds
against its FLOP bound at the machine's measured matmul rate. Counted on this process (rank 0's share
under data parallelism)."""

from __future__ import annotations

_TOTAL = [0.0]


def add(flops: float) -> None:
    _TOTAL[0] += float(flops)


def taken() -> float:
    """FLOPs counted so far in this process."""
    return _TOTAL[0]

"""Packing a token stream into fixed-length sequences, and a seeded, resumable batch order.

Legend: B = batch size, T = sequence length (``seq_len``).

Sequence ``i`` is ``tokens[i*T : i*T + T + 1]``: T inputs and, shifted by one, T labels (the
last token of one sequence is the first of the next). A stream of N tokens gives
``(N - 1) // T`` sequences; the tail that does not fill one is dropped.

The batch order is a pure function of ``(seed, step)``: epoch ``e = step // steps_per_epoch``
uses the permutation drawn from ``numpy.random.default_rng([seed, e])``, so a run resumed at
``start_step`` sees exactly the batches an uninterrupted run would (distillation resume),
with no replay. With data parallelism each rank takes its contiguous slice of the same global
batch, so the global batch does not depend on how many ranks there are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    step: int
    tokens_BT1: np.ndarray
    """int64 [B, T+1]: inputs are ``[:, :-1]``, labels ``[:, 1:]``."""

    @property
    def inputs_BT(self) -> np.ndarray:
        return self.tokens_BT1[:, :-1]

    @property
    def labels_BT(self) -> np.ndarray:
        return self.tokens_BT1[:, 1:]


class PackedDataset:
    """Fixed-length sequences over one token stream (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens = np.asarray(tokens)
        self.seq_len = int(seq_len)
        self._n = max(0, (len(self.tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        """int64 [T+1] of sequence ``i``."""
        if not -self._n <= i < self._n:
            raise IndexError(f"sequence {i} out of range (0..{self._n - 1})")
        i %= self._n
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        """int64 [len(indices), T+1]."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        return self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]].astype(np.int64)

    def steps_per_epoch(self, batch_size: int) -> int:
        """Whole batches in one pass (the incomplete last batch of an epoch is dropped)."""
        return len(self) // batch_size

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The permutation of sequence indices used in ``epoch``."""
        return np.random.default_rng([int(seed), int(epoch)]).permutation(len(self))

    def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """Sequence indices of global batch ``step``."""
        per_epoch = self.steps_per_epoch(batch_size)
        if per_epoch == 0:
            raise ValueError(
                f"{len(self)} sequences of {self.seq_len} tokens do not fill one batch of {batch_size}; "
                "use more text, a shorter seq_len or a smaller batch"
            )
        epoch, k = divmod(int(step), per_epoch)
        return self.epoch_order(seed, epoch)[k * batch_size : (k + 1) * batch_size]

    def batches(
        self,
        batch_size: int,
        seed: int,
        start_step: int = 0,
        num_steps: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> Iterator[Batch]:
        """Batches ``start_step, start_step + 1, ...`` (forever when ``num_steps`` is None).

        ``batch_size`` is the global batch; rank ``dp_rank`` of ``dp_size`` gets rows
        ``[dp_rank * B/dp_size, (dp_rank + 1) * B/dp_size)`` of it.
        """
        if batch_size % dp_size:
            raise ValueError(f"global batch {batch_size} is not divisible by the data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in 0..{dp_size - 1}")
        local = batch_size // dp_size
        step = int(start_step)
        end = None if num_steps is None else step + int(num_steps)
        while end is None or step < end:
            idx = self.batch_indices(step, batch_size, seed)[dp_rank * local : (dp_rank + 1) * local]
            yield Batch(step, self.sequences(idx))
            step += 1

    def first(self, count: int) -> np.ndarray:
        """int64 [count, T+1]: the first ``count`` sequences in stream order (evaluation, fixed)."""
        count = min(count, len(self))
        return self.sequences(np.arange(count))

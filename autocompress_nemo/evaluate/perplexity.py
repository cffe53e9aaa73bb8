"""Perplexity on held-out token batches.

Legend: B batch, T tokens, V vocab.

``perplexity = exp(NLL / N)`` where ``NLL = -sum log q(x_{t+1} | x_{<=t})`` over every
predicted position of every sequence (the first token of each sequence is context only)
and ``N`` is the number of predicted tokens, ``sum_b (T_b - 1)``: the token-weighted mean
cross entropy, not a mean of per-batch perplexities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@torch.no_grad()
def nll_sum(model: torch.nn.Module, forward: Forward, token_batches: Iterable[torch.Tensor]) -> tuple[float, int]:
    """``(NLL summed over predicted tokens, number of predicted tokens)`` in float64."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for ids_BT in token_batches:
            if ids_BT.dim() != 2 or ids_BT.shape[1] < 2:
                raise ValueError(f"perplexity needs token batches [B, T] with T >= 2, got {tuple(ids_BT.shape)}")
            logits_BTV = forward(model, ids_BT)
            target = ids_BT[:, 1:].to(logits_BTV.device).reshape(-1)
            pred = logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]).float()
            total += float(F.cross_entropy(pred, target, reduction="sum").double())
            count += int(target.numel())
    finally:
        model.train(was_training)
    return total, count


def perplexity(model: torch.nn.Module, forward: Forward, token_batches: Iterable[torch.Tensor]) -> float:
    """``exp(sum NLL / predicted tokens)`` of ``model`` on ``token_batches`` (module docstring)."""
    total, count = nll_sum(model, forward, token_batches)
    if count == 0:
        raise ValueError("perplexity: no tokens (the held-out batches are empty)")
    return math.exp(total / count)

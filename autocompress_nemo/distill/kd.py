"""Knowledge-distillation loss and a small training loop shared by search, Minitron++ and recovery.

Legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from autocompress_nemo.distill.optim import Parallel, reduce_gradients

KD_CHUNK_TOKENS = 64
"""Tokens per chunk of the fused KD loss (a chunk's softmaxes are ``chunk x V`` floats)."""


class _FusedKD(torch.autograd.Function):
    """Forward KL on softened logits with its gradient computed in the same pass, in token chunks.

    ``d/dz_s [T^2/N sum_t KL(p_t || q_t)] = (T/N) (q - p)``, so the forward keeps only that
    gradient (one ``[N, V]`` tensor in the student logits' dtype) instead of autograd's
    ``log_softmax`` / ``exp`` / product intermediates over the whole batch, and the backward is a
    scale. Same value and gradient as the textbook form (``kd_loss_reference``) to float rounding.
    """

    @staticmethod
    def forward(ctx: Any, s_NV: torch.Tensor, t_NV: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        n = s_NV.shape[0]
        want_grad = bool(ctx.needs_input_grad[0])
        grad_NV = torch.empty_like(s_NV) if want_grad else None
        total = torch.zeros((), dtype=torch.float64, device=s_NV.device)
        for i in range(0, n, chunk):
            log_q = F.log_softmax(s_NV[i : i + chunk].float() / temperature, dim=-1)
            log_p = F.log_softmax(t_NV[i : i + chunk].float() / temperature, dim=-1)
            p = log_p.exp()
            total += (p * (log_p - log_q)).sum(dtype=torch.float64)
            if grad_NV is not None:
                grad_NV[i : i + chunk] = log_q.exp_().sub_(p).mul_(temperature / n)
        ctx.save_for_backward(grad_NV if grad_NV is not None else s_NV.new_empty(0))
        return (total * (temperature * temperature / n)).to(torch.float32)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (grad_NV,) = ctx.saved_tensors
        return grad_NV * g.to(grad_NV.dtype), None, None, None


def kd_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = KD_CHUNK_TOKENS,
) -> torch.Tensor:
    """Forward KL(teacher || student) on softened logits, mean over tokens, scaled by T^2.

    ``T^2 * mean_t sum_v p_t(v) * (log p_t(v) - log q_t(v))`` with ``p = softmax(z_teacher/T)``,
    ``q = softmax(z_student/T)``. Computed by ``_FusedKD`` in chunks of ``chunk_tokens`` tokens
    (value and gradient equal ``kd_loss_reference``'s; tests/test_distill.py), float32 result.
    """
    if student_logits_BTV.shape != teacher_logits_BTV.shape:
        raise ValueError(
            f"kd_loss: student logits {tuple(student_logits_BTV.shape)} vs teacher {tuple(teacher_logits_BTV.shape)}; "
            "the two models must share the vocabulary and see the same tokens"
        )
    v = student_logits_BTV.shape[-1]
    return _FusedKD.apply(
        student_logits_BTV.reshape(-1, v),
        teacher_logits_BTV.detach().reshape(-1, v),
        float(temperature),
        max(1, int(chunk_tokens)),
    )


def kd_loss_reference(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The textbook form of ``kd_loss`` through autograd (the reference its tests compare with)."""
    t = temperature
    log_q = F.log_softmax(student_logits_BTV.float() / t, dim=-1)
    log_p = F.log_softmax(teacher_logits_BTV.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() * t * t


def lm_loss(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (mean over the B*(T-1) predicted tokens)."""
    return F.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]).float(), input_ids_BT[:, 1:].reshape(-1)
    )


def kd_train(
    student: torch.nn.Module,
    teacher_logits: Callable[[torch.Tensor], torch.Tensor],
    student_logits: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[torch.Tensor],
    lr: float,
    temperature: float = 1.0,
) -> list[float]:
    """Plain PyTorch KD steps (Adam) over ``batches``; returns the loss per step.

    Under torch.distributed every rank passes the same global batches: gradients are reduced as
    Megatron's DDP does (``optim.reduce_gradients``): replicated parameters averaged over
    data-parallel ranks (all equal here), EP-sharded experts — which saw every rank's copy of
    the batch — divided by the data-parallel size, so EP=2 follows the one-process run."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    par = Parallel.detect()
    losses = []
    for x in batches:
        with torch.no_grad():
            t = teacher_logits(x)
        loss = kd_loss(student_logits(x), t, temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if par.world > 1:
            reduce_gradients(params, par)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def hidden_state_loss(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor]) -> torch.Tensor:
    """Relative squared error between matched hidden states, per token, averaged.

    For each pair ``(h_s, h_t)`` (e.g. ``[T, B, H]``) and each token position:
    ``||h_s - h_t||^2 / ||h_t||^2`` over the hidden axis; the result is the mean over tokens
    and pairs. Relative, so layers whose residual stream has grown large do not dominate;
    per token, so it is a plain mean over tokens and splitting the batch (data parallel,
    micro-batches) gives the same loss and gradient.

    A pruned hidden size (``H_s < H_t``) is compared through the sliced projection: the
    student's residual channels are the sorted parent's first ``H_s`` (the rank stage orders
    them by importance and extraction keeps the leading ones), so ``h_t[..., :H_s]`` is the
    teacher's state in the student's basis.
    """
    if len(student_hidden) != len(teacher_hidden) or not student_hidden:
        raise ValueError(
            f"hidden_state_loss: {len(student_hidden)} student and {len(teacher_hidden)} teacher hidden states; "
            "need the same, non-zero number"
        )
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for h_s, h_t in zip(student_hidden, teacher_hidden, strict=True):
        if h_s.shape[:-1] != h_t.shape[:-1] or h_s.shape[-1] > h_t.shape[-1]:
            raise ValueError(
                f"hidden_state_loss: student hidden {tuple(h_s.shape)} vs teacher {tuple(h_t.shape)}; the "
                "intermediate loss needs the same tokens and a student hidden size at most the teacher's "
                "(set distill.intermediate_weight=0 otherwise)"
            )
        h_t = h_t[..., : h_s.shape[-1]].detach().float()
        err = (h_s.float() - h_t).pow(2).sum(-1) / h_t.pow(2).sum(-1).clamp_min(1e-12)
        total = total + err.mean()
    return total / len(student_hidden)

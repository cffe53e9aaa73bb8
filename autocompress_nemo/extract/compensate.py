"""Least-squares re-fit of a narrower child's output projections (``extract.refit: least_squares``).

Slicing keeps the sorted parent's weights on the channels a child keeps and drops the rest, so a
block that keeps neurons ``K`` of its MLP (or the query heads ``K`` of its attention) writes
``W[:, K] x_K`` where the parent wrote ``W x``. The dropped channels are correlated with the kept
ones, so most of what they wrote can be written by the kept channels with other weights: the
re-fit replaces the output projection's kept columns with

    V = argmin_V  sum_t ||W x_t - V x_{t,K}||^2 + r ||V - W[:, K]||^2
      = (W G[:, K] + r W[:, K]) (G[K, K] + r I)^-1,   G = sum_t x_t x_t^T,  r = ridge * mean(diag G[K, K]),

over the sorted parent's own inputs ``x_t`` on calibration tokens (the MLP down projection's input:
the activated neurons; attention's output projection's input: the per-head attention outputs).
Only ``G`` per re-fit block is kept (``F x F`` float64: ``F`` the projection's input width). It is
the closed-form layer-wise reconstruction of OBS / ZipLM-style structured pruning, applied to the
output projection only: the other weights stay the sliced parent's, so the child's function on
the kept channels' inputs is unchanged and only what the block writes back moves.

The ridge pulls the solution toward the plain slice, not toward zero: where the calibration
tokens leave a direction undetermined (correlated heads, rare neurons) the slice's weights stay.
Measured on SmolLM2's 0.45x students (docs/recovery.md): a ridge of 1e-3 toward zero fits the
8K calibration tokens but not held-out text, and gives weights up to 8x the slice's norm, which a
float16 GGUF then rounds into a failed export parity (max |d logit| 0.90 > 0.25); 0.03 toward
the slice gives the lowest held-out KD of those tried and at most 2x the slice's norm.

Each block's relative output error on the calibration tokens, ``sum_t ||W x_t - V x_{t,K}||^2 /
sum_t ||W x_t||^2``, is computed from ``G`` for the slice (``V = W[:, K]``) and the re-fit, so
the record says what the re-fit bought per block. Which kinds re-fit is the kind's (``refit`` /
``refit_site`` in ``blocks/``): attention and MLP; MoE experts and Mamba mixers are sliced only.

Parallelism: a row-parallel projection's input is sharded along the channels over TP; the hook
gathers it (Megatron's split order), so every rank holds the same ``G`` and the same re-fit.
Every rank runs the same calibration batches. Pipeline parallelism is refused (one stage's ranks
would not see the other stages' blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of

__all__ = ["collect_grams", "refit_blocks", "refit_state_dict"]


def refit_blocks(parent: ArchSpec, child: ArchSpec) -> dict[int, tuple[str, torch.Tensor]]:
    """``{block: (role, kept input channels)}`` of every block the child narrows and its kind re-fits."""
    out = {}
    for i, (p, c) in enumerate(zip(parent.blocks, child.blocks, strict=True)):
        if not c.removed and (r := kind_of(c).refit(p, c)) is not None:
            out[i] = r
    return out


@torch.no_grad()
def collect_grams(
    model: torch.nn.Module,
    parent: ArchSpec,
    blocks: Iterable[int],
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[dict[int, torch.Tensor], int]:
    """``({block: G}, tokens)``: the Gram matrix of each block's re-fit projection input over the
    sorted parent ``model``'s forward passes on ``batches`` (float64, on the model's device)."""
    from megatron.core import parallel_state as ps

    from autocompress_nemo.models.megatron import block_layers
    from autocompress_nemo.rank.hooks import Accumulator, cat_over, parallel_groups

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "extract.refit=least_squares runs the parent whole on every rank: run the extract stage with "
            "cluster.pp=1, or set extract.refit=none"
        )
    tp, group = parallel_groups()["tp"]
    layers = block_layers(model)
    grams: dict[int, torch.Tensor] = {}
    acc = Accumulator()  # only for its hook bookkeeping: the Gram matrices are kept here

    def hook_for(i: int) -> Callable[[Any, tuple], None]:
        def hook(mod: Any, args: tuple) -> None:
            x = cat_over(args[0], tp, group, dim=-1)
            x = x.reshape(-1, x.shape[-1]).double()
            g = x.T @ x
            grams[i] = grams[i] + g if i in grams else g

        return hook

    for i in blocks:
        if i not in layers:
            raise ValueError(f"block {i} is not built on this rank; extract.refit needs the whole parent on every rank")
        acc.pre_hook(kind_of(parent.blocks[i]).refit_site(layers[i]), hook_for(i))
    tokens = acc.run(model, batches, forward)
    return grams, tokens


def _rel_error(w: torch.Tensor, v_full: torch.Tensor, g: torch.Tensor) -> float:
    """``sum_t ||(W - V) x_t||^2 / sum_t ||W x_t||^2`` from the Gram matrix."""
    d = w - v_full
    return float(((d @ g) * d).sum() / ((w @ g) * w).sum().clamp_min(1e-30))


def refit_state_dict(
    parent: ArchSpec,
    sorted_sd: dict[str, torch.Tensor],
    child: ArchSpec,
    child_sd: dict[str, torch.Tensor],
    grams: dict[int, torch.Tensor],
    ridge: float,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The child's state dict with every re-fit block's output projection solved by least squares
    (the rest shared with ``child_sd``), and one record per block: role, kept / parent channels,
    relative output error of the slice and of the re-fit on the calibration tokens."""
    from autocompress_nemo.models.hybrid.names import hf_names

    if ridge < 0:
        raise ValueError(f"extract.ridge={ridge}: must be >= 0 (a fraction of the mean kept-channel energy)")
    names = hf_names(parent)
    out = dict(child_sd)
    records = []
    for i, (role, kept) in sorted(refit_blocks(parent, child).items()):
        if i not in grams:
            raise ValueError(f"block {i}: no calibration statistics for its re-fit (collect_grams over the same child)")
        key = names.key(i, role, None)
        w = sorted_sd[key].double().cpu()
        g = grams[i].cpu()
        gkk = g[kept][:, kept]
        r = ridge * float(gkk.diagonal().mean())
        eye = torch.eye(len(kept), dtype=g.dtype)
        # V^T = (G_KK + rI)^-1 (G_K: W^T + r W_K^T), by Cholesky (G_KK + rI: symmetric positive definite for r > 0)
        rhs = g[kept] @ w.T + r * w[:, kept].T
        try:
            v = torch.cholesky_solve(rhs, torch.linalg.cholesky(gkk + r * eye)).T
        except torch.linalg.LinAlgError:
            v = torch.linalg.lstsq(gkk + r * eye, rhs).solution.T
        sliced_full, refit_full = torch.zeros_like(w), torch.zeros_like(w)
        sliced_full[:, kept], refit_full[:, kept] = w[:, kept], v
        rec = {
            "block": i,
            "role": role,
            "kept": len(kept),
            "of": int(w.shape[1]),
            "sliced_error": _rel_error(w, sliced_full, g),
            "refit_error": _rel_error(w, refit_full, g),
        }
        if not torch.isfinite(v).all() or rec["refit_error"] > rec["sliced_error"]:
            rec["kept_slice"] = True  # never worse than the slice on the calibration tokens
        else:
            out[key] = v.to(child_sd[key].dtype).contiguous()
        records.append(rec)
    return out, records

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
from megatron.core import parallel_state as ps

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.distill.local import StopForward, decoder_layers, hidden_in, hidden_out, layer_problem
from autocompress_nemo.models.hybrid.names import hf_names
from autocompress_nemo.models.megatron import block_layers
from autocompress_nemo.rank.hooks import Accumulator, cat_over, parallel_groups

__all__ = ["collect_grams", "refit_blocks", "refit_state_dict", "sequential_refit", "solve"]


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


def solve(
    w: torch.Tensor, g_ss: torch.Tensor, g_sp: torch.Tensor, g_pp: torch.Tensor, kept: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, float, float]:
    """``(V, slice error, re-fit error)`` of one output projection ``w`` (``[out, F]``, float64).

    ``V`` minimises ``sum_t ||W x_t - V y_t||^2 + r ||V - W[:, K]||^2`` where ``x_t`` is the parent's
    projection input (``F`` channels) and ``y_t`` the student's (``K`` channels), from their Gram
    matrices ``g_ss = sum y y^T``, ``g_sp = sum y x^T``, ``g_pp = sum x x^T``. The parallel re-fit
    has ``y_t = x_{t,K}`` (``g_ss = G[K, K]``, ``g_sp = G[K, :]``); the sequential one takes ``y_t``
    from the student whose earlier blocks are already re-fit. Errors are relative to
    ``sum_t ||W x_t||^2``: the slice's (``V = W[:, K]``) and the re-fit's."""
    wk = w[:, kept]
    r = ridge * float(g_ss.diagonal().mean())
    rhs = g_sp @ w.T + r * wk.T
    a = g_ss + r * torch.eye(len(kept), dtype=g_ss.dtype)
    # V^T = (g_ss + rI)^-1 (g_sp W^T + r W_K^T), by Cholesky (symmetric positive definite for r > 0)
    try:
        v = torch.cholesky_solve(rhs, torch.linalg.cholesky(a)).T
    except torch.linalg.LinAlgError:
        v = torch.linalg.lstsq(a, rhs).solution.T
    q = float(((w @ g_pp) * w).sum().clamp_min(1e-30))

    def err(m: torch.Tensor) -> float:
        return (q - 2 * float(((m @ g_sp) * w).sum()) + float(((m @ g_ss) * m).sum())) / q

    return v, err(wk), err(v)


def _record(
    i: int, role: str, kept: torch.Tensor, w: torch.Tensor, sliced: float, fitted: float, v: torch.Tensor
) -> dict:
    rec: dict[str, Any] = {
        "block": i,
        "role": role,
        "kept": len(kept),
        "of": int(w.shape[1]),
        "sliced_error": sliced,
        "refit_error": fitted,
    }
    if not torch.isfinite(v).all() or fitted > sliced:
        rec["kept_slice"] = True  # never worse than the slice on the calibration tokens
    return rec


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
        v, sliced, fitted = solve(w, g[kept][:, kept], g[kept], g, kept, ridge)
        rec = _record(i, role, kept, w, sliced, fitted, v)
        if not rec.get("kept_slice"):
            out[key] = v.to(child_sd[key].dtype).contiguous()
        records.append(rec)
    return out, records


class _Replay:
    """One model's decoder layers run one at a time over cached batches: each layer's call
    arguments other than the hidden states are recorded in one full forward per batch (stopped
    after the last layer), then ``step(l)`` runs layer ``l`` on the cached inputs and returns its
    outputs, without running the layers before it again."""

    def __init__(self, model: torch.nn.Module, batches: list[torch.Tensor], forward: Callable[..., Any]) -> None:
        self.layers = decoder_layers(model)
        self.calls: list[list[tuple[tuple, dict, bool]]] = []  # [batch][layer]: (args, kwargs, hidden as kwarg)
        self.hidden: list[torch.Tensor] = []  # the current layer's input, per batch
        last = len(self.layers) - 1

        def pre(li: int) -> Callable[..., None]:
            def hook(_m: Any, args: tuple, kwargs: dict) -> None:
                if li == 0:
                    self.hidden.append(hidden_in(args, kwargs).detach())
                by_kw = "hidden_states" in kwargs
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self.calls[-1].append((args if by_kw else args[1:], rest, by_kw))

            return hook

        def post(_m: Any, _a: Any, _o: Any) -> None:
            raise StopForward

        handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        handles.append(self.layers[last].register_forward_hook(post))
        try:
            for x in batches:
                self.calls.append([])
                try:
                    forward(model, x)
                except StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()

    def run(self, li: int) -> list[torch.Tensor]:
        """Layer ``li`` on every batch's cached input; its outputs (the cache is not advanced)."""
        outs = []
        for b, h in enumerate(self.hidden):
            args, kwargs, by_kw = self.calls[b][li]
            layer = self.layers[li]
            y = layer(*args, hidden_states=h, **kwargs) if by_kw else layer(h, *args, **kwargs)
            outs.append(hidden_out(y).detach())
        return outs

    def advance(self, outs: list[torch.Tensor]) -> None:
        self.hidden = outs


@torch.no_grad()
def sequential_refit(
    parent_model: torch.nn.Module,
    student_model: torch.nn.Module,
    parent: ArchSpec,
    sorted_sd: dict[str, torch.Tensor],
    child: ArchSpec,
    child_sd: dict[str, torch.Tensor],
    batches: list[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ridge: float,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], int]:
    """The sequential re-fit (``extract.refit=sequential``, SparseGPT / ZipLM order): layer after
    layer, each narrowed block's output projection is solved against what the parent's block wrote
    (``W x_t`` on the parent's own inputs) from the inputs the *student* feeds it, with every block
    before it already re-fit (``solve`` with the cross-Gram ``g_sp``). The student's live weights
    are updated as it goes, so the next block sees them. Each layer runs on cached hidden states:
    the parent once, the student once per re-fit block of the layer plus once to move on.

    Returns ``(state dict, records, tokens)`` as ``refit_state_dict`` does. Needs the student's
    Megatron layers to pair one to one with the parent's (the same count), TP-only parallelism."""
    if ridge < 0:
        raise ValueError(f"extract.ridge={ridge}: must be >= 0 (a fraction of the mean kept-channel energy)")
    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("extract.refit=sequential runs every layer on every rank: use cluster.pp=1")
    tp, group = parallel_groups()["tp"]
    rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    why = sequential_problem(parent_model, student_model)
    if why:
        raise ValueError(f"extract.refit=sequential: {why}; use extract.refit=least_squares")
    names, todo = hf_names(parent), refit_blocks(parent, child)
    p_layers, s_layers = block_layers(parent_model), block_layers(student_model)
    index = {id(layer): li for li, layer in enumerate(parent_model.decoder.layers)}  # type: ignore[union-attr,arg-type]  # torch: a submodule attribute is Tensor | Module
    by_layer: dict[int, list[int]] = {}
    for i in sorted(todo):
        by_layer.setdefault(index[id(p_layers[i])], []).append(i)
    pr, sr = _Replay(parent_model, batches, forward), _Replay(student_model, batches, forward)
    out, records = dict(child_sd), []
    grab: dict[str, list[torch.Tensor]] = {}

    def tap(module: torch.nn.Module, tag: str) -> Any:
        def hook(_m: Any, args: tuple) -> None:
            x = cat_over(args[0], tp, group, dim=-1)
            grab.setdefault(tag, []).append(x.reshape(-1, x.shape[-1]).double().cpu())

        return module.register_forward_pre_hook(hook)

    for li in range(len(pr.layers)):
        blocks = by_layer.get(li, [])
        hs = [tap(kind_of(parent.blocks[i]).refit_site(p_layers[i]), f"p{i}") for i in blocks]
        try:
            p_next = pr.run(li)
        finally:
            for h in hs:
                h.remove()
        for i in blocks:
            role, kept = todo[i]
            site = kind_of(child.blocks[i]).refit_site(s_layers[i])
            h = tap(site, f"s{i}")
            try:
                sr.run(li)
            finally:
                h.remove()
            xp, xs = grab.pop(f"p{i}"), grab.pop(f"s{i}")
            g_pp = sum(x.T @ x for x in xp)
            g_ss = sum(y.T @ y for y in xs)
            g_sp = sum(y.T @ x for y, x in zip(xs, xp, strict=True))
            key = names.key(i, role, None)
            w = sorted_sd[key].double().cpu()
            v, sliced, fitted = solve(w, g_ss, g_sp, g_pp, kept, ridge)  # type: ignore[arg-type]  # sums of non-empty taps: Tensors, not typeshed's Tensor | 0
            rec = _record(i, role, kept, w, sliced, fitted, v)
            records.append(rec)
            if not rec.get("kept_slice"):
                out[key] = v.to(child_sd[key].dtype).contiguous()
                shard = v.chunk(tp, dim=1)[rank] if tp > 1 else v
                site.weight.data.copy_(shard.to(site.weight.dtype))
        sr.advance(sr.run(li))
        pr.advance(p_next)
    tokens = sum(int(x.numel()) for x in batches)
    return out, records, tokens


def sequential_problem(parent_model: torch.nn.Module, student_model: torch.nn.Module) -> str | None:
    """Why the student's layers cannot be re-fit one after another against the parent's (None: they can)."""
    return layer_problem(parent_model, student_model)

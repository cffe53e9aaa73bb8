"""Blockwise local distillation (Puzzle's BLD, arXiv 2411.19146): the objective that teaches every
student layer its parent layer, independently of the others.

Legend: S sequence, B batch, H hidden (Megatron layers take and return ``[S, B, H]``).

One step on a micro-batch ``x``: the frozen parent runs its layers on ``x`` and every layer's input
``in_l`` and output ``out_l`` are kept (hooks; the run stops after the last layer: no final norm,
no LM head). The student then runs with every layer's input *replaced* by the parent's ``in_l``
(a forward pre-hook), so layer ``l`` of the student sees exactly what layer ``l`` of the parent saw
and no gradient crosses from one layer to another; its output ``s_l`` is compared with the
parent's on the layer's update (the residual stream's change):

    nmse_l   = ||s_l - out_l||^2 / ||out_l - in_l||^2
    cosine_l = mean over tokens of 1 - cos(s_l - in_l, out_l - in_l)

and the loss is the mean over layers (``reconstruct.loss``: ``nmse``, ``cosine`` or ``both``).
A Llama layer holds an attention and an MLP block, which by default train together (Puzzle found
that better than apart); a hybrid layer is one block. With ``reconstruct.unit=block`` they train
apart: the student's MLP is fed the parent's residual after the parent's attention ``mid_l`` (a
pre-hook on ``pre_mlp_layernorm``), the attention is scored on its update ``mid_l - in_l`` and the
MLP on its update from ``mid_l``; the layer's loss is the mean of the two (no gradient crosses from
the MLP's loss into the attention: the layer adds the MLP's output to the student's own residual,
which the MLP's loss subtracts again). The parent's activations are produced batch
by batch and never stored beyond the step. Nothing here depends on the block kind: every layer of
``decoder.layers`` (GPTModel or HybridModel) takes part, so dense, MoE and hybrid students all do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp

from autocompress_nemo.distill.recover import Forward, Objective

LOSSES = ("nmse", "cosine", "both")


class StopForward(Exception):
    """Raised after the last layer: the head of the model is not needed."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from autocompress_nemo.models.dist_checkpoint import unwrap

    m = unwrap(model)
    layers = getattr(getattr(m, "decoder", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(m).__name__} has no decoder.layers: local reconstruction needs a Megatron model")
    return list(layers)


def hidden_in(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def hidden_out(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def layer_problem(parent: torch.nn.Module, student: torch.nn.Module) -> str | None:
    """Why the student's layers cannot be taught the parent's one by one (``None``: they can)."""
    p, s = decoder_layers(parent), decoder_layers(student)
    if len(p) != len(s):
        return f"the student has {len(s)} Megatron layers and the parent {len(p)}"
    ph = getattr(getattr(parent, "config", None), "hidden_size", None)
    sh = getattr(getattr(student, "config", None), "hidden_size", None)
    if ph != sh:
        return f"the student's hidden size ({sh}) is not the parent's ({ph}): the parent's activations do not fit"
    return None


def splits(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a Megatron ``TransformerLayer`` with both an attention and an MLP
    (its residual between them is reachable at ``pre_mlp_layernorm``)."""
    parts = [getattr(layer, n, None) for n in ("self_attention", "pre_mlp_layernorm", "mlp")]
    return all(m is not None for m in parts) and not any(isinstance(m, IdentityOp) for m in (parts[0], parts[2]))


class LayerTaps:
    """Hooks on a model's layers: record each layer's input and output (``replace=None``), or feed
    each layer the given inputs and record its outputs (``replace`` set per step). With ``mid``
    (layer indices), also the residual entering those layers' MLP (``mids``), replaced by
    ``replace_mid`` when that is set."""

    def __init__(self, model: torch.nn.Module, stop_after_last: bool = True, mid: frozenset[int] = frozenset()) -> None:
        self.layers = decoder_layers(model)
        self.inputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self.outputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self.mids: list[torch.Tensor | None] = [None] * len(self.layers)
        self.replace: list[torch.Tensor] | None = None
        self.replace_mid: list[torch.Tensor | None] | None = None
        self.stop = stop_after_last
        self.handles = []
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i)))
            if i in mid:
                # torch types a submodule attribute as Tensor | Module
                self.handles.append(layer.pre_mlp_layernorm.register_forward_pre_hook(self._mid(i)))  # type: ignore[union-attr]

    def _mid(self, i: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple) -> Any:
            self.mids[i] = args[0]
            h = self.replace_mid[i] if self.replace_mid is not None else None
            return None if h is None else (h, *args[1:])

        return hook

    def _pre(self, i: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
            if self.replace is None:
                self.inputs[i] = hidden_in(args, kwargs)
                return None
            h = self.replace[i]
            self.inputs[i] = h
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": h}
            return (h, *args[1:]), kwargs

        return hook

    def _post(self, i: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.outputs[i] = hidden_out(output)
            if self.stop and i == len(self.layers) - 1:
                raise StopForward

        return hook

    def run(self, forward: Forward, model: torch.nn.Module, x_BT: torch.Tensor) -> None:
        try:
            forward(model, x_BT)
        except StopForward:
            pass

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def update_losses(s_SBH: torch.Tensor, t_SBH: torch.Tensor, in_SBH: torch.Tensor) -> dict[str, torch.Tensor]:
    """``nmse`` and ``cosine`` of one layer (module docstring), in float32."""
    s, t, h = s_SBH.float(), t_SBH.float(), in_SBH.float()
    du_t, du_s = t - h, s - h
    nmse = (s - t).pow(2).sum() / du_t.pow(2).sum().clamp_min(1e-12)
    cos = torch.nn.functional.cosine_similarity(du_s, du_t, dim=-1, eps=1e-8)
    return {"nmse": nmse, "cosine": (1.0 - cos).mean()}


def block_losses(
    s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, s_mid: torch.Tensor | None, t_mid: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """One layer's losses: of its whole update (``s_mid`` None), or the mean of its attention's
    (``s_mid - h`` against ``t_mid - h``) and its MLP's (from the parent's ``t_mid``)."""
    if s_mid is None or t_mid is None:
        return update_losses(s, t, h)
    tm = t_mid.float()
    attn = update_losses(s_mid, tm, h)
    mlp = update_losses(s.float() - s_mid.float() + tm, t, tm)
    return {k: (attn[k] + mlp[k]) / 2 for k in attn}


UNITS = ("layer", "block")


def local_objective(
    student: torch.nn.Module,
    parent: torch.nn.Module,
    forward: Forward,
    loss: str = "nmse",
    teacher_ctx: Callable[[], Any] | None = None,
    unit: str = "layer",
) -> Objective:
    """The trainer's objective for blockwise local distillation of ``student`` from ``parent``
    (``unit``: ``layer`` trains a layer's attention and MLP together, ``block`` apart)."""
    if loss not in LOSSES:
        raise ValueError(f"reconstruct.loss={loss!r}: use one of {', '.join(LOSSES)}")
    if unit not in UNITS:
        raise ValueError(f"reconstruct.unit={unit!r}: use one of {', '.join(UNITS)}")
    why = layer_problem(parent, student)
    if why:
        raise ValueError(f"local reconstruction: {why}; set reconstruct.fraction=0")
    parent.eval()
    for p in parent.parameters():
        p.requires_grad_(False)
    taps: dict[str, LayerTaps] = {}
    import contextlib

    tctx = teacher_ctx or contextlib.nullcontext
    mid: frozenset[int] = frozenset()
    if unit == "block":
        pairs = zip(decoder_layers(parent), decoder_layers(student), strict=True)
        mid = frozenset(i for i, (pl, sl) in enumerate(pairs) if splits(pl) and splits(sl))

    def setup() -> None:
        taps["parent"], taps["student"] = LayerTaps(parent, mid=mid), LayerTaps(student, mid=mid)

    def teardown() -> None:
        for t in taps.values():
            t.remove()
        taps.clear()

    def step(x_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        tp, ts = taps["parent"], taps["student"]
        with torch.no_grad(), tctx():
            tp.run(forward, parent, x_BT)
        ins = [h.detach().float() for h in tp.inputs if h is not None]
        outs = [h.detach().float() for h in tp.outputs if h is not None]
        t_mids = [None if h is None else h.detach().float() for h in tp.mids]
        ts.replace, ts.replace_mid = ins, t_mids
        try:
            ts.run(forward, student, x_BT)
        finally:
            ts.replace, ts.replace_mid = None, None
        per = [
            block_losses(s, t, h, sm, tm)
            for s, t, h, sm, tm in zip(ts.outputs, outs, ins, ts.mids, t_mids, strict=True)
            if s is not None
        ]
        nmse = torch.stack([p["nmse"] for p in per]).mean()
        cos = torch.stack([p["cosine"] for p in per]).mean()
        total = nmse if loss == "nmse" else cos if loss == "cosine" else nmse + cos
        for t in (tp, ts):
            n = len(t.layers)
            t.inputs, t.outputs, t.mids = [None] * n, [None] * n, [None] * n
        return total, {"nmse": float(nmse.detach()), "cosine": float(cos.detach())}

    return Objective("local", step, {"local_loss": loss}, setup, teardown)


@torch.no_grad()
def layer_errors(
    student: torch.nn.Module, parent: torch.nn.Module, forward: Forward, batches: list[torch.Tensor]
) -> list[float]:
    """Per layer, the normalized squared error of the student's update on the parent's inputs
    (``nmse_l`` of the module docstring, averaged over ``batches``): the number the stage lowers."""
    t, s = LayerTaps(parent), LayerTaps(student)
    sums: list[float] = []
    try:
        for x in batches:
            t.run(forward, parent, x)
            s.replace = [h.float() for h in t.inputs if h is not None]
            s.run(forward, student, x)
            errs = [
                float(update_losses(so, to, ti)["nmse"])
                for so, to, ti in zip(s.outputs, t.outputs, s.replace, strict=True)
                if so is not None and to is not None
            ]
            s.replace = None
            sums = [a + b for a, b in zip(sums, errs, strict=True)] if sums else errs
    finally:
        t.remove()
        s.remove()
    return [v / len(batches) for v in sums]

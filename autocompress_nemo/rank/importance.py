"""Activation-based importance from a calibration pass (Minitron-style), on a Megatron GPT model.

Legend: B batch, T tokens, S sequence (Megatron's [S, B, *] layout), h hidden, H query
heads, d head dim, F ffn width; ``_local`` = this tensor-parallel rank's shard.

Scores (all are mean magnitudes over calibration tokens, so they add up across layers
and kinds on one scale — "how much this unit writes into / reads from the residual"):

- ffn neuron j of layer l: ``mean_t |a_tj| * ||W_down[:, j]||`` where ``a`` is the input
  of ``linear_fc2`` (the activation that neuron writes through ``W_down``).
- query head i: ``mean_t ||W_o[:, i] o_ti||`` — the norm of that head's contribution to
  the attention output; a KV group scores the sum of its query heads.
- hidden channel c: ``mean_t |x_tc|`` summed over the normalized inputs of every block
  (inputs of ``linear_qkv`` and ``linear_fc1``).
- block: ``mean_t ||f(n_t)|| / ||n_t||`` with ``n`` the block's normalized input and ``f``
  its output — how much the block writes into the residual stream relative to its input.

Under tensor parallelism each rank scores its own heads / neurons; the shards are
gathered over the TP group so every rank holds the same global vectors, hence one
global order. With sequence parallelism the token sums are all-reduced as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.distributed.state import tensor_parallel


@dataclass
class LayerScores:
    heads: torch.Tensor | None = None  # [H]
    ffn: torch.Tensor | None = None  # [F]
    attn_block: float = 0.0
    mlp_block: float = 0.0


@dataclass
class Importance:
    hidden: torch.Tensor  # [h]
    layers: list[LayerScores] = field(default_factory=list)
    tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "hidden": self.hidden.tolist(),
            "tokens": self.tokens,
            "layers": [
                {
                    "heads": None if s.heads is None else s.heads.tolist(),
                    "ffn": None if s.ffn is None else s.ffn.tolist(),
                    "attn_block": s.attn_block,
                    "mlp_block": s.mlp_block,
                }
                for s in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Importance:
        def t(x: list | None) -> torch.Tensor | None:
            return None if x is None else torch.tensor(x, dtype=torch.float64)

        return cls(
            hidden=torch.tensor(d["hidden"], dtype=torch.float64),
            tokens=int(d["tokens"]),
            layers=[LayerScores(t(s["heads"]), t(s["ffn"]), s["attn_block"], s["mlp_block"]) for s in d["layers"]],
        )


def _tp_group() -> tuple[dist.ProcessGroup | None, int]:
    group, _, world = tensor_parallel()
    return group, world


def _gather_tp(x_local: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    """Concatenate a per-rank shard along dim 0 over the TP group (rank order = Megatron's split)."""
    if world == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return torch.cat(parts)


def _allreduce_tp(x: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    if world > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


@torch.no_grad()
def collect_importance(
    model: torch.nn.Module,
    spec: ArchSpec,
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    sequence_parallel: bool = False,
) -> Importance:
    """Run ``forward(model, input_ids_BT)`` over ``batches`` and accumulate the scores above."""
    layers = spec.layers()
    h = spec.hidden
    acc_hidden = torch.zeros(h, dtype=torch.float64)
    n_layers = len(layers)
    acc_heads: list[torch.Tensor | None] = [None] * n_layers
    acc_ffn: list[torch.Tensor | None] = [None] * n_layers
    acc_blk = torch.zeros(n_layers, 2, dtype=torch.float64)
    token_count = [0]
    handles = []
    decoder_layers = model.decoder.layers

    def add(store: list, i: int, v: torch.Tensor) -> None:
        store[i] = v if store[i] is None else store[i] + v

    for li, layer in enumerate(decoder_layers):
        attn, mlp = layers[li]
        sa = layer.self_attention
        if not attn.removed and hasattr(sa, "linear_proj"):
            d = attn.head_dim

            def proj_hook(mod, args, li=li, d=d):
                o = args[0].double()  # [S, B, H_local*d]
                s, b, hd = o.shape
                heads_local = hd // d
                w = mod.weight.double()  # row-parallel: [h, H_local*d]
                w_h = w.view(w.shape[0], heads_local, d)  # [h, H_local, d]
                contrib = torch.einsum("sbnd,hnd->sbnh", o.view(s, b, heads_local, d), w_h)
                add(acc_heads, li, contrib.norm(dim=-1).sum(dim=(0, 1)))

            handles.append(sa.linear_proj.register_forward_pre_hook(proj_hook))

            def qkv_hook(mod, args):
                x = args[0].double()
                acc_hidden.add_(x.abs().sum(dim=(0, 1)))

            handles.append(sa.linear_qkv.register_forward_pre_hook(qkv_hook))
        if not mlp.removed and hasattr(layer.mlp, "linear_fc2"):

            def fc2_hook(mod, args, li=li):
                a = args[0].double()  # [S, B, F_local]
                wnorm = mod.weight.double().norm(dim=0)  # [F_local]
                add(acc_ffn, li, a.abs().sum(dim=(0, 1)) * wnorm)

            def fc1_hook(mod, args):
                x = args[0].double()
                acc_hidden.add_(x.abs().sum(dim=(0, 1)))
                token_count[0] += x.shape[0] * x.shape[1]

            handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(fc2_hook))
            handles.append(layer.mlp.linear_fc1.register_forward_pre_hook(fc1_hook))

        for bi, sub in ((0, sa), (1, layer.mlp)):

            def blk_hook(mod, args, out, li=li, bi=bi):
                y = out[0] if isinstance(out, tuple) else out
                x_norm = args[0] if args else None
                if y is None or x_norm is None or not torch.is_tensor(y):
                    return
                num = y.double().norm(dim=-1)
                den = x_norm.double().norm(dim=-1).clamp_min(1e-12)
                acc_blk[li, bi] += (num / den).sum().item()

            handles.append(sub.register_forward_hook(blk_hook))

    try:
        n_tokens_seen = 0
        for input_ids in batches:
            forward(model, input_ids)
            n_tokens_seen += input_ids.numel()
    finally:
        for hd in handles:
            hd.remove()

    group, world = _tp_group()
    if sequence_parallel:
        acc_hidden = _allreduce_tp(acc_hidden, group, world)
        acc_blk = _allreduce_tp(acc_blk, group, world)
    n = max(n_tokens_seen, 1)
    scores = []
    for li in range(len(layers)):
        heads = acc_heads[li]
        ffn = acc_ffn[li]
        if heads is not None:
            heads = _gather_tp(_allreduce_tp(heads, group, world) if sequence_parallel else heads, group, world) / n
        if ffn is not None:
            ffn = _gather_tp(_allreduce_tp(ffn, group, world) if sequence_parallel else ffn, group, world) / n
        scores.append(
            LayerScores(heads=heads, ffn=ffn, attn_block=acc_blk[li, 0].item() / n, mlp_block=acc_blk[li, 1].item() / n)
        )
    return Importance(hidden=acc_hidden / n, layers=scores, tokens=n_tokens_seen)

"""Importance and reordering for MoE and Mamba-2 blocks: routed experts, expert ffn neurons,
shared-expert neurons and Mamba heads (the dense dimensions are ``importance.py`` / ``reorder.py``).

Legend: T tokens, h hidden, E routed experts, F expert ffn, Fs shared-expert ffn, H Mamba heads,
G Mamba groups, p Mamba head dim, N state size; ``p_te`` is token t's routing weight for expert e
(0 when e is not in its top-k), ``y_te`` expert e's output for token t.

Scores follow ``importance.py``: mean magnitudes over the calibration tokens (divided by the
number of tokens T, so they add up on one scale):

- routed expert e: ``sum_t p_te * ||y_te|| / T`` — routing mass times output contribution (a
  rarely routed expert, or one that writes little, scores low);
- expert e's ffn neuron n: ``sum_t p_te * |a_ten| * ||W_down_e[:, n]|| / T`` (``a`` the activation);
- shared-expert neuron n: ``mean_t |a_tn| * ||W_down[:, n]||``;
- Mamba head i: ``mean_t ||W_out[:, i] y_ti||`` with ``y`` the gated-norm output (the input of
  ``out_proj``) — the norm of that head's contribution to the block output; a group scores the
  sum of its heads.

Reordering (permutations new -> old, most important first; ``apply_*`` on the Hugging Face-named
state dict of ``models/hybrid/names.py``) leaves the function unchanged:

- experts: router rows (and the selection bias) move with the expert tensors, so every token picks
  the same experts with the same weights;
- expert / shared neurons: up (gate) rows and down columns move together;
- Mamba heads: groups are sorted by summed score and heads within each group by their own score
  (B / C belong to a group; the gated RMSNorm normalizes over the heads of one group, a set that
  stays together). Rows of ``z``, ``x``, ``dt`` in ``in_proj``, the ``x`` channels of the conv,
  ``dt_bias``, ``A_log``, ``D``, the gated-norm weight and the ``out_proj`` columns move with their
  head; ``B``/``C`` rows (in ``in_proj`` and the conv) with their group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autocompress_nemo.arch.spec import ArchSpec, MambaBlock, MoeBlock
from autocompress_nemo.models.hybrid.names import hf_names


@dataclass
class BlockScores:
    experts: torch.Tensor | None = None  # [E]
    expert_ffn: torch.Tensor | None = None  # [E, F]
    shared_ffn: torch.Tensor | None = None  # [Fs]
    mamba_heads: torch.Tensor | None = None  # [H]


@dataclass
class MoeMambaImportance:
    blocks: list[BlockScores] = field(default_factory=list)
    tokens: int = 0


@dataclass
class MoeMambaPermutations:
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [E] new -> old expert
    expert_ffn: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [E, F], row = NEW expert
    shared_ffn: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [Fs]
    mamba_groups: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [G]
    mamba_heads: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [H] new -> old head


def _groups() -> tuple[tuple[int, object], tuple[int, object]]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return (1, None), (1, None)
    return ((ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()),
            (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()))


def _cat_over(x: torch.Tensor, n: int, group: object, dim: int = 0) -> torch.Tensor:
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)  # type: ignore[arg-type]
    return torch.cat(parts, dim=dim)


def _sum_over(x: torch.Tensor, n: int, group: object) -> torch.Tensor:
    if n > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)  # type: ignore[arg-type]
    return x


@torch.no_grad()
def collect_moe_mamba_importance(
    model: torch.nn.Module,
    spec: ArchSpec,
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> MoeMambaImportance:
    """Run ``forward(model, input_ids_BT)`` over ``batches`` (a ``models.hybrid`` model) and score
    experts, expert / shared neurons and Mamba heads as above. Under TP the sharded scores are
    gathered, under EP the experts' and the token sums are combined, so every rank holds the same
    global vectors. Sequence parallelism and expert tensor parallelism are not supported here."""
    if getattr(model.config, "sequence_parallel", False):
        raise ValueError("collect_moe_mamba_importance: run the calibration pass without sequence parallelism")
    acc: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def add(key: tuple[int, str], v: torch.Tensor) -> None:
        acc[key] = acc[key] + v if key in acc else v

    for layer in model.decoder.layers:
        g = int(layer.layer_number) - 1
        b = spec.blocks[g]
        if b.removed:
            continue
        if isinstance(b, MambaBlock):
            p_dim = b.head_dim

            def out_hook(mod, args, g=g, p_dim=p_dim):  # noqa: ANN001, ANN202
                y = args[0].double()  # [S, B, H_local * p]
                w = mod.weight.double()  # [h, H_local * p]
                heads = w.shape[1] // p_dim
                c = torch.einsum("sbnp,hnp->sbnh", y.view(*y.shape[:2], heads, p_dim), w.view(-1, heads, p_dim))
                add((g, "mamba_heads"), c.norm(dim=-1).sum(dim=(0, 1)))

            handles.append(layer.mixer.out_proj.register_forward_pre_hook(out_hook))
        mlp = getattr(layer, "mlp", None)
        if isinstance(b, MoeBlock) and mlp is not None and hasattr(mlp, "experts"):
            n_local = len(mlp.experts.local_experts)
            for j, expert in enumerate(mlp.experts.local_experts):

                def expert_hook(mod, args, out, g=g, j=j, n=n_local):  # noqa: ANN001, ANN202
                    v = torch.zeros(n, dtype=torch.float64)
                    v[j] = out[0].double().norm(dim=-1).sum()  # the output is already weighted by p_te
                    add((g, "experts"), v)

                def fc2_hook(mod, args, g=g, j=j, n=n_local):  # noqa: ANN001, ANN202
                    a = args[0].double()  # [tokens routed to j, F]: activation already times p_te
                    s = a.abs().sum(dim=0) * mod.weight.double().norm(dim=0)
                    v = torch.zeros(n, s.shape[0], dtype=torch.float64)
                    v[j] = s
                    add((g, "expert_ffn"), v)

                handles.append(expert.register_forward_hook(expert_hook))
                handles.append(expert.linear_fc2.register_forward_pre_hook(fc2_hook))
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:

                def shared_hook(mod, args, g=g):  # noqa: ANN001, ANN202
                    a = args[0].double()
                    add((g, "shared_ffn"), a.abs().sum(dim=tuple(range(a.dim() - 1))) * mod.weight.double().norm(dim=0))

                handles.append(shared.linear_fc2.register_forward_pre_hook(shared_hook))
    tokens = 0
    try:
        for ids in batches:
            forward(model, ids)
            tokens += ids.numel()
    finally:
        for hd in handles:
            hd.remove()
    (tp, tp_group), (ep, ep_group) = _groups()
    total = int(_sum_over(torch.tensor([tokens], dtype=torch.float64), ep, ep_group).item())
    out = MoeMambaImportance(blocks=[BlockScores() for _ in spec.blocks], tokens=total)
    for (g, kind), v in sorted(acc.items()):
        if kind == "mamba_heads":
            v = _cat_over(_sum_over(v, ep, ep_group), tp, tp_group)
        elif kind == "shared_ffn":
            v = _cat_over(_sum_over(v, ep, ep_group), tp, tp_group)
        else:  # local experts already saw the tokens of every EP rank (allgather dispatch)
            v = _cat_over(v, ep, ep_group)
        setattr(out.blocks[g], kind, v / max(total, 1))
    return out


def _argsort_desc(x: torch.Tensor) -> torch.Tensor:
    return torch.argsort(-x.double(), stable=True)


def permutations_from_scores(spec: ArchSpec, imp: MoeMambaImportance) -> MoeMambaPermutations:
    """Most-important-first orders of every scored dimension."""
    p = MoeMambaPermutations()
    for g, (b, s) in enumerate(zip(spec.blocks, imp.blocks, strict=True)):
        if s.experts is not None:
            order = _argsort_desc(s.experts)
            p.experts[g] = order
            if s.expert_ffn is not None:
                p.expert_ffn[g] = torch.stack([_argsort_desc(s.expert_ffn[e]) for e in order.tolist()])
        if s.shared_ffn is not None:
            p.shared_ffn[g] = _argsort_desc(s.shared_ffn)
        if s.mamba_heads is not None and isinstance(b, MambaBlock):
            hpg = b.num_heads // b.num_groups
            per_group = s.mamba_heads.view(b.num_groups, hpg)
            groups = _argsort_desc(per_group.sum(dim=1))
            p.mamba_groups[g] = groups
            p.mamba_heads[g] = torch.cat([gi * hpg + _argsort_desc(per_group[gi]) for gi in groups.tolist()])
    return p


def _rows(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    return w.view(-1, unit, *w.shape[1:]).index_select(0, idx).reshape(w.shape)


def _cols(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    return _rows(w.transpose(0, 1), idx, unit).transpose(0, 1).contiguous()


def apply_expert_permutation(spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, experts: torch.Tensor,
                             expert_ffn: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Block ``g``'s routed experts in order ``experts`` (new -> old), each expert's neurons in
    order ``expert_ffn[new expert]``; router rows / selection bias move with their expert."""
    b, names, out = spec.blocks[g], hf_names(spec), dict(sd)
    assert isinstance(b, MoeBlock)
    for role in ("router", "router_bias") if spec.family == "nemotron_h" else ("router",):
        k = names.key(g, role)
        if k in out:
            out[k] = sd[k].index_select(0, experts)
    for new, old in enumerate(experts.tolist()):
        for role in ("expert_up", "expert_gate", "expert_down"):
            src = names.key(g, role, old)
            if src not in sd:
                continue
            t = sd[src]
            if expert_ffn is not None:
                t = _cols(t, expert_ffn[new]) if role == "expert_down" else t.index_select(0, expert_ffn[new])
            out[names.key(g, role, new)] = t
    return out


def apply_ffn_permutation(spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, order: torch.Tensor,
                          prefix: str = "shared_") -> dict[str, torch.Tensor]:
    """Neurons of block ``g``'s shared expert (``prefix='shared_'``) or dense MLP (``prefix=''``)."""
    names, out = hf_names(spec), dict(sd)
    for role in ("up", "gate"):
        k = names.key(g, prefix + role)
        if k in out:
            out[k] = sd[k].index_select(0, order)
    k = names.key(g, prefix + "down")
    out[k] = _cols(sd[k], order)
    return out


def apply_mamba_head_permutation(spec: ArchSpec, sd: dict[str, torch.Tensor], g: int, heads: torch.Tensor,
                                 groups: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block ``g``'s Mamba heads in order ``heads`` (new -> old); ``groups`` (new -> old) must be the
    group order ``heads`` follows (head i of new group k comes from old group ``groups[k]``)."""
    b, names, out = spec.blocks[g], hf_names(spec), dict(sd)
    assert isinstance(b, MambaBlock)
    hpg = b.num_heads // b.num_groups
    if not torch.equal(heads.view(b.num_groups, hpg) // hpg, groups.view(-1, 1).expand(-1, hpg)):
        raise ValueError(f"block {g}: the head order does not keep the heads of a group together in group order")
    P, N, di, gn = b.head_dim, b.state_size, b.d_inner, b.num_groups * b.state_size
    k = lambda role: names.key(g, role)  # noqa: E731
    z, x, B, C, dt = sd[k("in_proj")].split([di, di, gn, gn, b.num_heads])
    out[k("in_proj")] = torch.cat([_rows(z, heads, P), _rows(x, heads, P), _rows(B, groups, N), _rows(C, groups, N),
                                   dt.index_select(0, heads)])
    for role in ("conv_w", "conv_b"):
        cx, cB, cC = sd[k(role)].split([di, gn, gn])
        out[k(role)] = torch.cat([_rows(cx, heads, P), _rows(cB, groups, N), _rows(cC, groups, N)])
    for role in ("dt_bias", "A_log", "D"):
        out[k(role)] = sd[k(role)].index_select(0, heads)
    out[k("mnorm")] = _rows(sd[k("mnorm")], heads, P)
    out[k("out_proj")] = _cols(sd[k("out_proj")], heads, P)
    return out


def apply_moe_mamba_permutations(spec: ArchSpec, sd: dict[str, torch.Tensor],
                                 p: MoeMambaPermutations) -> dict[str, torch.Tensor]:
    """Apply every permutation of ``p``; the function computed is unchanged."""
    out = dict(sd)
    for g, order in p.experts.items():
        out = apply_expert_permutation(spec, out, g, order, p.expert_ffn.get(g))
    for g, order in p.shared_ffn.items():
        out = apply_ffn_permutation(spec, out, g, order, "shared_")
    for g, heads in p.mamba_heads.items():
        out = apply_mamba_head_permutation(spec, out, g, heads, p.mamba_groups[g])
    return out


def sorted_scores(imp: MoeMambaImportance, p: MoeMambaPermutations) -> MoeMambaImportance:
    """The scores in the reordered order (descending along every dimension, Mamba heads per group)."""
    blocks = []
    for g, s in enumerate(imp.blocks):
        e = p.experts.get(g)
        blocks.append(BlockScores(
            experts=None if s.experts is None or e is None else s.experts[e],
            expert_ffn=None if s.expert_ffn is None or e is None else torch.stack(
                [s.expert_ffn[old][p.expert_ffn[g][new]] for new, old in enumerate(e.tolist())]),
            shared_ffn=None if s.shared_ffn is None else s.shared_ffn[p.shared_ffn[g]],
            mamba_heads=None if s.mamba_heads is None else s.mamba_heads[p.mamba_heads[g]],
        ))
    return MoeMambaImportance(blocks=blocks, tokens=imp.tokens)

"""Mixture-of-experts blocks: **two** decisions per block, because the cost is additive in two parts
that run as separate kernels.

- ``moe_routed``: joint options ``(experts E', expert ffn F', top-k k')`` (router, routed experts,
  LatentMoE projections), from a few levels each (``vary_experts``, ``vary_expert_ffn``,
  ``vary_top_k``), ``k' <= E'``; ``remove_moe`` adds "no routed experts". E' and F' are joint
  because the routed cost is *not* additive in them (weights ``E' * F'``; compute ``k' * F'``);
  ordered by total then active parameters, so "one option smaller" is the next cheaper routed
  configuration. Experts are kept in multiples of ``expert_align`` (the engine's, times EP).
- ``moe_shared``: shared-expert width ``S'`` (``vary_shared_ffn``; 0 allowed unless
  ``remove_shared_expert`` is false).

Option blocks of the parts are the canonical part blocks of ``costs.table.moe_parts`` (the routed
part has ``shared_ffn = 0``, the shared part ``num_experts = 0``), so the predictor prices each part
from its own table entry and the expected cost stays linear in the probabilities; ``merge`` puts the
two parts back into one ``MoeBlock``. Top-k levels: ``{k} U {ceil(k*i/4), i = 2, 3}``, at least 2
unless the router is softmax-then-top-k (``min_top_k``).

Supernet masks (``search/supernet.py`` installs them): ``moe_shared`` per neuron on
``shared_experts.linear_fc2``'s input; ``moe_routed``: the expert-ffn mask on every routed expert's
``linear_fc2`` input, the expert keep-mask and the top-k mixture on the router (see the supernet).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, MoeBlock
from autocompress_nemo.blocks.base import (
    Decision,
    Grid,
    Key,
    Kind,
    Role,
    Scores,
    ffn_params,
    levels,
    need,
    prefix_rows,
)
from autocompress_nemo.rank.hooks import Reduce, sum_over
from autocompress_nemo.rank.permute import argsort_desc, cols, permute_neurons


def topk_levels(k: int, min_k: int) -> list[int]:
    return sorted({k} | {max(min_k, math.ceil(k * i / 4)) for i in (2, 3)})


def min_top_k(spec: ArchSpec) -> int:
    """1 only for a softmax-then-top-k router (Qwen3-MoE with ``norm_topk_prob=False``); else 2:
    Megatron does not normalize a single sigmoid weight, and refuses top-1 after top-k softmax."""
    return 1 if spec.family == "qwen3_moe" and spec.extra.get("norm_topk_prob", True) is False else 2


def moe_routed_options(parent: MoeBlock, spec: ArchSpec, caps: Any, n_levels: int = 4) -> list[MoeBlock]:
    """Joint routed options (see module docstring), smallest first, the parent's last."""
    routed, _ = moe_parts(parent)
    ks = topk_levels(parent.top_k, min_top_k(spec)) if caps.vary_top_k else [parent.top_k]
    es = (
        levels(parent.num_experts, n_levels, caps.expert_align, minimum=min(ks))
        if caps.vary_experts
        else [parent.num_experts]
    )
    fs = levels(parent.expert_ffn, n_levels, caps.ffn_align) if caps.vary_expert_ffn else [parent.expert_ffn]
    opts = {
        dataclasses.replace(routed, num_experts=e, expert_ffn=f, top_k=k)
        for e, f, k in itertools.product(es, fs, ks)
        if k <= e
    }
    ordered = sorted(
        opts,
        key=lambda b: (
            MOE.params(b, spec.hidden),
            MOE.params(b, spec.hidden, active=True),
            b.num_experts,
            b.expert_ffn,
            b.top_k,
        ),
    )
    ordered.remove(routed)
    ordered.append(routed)
    if caps.remove_moe:
        ordered.insert(0, dataclasses.replace(routed, num_experts=0, expert_ffn=0, top_k=0, latent=0))
    return ordered


def moe_shared_options(parent: MoeBlock, caps: Any, n_levels: int = 4) -> list[MoeBlock]:
    _, shared = moe_parts(parent)
    if not parent.shared_ffn or not caps.vary_shared_ffn:
        return [shared]
    removed = [0] if getattr(caps, "remove_shared_expert", True) else []
    widths = removed + levels(parent.shared_ffn, n_levels, caps.ffn_align)
    return [dataclasses.replace(shared, shared_ffn=w) for w in widths]


class Moe(Kind):
    name = "moe"
    plot_unit = "experts x ffn"
    block_type = MoeBlock
    decision_kinds = ("moe_routed", "moe_shared")

    def decisions(self, spec: ArchSpec, i: int, block: MoeBlock, caps: Any, grid: Grid) -> list[Decision]:
        out = []
        if block.num_experts and block.expert_ffn:
            r = moe_routed_options(block, spec, caps, grid.moe_levels)
            if len(r) > 1:
                out.append(Decision(i, "moe_routed", tuple(r)))
        s = moe_shared_options(block, caps, grid.moe_levels)
        if len(s) > 1:
            out.append(Decision(i, "moe_shared", tuple(s)))
        return out

    def merge(self, d: Decision[MoeBlock], current: MoeBlock, option: MoeBlock) -> MoeBlock:
        if d.kind == "moe_routed":
            return dataclasses.replace(
                current,
                num_experts=option.num_experts,
                expert_ffn=option.expert_ffn,
                top_k=option.top_k if option.num_experts else current.top_k,
                latent=option.latent,
            )
        return dataclasses.replace(current, shared_ffn=option.shared_ffn)

    def masks(self, d: Decision[MoeBlock], pb: MoeBlock) -> dict[str, torch.Tensor]:
        opts: list[MoeBlock] = list(d.options)
        if d.kind == "moe_shared":
            return {"shared": prefix_rows(pb.shared_ffn, [o.shared_ffn for o in opts])}
        ks = sorted({o.top_k for o in opts if o.num_experts})
        topk = torch.stack([torch.tensor([float(bool(o.num_experts) and o.top_k == k) for k in ks]) for o in opts])
        return {
            "experts": prefix_rows(pb.num_experts, [o.num_experts for o in opts]),
            "expert_ffn": prefix_rows(pb.expert_ffn, [o.expert_ffn for o in opts]),
            "topk": topk,
            "topk_values": torch.tensor(ks, dtype=torch.float32).unsqueeze(0),
        }

    def mask_sites(self, d: Decision[MoeBlock], layer: Any, pb: MoeBlock) -> list:
        """The shared expert's ``linear_fc2`` input; every local routed expert's (not TP-split: expert
        tensor parallelism is refused). The router's expert / top-k masks are the supernet's own
        routing (``search/supernet.py``), installed when the masks hold ``topk_values``."""
        if d.kind == "moe_shared":
            return [(layer.mlp.shared_experts.linear_fc2, "shared", 1, pb.shared_ffn, True)]
        return [(e.linear_fc2, "expert_ffn", 1, pb.expert_ffn, False) for e in layer.mlp.experts.local_experts]

    def kept_importance(self, d: Decision[MoeBlock], option: MoeBlock, scores: Any) -> float:
        if d.kind == "moe_routed":
            return float(need(scores, "expert_ffn", d)[: option.num_experts, : option.expert_ffn].sum())
        return float(need(scores, "shared_ffn", d)[: option.shared_ffn].sum())

    def widths(self, option: MoeBlock) -> tuple[int, ...]:
        return (option.num_experts, option.expert_ffn, option.top_k) if option.num_experts else (option.shared_ffn,)

    def describe(self, block: MoeBlock) -> str:
        return f"E{block.num_experts}x{block.expert_ffn}k{block.top_k}+s{block.shared_ffn}"

    def words(self, b: MoeBlock) -> str:  # routed experts x expert width (top-k), shared-expert width
        routed = (
            f"{b.num_experts} experts x {b.expert_ffn} (top-{b.top_k})"
            if b.num_experts and b.expert_ffn
            else "no routed experts"
        )
        return f"{routed}, shared {b.shared_ffn}"

    def fields(self, b: MoeBlock) -> str:
        return f"experts={b.num_experts}x{b.expert_ffn} top{b.top_k} shared={b.shared_ffn}"

    def plot_width(self, b: MoeBlock) -> int:
        return b.num_experts * b.expert_ffn + b.shared_ffn

    def prefix_problem(self, p: MoeBlock, c: MoeBlock) -> str | None:
        if (
            c.num_experts > p.num_experts
            or c.expert_ffn > p.expert_ffn
            or c.shared_ffn > p.shared_ffn
            or (c.num_experts and c.latent != p.latent)
            or c.activation != p.activation
        ):
            return f"MoE {c} is not a prefix of {p}"
        return None

    def roles(self, spec: ArchSpec, b: MoeBlock) -> list[Role]:
        h = spec.hidden
        out: list[Role] = []
        if b.shared_ffn:
            fs = b.shared_ffn
            out += [("shared_up", None, (fs, h)), ("shared_down", None, (h, fs))]
            out += [("shared_gate", None, (fs, h))] if b.gated else []
        if has_routed_experts(b):
            inner, f = b.latent or h, b.expert_ffn
            out.append(("router", None, (b.num_experts, h)))
            if spec.family == "nemotron_h":
                out.append(("router_bias", None, (b.num_experts,)))
            if b.latent:
                out += [("latent_down", None, (b.latent, h)), ("latent_up", None, (h, b.latent))]
            for e in range(b.num_experts):
                out += [("expert_up", e, (f, inner)), ("expert_down", e, (inner, f))]
                out += [("expert_gate", e, (f, inner))] if b.gated else []
        return out

    def score(self, acc: Any, layer: Any, i: int, b: MoeBlock) -> None:
        """Routed expert e: ``sum_t p_te * ||y_te|| / T`` (routing mass times output); its neuron n:
        ``sum_t p_te * |a_ten| * ||W_down_e[:, n]|| / T``; shared-expert neuron n as a dense MLP's.
        An MoE block left with only its shared expert is built as a dense MLP (``linear_fc2``)."""
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            acc.neurons(mlp.linear_fc2, (i, "shared_ffn"))
            acc.channels(mlp.linear_fc1)
            return
        local = getattr(mlp.experts, "local_experts", None)
        if local is None:
            raise ValueError(
                f"block {i}: routed experts of type {type(mlp.experts).__name__} (grouped GEMM) cannot be "
                "scored one by one; build the calibration model with per-expert modules (impl='local')"
            )
        acc.zeros((i, "experts"), (len(local),), mlp, Reduce.EXPERTS)
        etp = acc.groups["etp"]
        for j, expert in enumerate(local):

            def expert_hook(mod: Any, args: tuple, out: Any, j: int = j) -> None:
                y = sum_over(out[0].double(), *etp)  # partial sums over ETP; already weighted by p_te
                acc.add((i, "experts"), y.norm(dim=-1).sum(), j)

            acc.post_hook(expert, expert_hook)
            acc.neurons(expert.linear_fc2, (i, "expert_ffn"), row=j, rows=len(local))  # activation already x p_te
        if getattr(mlp, "shared_experts", None) is not None:
            acc.neurons(mlp.shared_experts.linear_fc2, (i, "shared_ffn"))
        acc.channels(mlp.router)

    def orders(self, b: MoeBlock, scores: Scores) -> dict[str, torch.Tensor]:
        """Experts by score; each expert's neurons (row = the expert's NEW index); shared neurons."""
        out = {}
        if "experts" in scores:
            out["experts"] = argsort_desc(scores["experts"])
            if "expert_ffn" in scores:
                out["expert_ffn"] = torch.stack(
                    [argsort_desc(scores["expert_ffn"][e]) for e in out["experts"].tolist()]
                )
        if "shared_ffn" in scores:
            out["shared_ffn"] = argsort_desc(scores["shared_ffn"])
        return out

    def permute(self, sd: dict[str, torch.Tensor], key: Key, b: MoeBlock, orders: dict[str, torch.Tensor]) -> None:
        """Router rows (and the selection bias) move with their expert, so every token picks the same
        experts with the same weights; each expert's up (gate) rows and down columns with its neurons."""
        if "experts" in orders:
            experts, ffn = orders["experts"], orders.get("expert_ffn")
            for k in (key("router"), key("router_bias")):
                if k in sd:
                    sd[k] = sd[k].index_select(0, experts)
            old = dict(sd)
            for new, src in enumerate(experts.tolist()):
                for role in ("expert_up", "expert_gate", "expert_down"):
                    if key(role, src) not in old:
                        continue
                    t = old[key(role, src)]
                    if ffn is not None:
                        t = cols(t, ffn[new]) if role == "expert_down" else t.index_select(0, ffn[new])
                    sd[key(role, new)] = t
        if "shared_ffn" in orders:
            ups = [key(r) for r in ("shared_up", "shared_gate") if key(r) in sd]
            permute_neurons(sd, ups, key("shared_down"), orders["shared_ffn"])

    def sort_scores(self, scores: Scores, orders: dict[str, torch.Tensor]) -> Scores:
        out = super().sort_scores({n: v for n, v in scores.items() if n != "expert_ffn"}, orders)
        if "expert_ffn" in scores and "experts" in orders:
            ef, ffn = scores["expert_ffn"], orders["expert_ffn"]
            out["expert_ffn"] = torch.stack([ef[src][ffn[new]] for new, src in enumerate(orders["experts"].tolist())])
        return out

    def megatron_config(self, base: Any, b: MoeBlock) -> Any:
        from autocompress_nemo.blocks.mlp import dense_mlp_config
        from autocompress_nemo.models.megatron import activation

        if not has_routed_experts(b):  # routed experts removed: the shared expert is a dense MLP
            return dense_mlp_config(base, b.shared_ffn, b.activation)
        if b.top_k == 1 and base.moe_router_score_function == "sigmoid":
            raise ValueError(
                "MoE block with top_k=1 and a sigmoid router: Hugging Face Nemotron-H normalizes the top-k "
                "weights (a single expert gets weight 1.0) but Megatron only normalizes for top_k > 1; "
                "use top_k >= 2"
            )
        if b.latent and base.moe_shared_expert_overlap:
            raise ValueError("LatentMoE blocks need moe_shared_expert_overlap=False")
        act, gated = activation(b.activation)
        return dataclasses.replace(
            base,
            num_moe_experts=b.num_experts,
            moe_ffn_hidden_size=b.expert_ffn,
            moe_router_topk=b.top_k,
            moe_shared_expert_intermediate_size=b.shared_ffn or None,
            moe_latent_size=b.latent or None,
            activation_func=act,
            gated_linear_unit=gated,
        )

    def megatron_spec(self, b: MoeBlock, config: Any, m: dict[str, Any], chunk_size: int) -> Any:
        from autocompress_nemo.blocks.mlp import dense_mlp_spec

        if not has_routed_experts(b):
            return dense_mlp_spec(m)
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

        use_te = m["te"]
        return ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=m["moe_norm"],
                mlp=get_moe_module_spec(use_te=use_te, num_experts=b.num_experts, moe_grouped_gemm=use_te),
                mlp_bda=get_bias_dropout_add,
            ),
        )

    def shard_problem(self, b: MoeBlock, tp: int, ep: int, etp: int) -> str | None:
        out = []
        if has_routed_experts(b) and (b.num_experts % ep or b.expert_ffn % etp):
            out.append(f"{b.num_experts} experts vs EP={ep} or expert ffn {b.expert_ffn} vs expert-TP={etp}")
        if b.shared_ffn % tp:
            out.append(f"shared-expert ffn {b.shared_ffn} vs TP={tp}")
        return "; ".join(out) or None

    def expert_tensor_parallel(self, b: MoeBlock) -> bool:
        return bool(b.num_experts)

    def min_block(self, b: MoeBlock, caps: Any) -> MoeBlock:
        if caps.remove_moe:
            return MoeBlock(0, 0, 0, 0, b.latent, b.activation)
        top_k = 1 if caps.vary_top_k else b.top_k
        experts = top_k if caps.vary_experts else b.num_experts
        eff = max(caps.ffn_align, 1) if caps.vary_expert_ffn else b.expert_ffn
        shared = 0 if caps.vary_shared_ffn else b.shared_ffn
        return MoeBlock(experts, eff, min(top_k, experts), shared, b.latent, b.activation)

    def sharded_sizes(self, b: MoeBlock) -> list[tuple[str, str, int]]:
        out = (
            [("ep", "moe num_experts", b.num_experts), ("etp", "moe expert_ffn", b.expert_ffn)] if b.num_experts else []
        )
        return out + ([("tp", "moe shared_ffn", b.shared_ffn)] if b.shared_ffn else [])

    def params(self, b: MoeBlock, hidden: int, active: bool = False) -> int:
        """``h*E (router) + E' * ffn_params(L or h, F_e) + [2*h*L (latent down/up)] + ffn_params(h, S)
        + h (norm)``, with ``E' = k`` for active parameters and ``E`` for total."""
        inner = b.latent or hidden
        experts = b.top_k if active else b.num_experts
        n = hidden * b.num_experts  # router
        n += experts * ffn_params(inner, b.expert_ffn, b.gated) if b.num_experts else 0
        n += 2 * hidden * b.latent if b.latent else 0
        n += ffn_params(hidden, b.shared_ffn, b.gated) if b.shared_ffn else 0
        return n + hidden

    def activation_width(self, b: MoeBlock, hidden: int) -> int:
        return 2 * max(b.expert_ffn, b.shared_ffn) + hidden

    def parts(self, b: MoeBlock) -> tuple[MoeBlock, ...]:
        """Routed and shared parts (``moe_parts``): separate kernels, profiled and costed separately."""
        return moe_parts(b)


def has_routed_experts(b: Any) -> bool:
    """Whether ``b`` is an MoE block with routed experts."""
    return isinstance(b, MoeBlock) and bool(b.num_experts and b.expert_ffn)


def moe_parts(b: MoeBlock) -> tuple[MoeBlock, MoeBlock]:
    """The two additive parts of an MoE block, each an ``MoeBlock`` in canonical form:
    routed (router, routed experts, latent projections; ``shared_ffn = 0``) and shared
    (``num_experts = expert_ffn = top_k = latent = 0``). Latency of the block = the sum of the
    parts' latencies (they run as separate kernels); a removed part is removed (costs 0)."""
    routed = (
        MoeBlock(b.num_experts, b.expert_ffn, b.top_k, 0, b.latent, b.activation)
        if b.num_experts and b.expert_ffn
        else MoeBlock(0, 0, 0, 0, 0, b.activation)
    )
    return routed, MoeBlock(0, 0, 0, b.shared_ffn, 0, b.activation)


MOE = Moe()

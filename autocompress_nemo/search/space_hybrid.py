"""The search space of MoE / Mamba hybrids (Nemotron-H, Nemotron 3, Qwen3-MoE): one or two
decisions per prunable block, cut to what the engine can serve.

Decisions (``PartDecision``; every option keeps a *prefix* of the importance-sorted parent
dimension, so the supernet serves them all with one set of weights):

- ``attention`` / ``mlp`` blocks: as in the dense space (``space.attention_options`` /
  ``space.ffn_widths``); removal where ``remove_attention`` / ``remove_mlp``.
- ``mamba``: heads kept **in whole groups** (``G' * H/G`` heads, ``G' = 1..G``): the gated
  RMSNorm normalizes over the channels of one group, so keeping part of a group changes the
  normalization of the heads that stay (masking would not equal the extracted child); whole
  groups are exact. ``vary_mamba_heads``; ``remove_mamba`` adds ``G' = 0``.
- an MoE block has **two** decisions, because its cost is additive in two parts that run as
  separate kernels:

  * ``moe_routed``: joint options ``(experts E', expert ffn F', top-k k')`` (router, routed
    experts, LatentMoE projections), from a few levels each (``vary_experts``,
    ``vary_expert_ffn``, ``vary_top_k``), ``k' <= E'``; ``remove_moe`` adds "no routed
    experts". E' and F' are joint because the routed cost is *not* additive in them (weights
    ``E' * F'``; compute ``k' * F'``); ordered by total then active parameters, so
    "one option smaller" is the next cheaper routed configuration.
  * ``moe_shared``: shared-expert width ``S'`` (``vary_shared_ffn``; 0 allowed).

  Option blocks of the parts are the canonical part blocks of ``costs.table.moe_parts`` (the
  routed part has ``shared_ffn = 0``, the shared part ``num_experts = 0``), so the predictor
  prices each part from its own table entry and the expected cost stays linear in the
  probabilities; ``apply_hybrid_choices`` merges the two parts back into one ``MoeBlock``.
  (The parts' costs add up to the block's except the block's input norm, ``h`` parameters,
  counted in both parts by ``arch.counts``: negligible, and the exact face is exact.)

Top-k levels: ``{k} U {ceil(k*i/4), i = 2, 3}``, at least 2 unless the router is softmax-then-top-k
(``min_top_k``).
Hidden size is not varied here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from autocompress_nemo.arch.counts import block_params
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.config.engine import capabilities_of
from autocompress_nemo.costs.table import moe_parts
from autocompress_nemo.search.space import Decision, attention_options, ffn_widths, levels


@dataclass(frozen=True)
class PartDecision(Decision):
    """A decision over one part of a block (``kind`` ``moe_routed`` / ``moe_shared``) or a whole
    block (``attention``, ``mlp``, ``mamba``)."""

    def merge(self, current: Block, option: Block) -> Block:
        """The block after choosing ``option`` for this part of ``current``."""
        if self.kind == "moe_routed":
            assert isinstance(current, MoeBlock) and isinstance(option, MoeBlock)
            return dataclasses.replace(
                current,
                num_experts=option.num_experts,
                expert_ffn=option.expert_ffn,
                top_k=option.top_k if option.num_experts else current.top_k,
                latent=option.latent,
            )
        if self.kind == "moe_shared":
            assert isinstance(current, MoeBlock) and isinstance(option, MoeBlock)
            return dataclasses.replace(current, shared_ffn=option.shared_ffn)
        return option


def topk_levels(k: int, min_k: int) -> list[int]:
    return sorted({k} | {max(min_k, math.ceil(k * i / 4)) for i in (2, 3)})


def min_top_k(spec: ArchSpec) -> int:
    """1 only for a softmax-then-top-k router (Qwen3-MoE with ``norm_topk_prob=False``); else 2:
    Megatron does not normalize a single sigmoid weight, and refuses top-1 after top-k softmax."""
    return 1 if spec.family == "qwen3_moe" and spec.extra.get("norm_topk_prob", True) is False else 2


def moe_routed_options(parent: MoeBlock, spec: ArchSpec, caps: Any, n_levels: int = 4) -> list[MoeBlock]:
    """Joint routed options (see module docstring), smallest first, the parent's last."""
    caps = capabilities_of(caps)
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
            block_params(b, spec.hidden),
            block_params(b, spec.hidden, active=True),
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
    caps = capabilities_of(caps)
    _, shared = moe_parts(parent)
    if not parent.shared_ffn or not caps.vary_shared_ffn:
        return [shared]
    widths = [0] + levels(parent.shared_ffn, n_levels, caps.ffn_align)
    return [dataclasses.replace(shared, shared_ffn=w) for w in widths]


def mamba_options(parent: MambaBlock, caps: Any) -> list[MambaBlock]:
    """Whole groups: ``G' * H/G`` heads for ``G' = 1..G`` (0 when ``remove_mamba``)."""
    caps = capabilities_of(caps)
    hpg = parent.num_heads // parent.num_groups
    groups = range(1, parent.num_groups + 1) if caps.vary_mamba_heads else [parent.num_groups]
    opts = [dataclasses.replace(parent, num_heads=g * hpg, num_groups=g) for g in groups]
    if caps.remove_mamba:
        opts.insert(0, dataclasses.replace(parent, num_heads=0))
    return opts


def build_hybrid_space(parent: ArchSpec, caps: Any, ffn_options: int = 8, moe_levels: int = 4) -> list[Decision]:
    """Decisions for every block of a hybrid / MoE parent (see module docstring); blocks whose
    only option is the parent's get no decision."""
    caps = capabilities_of(caps)
    decisions: list[Decision] = []
    n = len(parent.blocks)
    for i, b in enumerate(parent.blocks):
        if b.removed:
            continue
        if isinstance(b, AttentionBlock):
            allow = caps.remove_attention and not (i == 0 and caps.first_block_full)
            opts: list[Any] = attention_options(b, caps, allow)
            kind = "attention"
        elif isinstance(b, MlpBlock):
            allow = caps.remove_mlp and not (i == n - 1 and caps.last_block_full)
            widths = (
                ffn_widths(b.ffn, ffn_options, caps.ffn_align, allow)
                if caps.vary_ffn
                else ([0] if allow else []) + [b.ffn]
            )
            opts, kind = [MlpBlock(w, b.activation) for w in widths], "mlp"
        elif isinstance(b, MambaBlock):
            opts, kind = mamba_options(b, caps), "mamba"
        elif isinstance(b, MoeBlock):
            if b.num_experts and b.expert_ffn:
                r = moe_routed_options(b, parent, caps, moe_levels)
                if len(r) > 1:
                    decisions.append(PartDecision(i, "moe_routed", tuple(r)))
            s = moe_shared_options(b, caps, moe_levels)
            if len(s) > 1:
                decisions.append(PartDecision(i, "moe_shared", tuple(s)))
            continue
        else:
            raise TypeError(f"block {i}: unknown block {b!r}")
        if len(opts) > 1:
            decisions.append(PartDecision(i, kind, tuple(opts)))
    return decisions


def apply_hybrid_choices(parent: ArchSpec, decisions: list[Decision], choices: list[int]) -> ArchSpec:
    """The child ArchSpec: every decision's option merged into its block (parts of one MoE block
    combine). An MoE block left with neither routed experts nor a shared expert is removed."""
    spec = parent
    for d, k in zip(decisions, choices, strict=True):
        cur = spec.blocks[d.block_index]
        new = d.merge(cur, d.options[k]) if isinstance(d, PartDecision) else d.options[k]
        spec = spec.replace_block(d.block_index, new)
    return spec


def decision_table(decisions: list[Decision]) -> list[dict[str, Any]]:
    """A JSON-able view of the space (for ``arch.json`` and reports)."""
    return [
        {"block": d.block_index, "kind": d.kind, "options": [dataclasses.asdict(o) for o in d.options]}
        for d in decisions
    ]

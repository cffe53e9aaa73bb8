"""The supernet: the sorted parent with masks over prefixes of each dimension.

A candidate keeps a prefix of every reordered dimension, so one set of weights serves
all candidates. Masks act on the inputs of the two row-parallel projections:

- attention: ``linear_proj`` input ``[S, B, H_local*d]`` times a per-query-head mask
  (a dropped KV group has all its query heads masked, so its K/V are never read);
- mlp: ``linear_fc2`` input ``[S, B, F_local]`` times a per-neuron mask.

A block whose mask is all zero writes nothing into the residual stream (no biases), which
is exactly a removed block. With one-hot choices the masked forward therefore equals the
forward of the extracted smaller model (tested). With soft choices the mask is the
expected mask ``sum_k p_k * 1[j kept by option k]``.

Under tensor parallelism each rank multiplies its own shard by its slice of the global mask.

The same masks serve MoE / Mamba hybrids:

Legend: T tokens, E routed experts, F expert ffn, S shared-expert ffn, H Mamba heads, p head dim.

Where each decision (``search/space.py``) acts:

- ``attention``: per-query-head mask on the ``linear_proj`` input (as the dense supernet);
- ``mlp``: per-neuron mask on the ``linear_fc2`` input;
- ``mamba``: per-head mask (whole groups) on the ``out_proj`` input, i.e. after the gated
  RMSNorm: a group's norm only sees its own heads, so dropping whole groups is exact (a
  removed block's ``out_proj`` then writes zero into the residual stream);
- ``moe_shared``: per-neuron mask on ``shared_experts.linear_fc2``'s input;
- ``moe_routed``: (a) expert ffn mask ``[F]`` on every routed expert's ``linear_fc2`` input;
  (b) the router's ``routing`` is replaced: dropped experts get ``-inf`` selection scores
  (logits and, for a sigmoid router, the selection bias) *before* top-k, so they are never
  picked and the top-k weights are renormalized over the kept experts exactly as the child's
  router does; (c) top-k: with the experts sorted by selection score, the weights of top-k
  option ``k'`` are the score function normalized over the first ``k'`` (sigmoid:
  ``s_r / sum_{r<k'} s_r`` for ``k' > 1``; softmax after top-k: softmax over the first ``k'``
  logits; softmax before top-k: unchanged), mixed linearly by the option weights (expert outputs
  are linear in their weights, so this is the expected output over ``k'``).

Soft (expected) masks for the router search: each mask is ``sum_k w_k * mask_k`` over the
options' keep-indicators. For routed experts the expected keep-mask ``m_e`` scales expert
``e``'s routing weight (so gradients reach the choice), while *selection* uses the hard mask
``m_e >= 0.5`` (an expert is excluded from top-k when most of the option weight drops it): a
straight-through-style relaxation, exact for one-hot choices. Group-limited routing, token
dropping and expert tensor parallelism are not supported with routed-expert decisions (a clear
error).

Expert parallelism: the MoE router is replicated and scores all ``E`` experts on every rank, so the
expert keep-mask ``m_e`` and the top-k weights index *global* (sorted) experts and act on this
rank's tokens; the expert-ffn mask is applied inside each rank's *local* experts (global ffn
index, no expert TP), i.e. to the tokens of every EP rank that the dispatcher sent there. Summing
the router-logit gradients over the data-parallel ranks therefore counts every use of every mask
once (``autocompress.run_router_search``); EP=2 equals EP=1 in tests/test_ep_stages.py.
"""

from __future__ import annotations

from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import Decision, kind_of
from autocompress_nemo.distributed.state import tensor_parallel
from autocompress_nemo.models.megatron import block_layers


def _tp() -> tuple[int, int]:
    _, rank, world = tensor_parallel()
    return rank, world


def option_masks(d: Decision, parent: ArchSpec) -> dict[str, torch.Tensor]:
    """``{mask name: [K, D]}`` keep-indicators of every option of ``d`` (its block kind's, ``blocks/``)."""
    return kind_of(d).masks(d, parent.blocks[d.block_index])


class Supernet:
    """Mask hooks on a Megatron model built from the sorted parent (``GPTModel`` or ``HybridModel``:
    ``models.megatron.block_layers`` finds each block's layer): ``set_choice_weights``,
    ``set_choices``, ``clear``, ``remove``, ``enabled``."""

    def __init__(self, model: torch.nn.Module, parent: ArchSpec, decisions: list[Decision]):
        self.model, self.parent, self.decisions = model, parent, decisions
        self.masks_of = [option_masks(d, parent) for d in decisions]
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        self._topk: dict[int, list[int]] = {}
        self._rows = 1
        self.enabled = True
        self._handles: list[Any] = []
        self._routers: list[Any] = []
        tp_rank, tp_world = _tp()
        layers = block_layers(model)
        for d, om in zip(decisions, self.masks_of, strict=True):
            bi, pb = d.block_index, parent.blocks[d.block_index]
            if bi not in layers:
                continue  # another pipeline stage
            layer = layers[bi]
            if "topk_values" in om:
                self._check_routed(layer, bi)
            for mod, name, unit, size, sharded in kind_of(d).mask_sites(d, layer, pb):
                self._hook(mod, (bi, name), unit, size, *((tp_rank, tp_world) if sharded else (0, 1)))
            if "topk_values" in om:
                self._install_router(layer, bi, [int(k) for k in om["topk_values"][0].tolist()])

    # -- hooks --------------------------------------------------------------------------
    def _hook(self, mod: torch.nn.Module, key: tuple[int, str], unit: int, size: int, rank: int, world: int) -> None:
        local = size // world
        start = local * rank

        def hook(_mod, args):  # noqa: ANN001, ANN202
            if not self.enabled or key not in self._masks:
                return None
            m = self._masks[key][..., start : start + local]
            if unit > 1:
                m = m.repeat_interleave(unit, dim=-1)
            x = args[0]
            if m.dim() == 2:  # one mask per child, each over its rows of the batch (``set_choices_rows``)
                m = m.repeat_interleave(self._rows, dim=0).unsqueeze(0)  # [1, children x rows, D]: x is [S, B, D]
            return (x * m.to(x.dtype),) + tuple(args[1:])

        self._handles.append(mod.register_forward_pre_hook(hook))

    @staticmethod
    def _check_routed(layer: Any, bi: int) -> None:
        cfg = layer.mlp.config
        if cfg.moe_router_group_topk or cfg.moe_expert_capacity_factor is not None:
            raise ValueError(
                f"block {bi}: routed-expert decisions need plain top-k routing (no group-limited "
                "routing, no token dropping); fix the engine capabilities or the model config"
            )
        if getattr(cfg, "expert_tensor_parallel_size", 1) not in (None, 1):
            raise ValueError(f"block {bi}: routed-expert decisions do not support expert tensor parallelism")

    def _install_router(self, layer: Any, bi: int, ks: list[int]) -> None:
        router = layer.mlp.router
        self._topk[bi] = ks
        original = type(router).routing

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None):  # noqa: ANN202
            if not self.enabled or (bi, "experts") not in self._masks:
                return original(router, logits, padding_mask=padding_mask)
            return self._masked_routing(router, bi, logits)

        router.routing = routing
        self._routers.append(router)

    def _masked_routing(self, router: Any, bi: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs [T, E], routing_map [T, E])`` of the masked router (module docstring, (b)-(c))."""
        cfg = router.config
        E = cfg.num_moe_experts
        L = logits.view(-1, E).float()
        m_e = self._masks[(bi, "experts")].to(L.device)
        w_k = self._masks[(bi, "topk")]
        ks = self._topk[bi]
        keep = m_e >= 0.5
        active = [j for j, w in enumerate(w_k.detach().tolist()) if w > 0]
        if not bool(keep.any()) or not active:  # no routed experts: the routed part adds nothing
            z = torch.zeros_like(L)
            return (z * m_e.sum()).type_as(logits), torch.zeros_like(L, dtype=torch.bool)
        kmax = min(max(ks[j] for j in active), E)
        neg = torch.tensor(float("-inf"), device=L.device)
        score_fn = router.score_function
        if score_fn == "sigmoid":
            scores = torch.sigmoid(L)
            sel = scores + router.expert_bias.float() if router.expert_bias is not None else scores
            idx = torch.where(keep, sel, neg).topk(kmax, dim=1).indices
            s = scores.gather(1, idx) * keep[idx]
        elif score_fn == "softmax" and cfg.moe_router_pre_softmax:
            scores = torch.softmax(torch.where(keep, L, neg), dim=-1)
            idx = scores.topk(kmax, dim=1).indices
            s = scores.gather(1, idx)
        elif score_fn == "softmax":
            top = torch.where(keep, L, neg).topk(kmax, dim=1)
            idx, s = top.indices, top.values
        else:
            raise ValueError(f"block {bi}: router score function {score_fn!r} is not supported by the supernet")
        probs_top = torch.zeros_like(s)
        for j in active:
            k = min(ks[j], kmax)
            part = s[:, :k]
            if score_fn == "sigmoid":
                part = part / (part.sum(dim=-1, keepdim=True) + 1e-20) if ks[j] > 1 else part
            elif not cfg.moe_router_pre_softmax:
                part = torch.softmax(part, dim=-1).nan_to_num(0.0)
            probs_top = probs_top + w_k[j] * torch.nn.functional.pad(part, (0, kmax - k))
        if cfg.moe_router_topk_scaling_factor:
            probs_top = probs_top * cfg.moe_router_topk_scaling_factor
        probs_top = probs_top * (m_e[idx] * keep[idx])
        probs = torch.zeros_like(L).scatter(1, idx, probs_top)
        routing_map = torch.zeros_like(L, dtype=torch.bool).scatter(1, idx, keep[idx])
        return probs.type_as(logits), routing_map

    # -- masks --------------------------------------------------------------------------
    def set_choice_weights(self, weights: list[torch.Tensor]) -> None:
        """Masks from per-decision option weights (one-hot, probabilities or Gumbel samples)."""
        for d, om, w in zip(self.decisions, self.masks_of, weights, strict=True):
            for name, m in om.items():
                if name != "topk_values":
                    self._masks[(d.block_index, name)] = w.to(m.dtype) @ m

    def set_choices(self, choices: list[int]) -> None:
        self.set_choice_weights(
            [
                torch.nn.functional.one_hot(torch.tensor(k), len(d.options)).float()
                for d, k in zip(self.decisions, choices, strict=True)
            ]
        )

    def rows_batchable(self) -> bool:
        """Whether several children can share one forward (``set_choices_rows``): every mask acts on a
        dense ``[S, B, D]`` input (attention heads, MLP neurons); MoE (tokens dispatched to experts) and
        Mamba decisions are judged one child at a time."""
        return all(kind_of(d).name in ("attention", "mlp") for d in self.decisions) and not self._routers

    def set_choices_rows(self, children: list[list[int]], rows: int) -> None:
        """One-hot masks of several children at once: child ``g`` masks rows ``g*rows .. (g+1)*rows - 1``
        of the batch (the caller repeats its batch once per child). Each child's forward equals its
        own one-child forward (the masks are 0 / 1 per row; ``tests/test_judge_batched.py``)."""
        if not self.rows_batchable():
            raise ValueError("set_choices_rows: MoE / Mamba decisions are judged one child at a time")
        per: dict[tuple[int, str], list[torch.Tensor]] = {}
        for choices in children:
            for d, om, k in zip(self.decisions, self.masks_of, choices, strict=True):
                for name, m in om.items():
                    if name != "topk_values":
                        per.setdefault((d.block_index, name), []).append(m[int(k)])
        self._masks = {key: torch.stack(ms) for key, ms in per.items()}
        self._rows = int(rows)

    def clear(self) -> None:
        self._masks.clear()

    def remove(self) -> None:
        for hd in self._handles:
            hd.remove()
        self._handles.clear()
        for r in self._routers:
            r.__dict__.pop("routing", None)
        self._routers.clear()

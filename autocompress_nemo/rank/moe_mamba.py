"""Importance for hybrid / MoE models (``models/hybrid``: Nemotron-H, Qwen3-MoE), every prunable
dimension measured in one calibration pass: routed experts, expert ffn neurons, shared-expert
neurons, Mamba heads, attention query heads (hence KV groups), dense-MLP neurons and hidden
channels. The permutations that sort them and their application are ``reorder_hybrid.py``.

Legend: T tokens, h hidden, E routed experts, F expert ffn, Fs shared-expert ffn, H Mamba heads,
G Mamba groups, p Mamba head dim, N state size; ``p_te`` is token t's routing weight for expert e
(0 when e is not in its top-k), ``y_te`` expert e's output for token t.

Scores follow ``importance.py`` (whose ``Accumulator`` hooks they use): mean magnitudes over the
calibration tokens (divided by the number of tokens T, so they add up on one scale):

- routed expert e: ``sum_t p_te * ||y_te|| / T`` — routing mass times output contribution (a
  rarely routed expert, or one that writes little, scores low);
- expert e's ffn neuron n: ``sum_t p_te * |a_ten| * ||W_down_e[:, n]|| / T`` (``a`` the activation);
- shared-expert neuron n, dense-MLP neuron n (relu² in Nemotron-H: no gate):
  ``mean_t |a_tn| * ||W_down[:, n]||``;
- Mamba head i: ``mean_t ||W_out[:, i] y_ti||`` with ``y`` the gated-norm output (the input of
  ``out_proj``) — the norm of that head's contribution to the block output; a group scores the
  sum of its heads;
- attention query head i: ``mean_t ||W_o[:, i] o_ti||``; a KV group scores the sum of its heads;
- hidden channel c: ``mean_t |x_tc|`` summed over the normalized input of every block (inputs of
  Mamba ``in_proj``, attention ``linear_qkv``, MLP ``linear_fc1`` and the MoE router).

Parallelism: heads / neurons of TP-sharded layers are gathered over TP; experts are gathered over
EP (each rank's local experts saw the tokens of every EP rank: allgather dispatch) and, with expert
tensor parallelism (= TP, Megatron's default), an expert's partial output is summed over ETP before
its norm is taken and its neurons are gathered over ETP; the experts see each token once per TP rank
(the dispatcher gathers over TP x EP), which is divided out. Every non-expert sum and the token
count are summed over EP (EP ranks hold different sequences). Every rank ends with the same global
vectors. Sequence parallelism and ETP != TP are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.rank.importance import Accumulator, cat_over, parallel_groups, sum_over


@dataclass
class BlockScores:
    experts: torch.Tensor | None = None  # [E]
    expert_ffn: torch.Tensor | None = None  # [E, F]
    shared_ffn: torch.Tensor | None = None  # [Fs]
    mamba_heads: torch.Tensor | None = None  # [H]
    heads: torch.Tensor | None = None  # [H] attention query heads
    ffn: torch.Tensor | None = None  # [F] dense MLP neurons


SCORE_FIELDS = tuple(f.name for f in fields(BlockScores))


@dataclass
class MoeMambaImportance:
    blocks: list[BlockScores] = field(default_factory=list)
    tokens: int = 0
    hidden: torch.Tensor | None = None  # [h]

    def to_dict(self) -> dict[str, Any]:
        def lst(x: torch.Tensor | None) -> list | None:
            return None if x is None else x.tolist()

        return {
            "tokens": self.tokens,
            "hidden": lst(self.hidden),
            "blocks": [{f: lst(getattr(b, f)) for f in SCORE_FIELDS} for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoeMambaImportance:
        """Inverse of ``to_dict``; fields missing in older files read as ``None``."""

        def t(x: list | None) -> torch.Tensor | None:
            return None if x is None else torch.tensor(x, dtype=torch.float64)

        return cls(
            blocks=[BlockScores(**{f: t(b.get(f)) for f in SCORE_FIELDS}) for b in d["blocks"]],
            tokens=int(d["tokens"]),
            hidden=t(d.get("hidden")),
        )


def _register(acc: Accumulator, model: torch.nn.Module, spec: ArchSpec, etp: tuple[int, Any]) -> None:
    """The hooks of every present block (see the module docstring)."""
    decoder: Any = model.decoder
    for layer in decoder.layers:
        g = int(layer.layer_number) - 1
        b = spec.blocks[g]
        if b.removed:
            continue
        mlp = getattr(layer, "mlp", None)
        if isinstance(b, MambaBlock):
            acc.head_norms(layer.mixer.out_proj, (g, "mamba_heads"), b.head_dim)
            acc.channels(layer.mixer.in_proj)
        elif isinstance(b, AttentionBlock):
            acc.head_norms(layer.self_attention.linear_proj, (g, "heads"), b.head_dim)
            acc.channels(layer.self_attention.linear_qkv)
        elif mlp is not None and hasattr(mlp, "experts"):  # MoE with routed experts
            _register_experts(acc, g, mlp, etp)
            if getattr(mlp, "shared_experts", None) is not None:
                acc.neurons(mlp.shared_experts.linear_fc2, (g, "shared_ffn"))
            acc.channels(mlp.router)
        elif mlp is not None:  # dense MLP, or an MoE block left with only its shared expert
            acc.neurons(mlp.linear_fc2, (g, "ffn" if isinstance(b, MlpBlock) else "shared_ffn"))
            acc.channels(mlp.linear_fc1)


def _register_experts(acc: Accumulator, g: int, mlp: Any, etp: tuple[int, Any]) -> None:
    local = getattr(mlp.experts, "local_experts", None)
    if local is None:
        raise ValueError(
            f"block {g}: routed experts of type {type(mlp.experts).__name__} (grouped GEMM) cannot be "
            "scored one by one; build the calibration model with per-expert modules (impl='local')"
        )
    acc.zeros((g, "experts"), (len(local),), mlp)
    for j, expert in enumerate(local):

        def expert_hook(mod: Any, args: tuple, out: Any, j: int = j) -> None:
            y = sum_over(out[0].double(), *etp)  # partial sums over ETP; already weighted by p_te
            acc.add((g, "experts"), y.norm(dim=-1).sum(), j)

        acc.post_hook(expert, expert_hook)
        acc.neurons(expert.linear_fc2, (g, "expert_ffn"), row=j, rows=len(local))  # activation already times p_te


@torch.no_grad()
def collect_moe_mamba_importance(
    model: torch.nn.Module,
    spec: ArchSpec,
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> MoeMambaImportance:
    """Run ``forward(model, input_ids_BT)`` over ``batches`` (a ``models.hybrid`` model) and score every
    dimension as above; every rank returns the same global vectors (module docstring: parallelism)."""
    if getattr(model.config, "sequence_parallel", False):
        raise ValueError("collect_moe_mamba_importance: run the calibration pass without sequence parallelism")
    groups = parallel_groups()
    (tp, tp_group), (ep, ep_group), (etp, etp_group) = groups["tp"], groups["ep"], groups["etp"]
    if etp != tp and any(isinstance(b, MoeBlock) and b.num_experts for b in spec.blocks):
        raise ValueError(
            f"collect_moe_mamba_importance: expert tensor parallel size {etp} != tensor parallel "
            f"size {tp}; run the rank stage with cluster.etp equal to cluster.tp (or 0)"
        )
    acc = Accumulator()
    _register(acc, model, spec, groups["etp"])
    tokens = acc.run(model, batches, forward)
    dev = next(iter(acc.sums.values())).device if acc.sums else None
    total = int(sum_over(torch.tensor([tokens], dtype=torch.float64, device=dev), ep, ep_group).item())
    out = MoeMambaImportance(blocks=[BlockScores() for _ in spec.blocks], tokens=total)
    n = max(total, 1)
    for key, v in acc.sums.items():  # the same keys, in the same order, on every rank
        if key == "hidden":
            out.hidden = sum_over(v, ep, ep_group).cpu() / n
            continue
        g, kind = cast(tuple[int, str], key)
        if kind == "experts":
            v = cat_over(v, ep, ep_group) / tp
        elif kind == "expert_ffn":
            v = cat_over(cat_over(v, etp, etp_group, dim=1), ep, ep_group) / tp
        else:  # TP-sharded heads / neurons, on this rank's sequences
            v = cat_over(sum_over(v, ep, ep_group), tp, tp_group)
        setattr(out.blocks[g], kind, v.cpu() / n)
    return out

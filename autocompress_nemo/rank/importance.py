"""Activation-based importance (Minitron-style) of every prunable dimension of a Megatron model, in
one calibration pass: attention query heads (hence KV groups), MLP / shared-expert / routed-expert
neurons, routed experts, Mamba heads and hidden channels.

Every block registers its kind's hooks (``blocks/<kind>.score``, measures of ``rank/hooks.py``) on
its Megatron layer (``models/megatron.block_layers``: a ``GPTModel`` layer holds an attention and an
mlp block, a ``HybridModel`` layer one block). Scores are mean magnitudes over the calibration
tokens (sums divided by the token count T), so they add up across blocks and kinds on one scale —
"how much this unit writes into / reads from the residual stream":

- query head i: ``mean_t ||W_o[:, i] o_ti||``; Mamba head i likewise on ``out_proj``;
- neuron n (MLP, shared expert): ``mean_t |a_tn| * ||W_down[:, n]||``; a routed expert's neuron
  is weighted by the routing weight ``p_te`` (0 when the token does not pick the expert);
- routed expert e: ``sum_t p_te * ||y_te|| / T`` (routing mass times output);
- hidden channel c: ``mean_t |x_tc|`` over the normalized input of every block.

Parallelism (``hooks.Accumulator.reduced``): heads / neurons of TP-sharded layers are gathered over
TP; experts over EP (allgather dispatch: every rank's local experts see every EP rank's tokens),
their neurons over ETP then EP, divided by TP (each token reaches the experts once per TP rank);
every other sum and the token count are summed over EP (EP ranks hold different sequences), and the
residual-stream sums over TP too under sequence parallelism. Every rank ends with the same global
vectors, hence one global order. Sequence parallelism with MoE / Mamba blocks and ETP != TP are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.blocks.base import Scores
from autocompress_nemo.models.megatron import block_layers
from autocompress_nemo.rank.hooks import Accumulator, parallel_groups, sum_over


@dataclass
class Importance:
    """``blocks[i]``: block ``i``'s scores by name (``blocks/<kind>.score``); ``hidden [h]``."""

    blocks: list[Scores] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "hidden": None if self.hidden is None else self.hidden.tolist(),
            "blocks": [{n: v.tolist() for n, v in b.items()} for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Importance:
        def t(x: list | None) -> torch.Tensor | None:
            return None if x is None else torch.tensor(x, dtype=torch.float64)

        if "blocks" not in d:
            raise ValueError("scores written by an older build (no 'blocks'); delete the rank directory and rerun")
        return cls(
            blocks=[{n: t(v) for n, v in b.items() if v is not None} for b in d["blocks"]],  # type: ignore[misc]
            hidden=t(d.get("hidden")),
            tokens=int(d["tokens"]),
        )


class _HeadReached(Exception):
    """Raised by the pre-hook on the LM head: the calibration pass needs the blocks' inputs only."""


def _without_head(
    model: torch.nn.Module, forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
) -> Callable[[torch.nn.Module, torch.Tensor], Any]:
    """``forward`` stopped where the model's LM head (``output_layer``) would start: no score reads the
    logits, and the head is a fifth of a small model's forward (SmolLM2-135M: 49152 x 576 per token,
    0.93 of 4.4 TFLOP over 16,384 tokens). Every rank stops at the same module, before its collectives.
    A model without ``output_layer`` runs ``forward`` whole."""
    head = getattr(model, "output_layer", None)
    if not isinstance(head, torch.nn.Module):
        return forward

    def stop(mod: Any, args: tuple) -> None:
        raise _HeadReached

    def run(m: torch.nn.Module, input_ids: torch.Tensor) -> None:
        handle = head.register_forward_pre_hook(stop)
        try:
            forward(m, input_ids)
        except _HeadReached:
            pass
        finally:
            handle.remove()

    return run


def _logged(batches: Iterable[torch.Tensor], log: Callable[[str], None] | None) -> Iterable[torch.Tensor]:
    """``batches``, with ``[rank i/n]`` and the time left logged at every tenth (and the last) when
    ``log`` is given and their number is known."""
    if log is None or not hasattr(batches, "__len__"):
        yield from batches
        return
    import time

    n, t0, step = len(batches), time.time(), max(1, len(batches) // 10)  # type: ignore[arg-type]
    for i, x in enumerate(batches):
        yield x
        if (i + 1) % step == 0 or i + 1 == n:
            el = time.time() - t0
            log(f"[rank {i + 1}/{n}] calibration batches, {el:.0f} s, ~{el / (i + 1) * (n - i - 1):.0f} s left")


@torch.no_grad()
def collect_importance(
    model: torch.nn.Module,
    spec: ArchSpec,
    batches: Iterable[torch.Tensor],
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    *,
    accumulator: type[Accumulator] = Accumulator,
    skip_head: bool = True,
    log: Callable[[str], None] | None = None,
) -> Importance:
    """Run ``forward(model, input_ids_BT)`` over ``batches`` and score every present block's units:
    one forward per batch with the blocks' hooks on, stopped before the LM head (``skip_head``).
    ``accumulator``: the class holding the sums (``bench/bench_rank.py`` times the old one against
    it); ``log``: a progress line every tenth of the batches."""
    sp = bool(getattr(model.config, "sequence_parallel", False))
    groups = parallel_groups()
    if sp and any(b.kind not in ("attention", "mlp") for b in spec.blocks):
        raise ValueError(
            "collect_importance: run the calibration pass of MoE / Mamba models without sequence parallelism"
        )
    (tp, _), (ep, ep_group), (etp, _) = groups["tp"], groups["ep"], groups["etp"]
    if etp != tp and any(kind_of(b).expert_tensor_parallel(b) for b in spec.blocks):
        raise ValueError(
            f"collect_importance: expert tensor parallel size {etp} != tensor parallel size {tp}; "
            "run the rank stage with cluster.etp equal to cluster.tp (or 0)"
        )
    acc = accumulator(groups)
    for i, layer in sorted(block_layers(model).items()):
        b = spec.blocks[i]
        if not b.removed:
            kind_of(b).score(acc, layer, i, b)
    fwd = _without_head(model, forward) if skip_head else forward
    tokens = acc.run(model, _logged(batches, log), fwd)
    dev = next(iter(acc.sums.values())).device if acc.sums else None
    total = int(sum_over(torch.tensor([tokens], dtype=torch.float64, device=dev), ep, ep_group).item())
    out = Importance(blocks=[{} for _ in spec.blocks], tokens=total)
    n = max(total, 1)
    for key in list(acc.sums):  # the same keys, in the same order, on every rank
        v = acc.reduced(key, sp).cpu() / n
        if key == "hidden":
            out.hidden = v
        else:
            i, name = cast(tuple[int, str], key)  # every key but the hidden one: (block, score name)
            out.blocks[i][name] = v
    if out.hidden is None:
        out.hidden = torch.zeros(spec.hidden, dtype=torch.float64)
    return out

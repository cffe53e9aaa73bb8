"""What a block kind is: the interface every kind module implements, and the decision type.

A kind (``attention``, ``mlp``, ``moe``, ``mamba``) owns, for its blocks: the search options an
engine's capabilities allow (``decisions``), how a chosen option goes back into the block
(``merge``), the supernet's keep-masks over the sorted parent (``masks``), the importance an option
keeps (``kept_importance``), its widths for a uniform (Minitron++) shape (``widths``), a one-line
description (``describe``), the prefix rule a child block must obey (``prefix_problem``), its
Hugging Face tensors (``roles``) and how each is sliced from the sorted parent (``slice``), its
importance hooks on the Megatron layer (``score``), the orders that sort its scores (``orders``) and
their application to its tensors (``permute``, ``sort_scores``). The registry
(``blocks/__init__.py``) maps kind names and decision kinds to the kind objects; stages and the
search loop over blocks and ask it, with no per-kind switch of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from autocompress_nemo.arch.spec import ArchSpec, Block

if TYPE_CHECKING:
    from autocompress_nemo.rank.hooks import Accumulator

Role = tuple[str, int | None, tuple[int, ...]]
"""``(role, routed expert or None, shape)`` of one Hugging Face tensor of a block (``models/hybrid/names``)."""
Scores = dict[str, torch.Tensor]
"""One block's rank scores by name (``heads``, ``ffn``, ``experts``, ``expert_ffn``, ...)."""
MaskSite = tuple[Any, str, int, int, bool]
"""``(module, mask name, unit, size, tp_sharded)``: the supernet multiplies ``module``'s input by the
mask ``name`` (one entry per ``unit`` channels, ``size`` units; split over TP ranks when sharded)."""
Key = Callable[..., str]
"""``key(role, expert=None)``: the Hugging Face name of one of the block's tensors."""


@dataclass(frozen=True)
class Decision[B: Block]:
    """One choice of the search: the options block ``block_index`` (or a part of it, ``kind`` e.g.
    ``moe_routed``) may take, every one a *prefix* of the importance-sorted parent dimension
    (``B``: the block type of the kind that made it; ``Decision`` alone: any block)."""

    block_index: int
    kind: str
    options: tuple[B, ...]
    """Smallest first; the last option is the parent's own block."""

    @property
    def parent_option(self) -> int:
        return len(self.options) - 1


@dataclass(frozen=True)
class Grid:
    """How finely widths are offered: ``ffn_options`` points per ffn width, ``moe_levels`` per MoE
    dimension (experts, expert ffn, shared ffn)."""

    ffn_options: int = 8
    moe_levels: int = 4


def levels(parent: int, n: int, align: int = 1, minimum: int = 1) -> list[int]:
    """``{parent} U {floor(parent*i/n / align)*align, i=1..n-1}`` that are ``>= minimum``, ascending:
    the one width grid of every dimension (profiling, validation and search draw from it)."""
    align = max(1, int(align))
    out = {parent}
    for i in range(1, max(1, n)):
        w = (parent * i // n) // align * align
        if w >= max(1, minimum):
            out.add(w)
    return sorted(out)


class Kind(ABC):
    """A block kind. Subclasses set ``name``, ``block_type`` and ``decision_kinds`` and implement
    every abstract method (a kind missing one cannot be instantiated, so it cannot be registered);
    ``merge`` and ``slice`` have defaults for a block with one decision over prefix dimensions."""

    name: ClassVar[str]
    block_type: ClassVar[type]
    decision_kinds: ClassVar[tuple[str, ...]]

    @abstractmethod
    def decisions(self, spec: ArchSpec, i: int, block: Any, caps: Any, grid: Grid) -> list[Decision]:
        """Block ``i``'s decisions under the engine's capabilities (none when only the parent's shape is allowed)."""

    def merge(self, d: Decision, current: Any, option: Any) -> Any:
        """The block after choosing ``option`` of ``d`` for ``current`` (a whole-block decision: the option)."""
        return option

    @abstractmethod
    def masks(self, d: Decision, parent_block: Any) -> dict[str, torch.Tensor]:
        """``{mask name: [K, D]}`` keep-indicators of every option over the sorted parent dimension."""

    @abstractmethod
    def mask_sites(self, d: Decision, layer: Any, parent_block: Any) -> list[MaskSite]:
        """Where the supernet applies ``d``'s masks on the block's Megatron ``layer``."""

    @abstractmethod
    def kept_importance(self, d: Decision, option: Any, scores: Any) -> float:
        """The summed sorted-parent scores ``option`` keeps (``scores``: the block's rank scores)."""

    @abstractmethod
    def widths(self, option: Any) -> tuple[int, ...]:
        """The widths an option keeps, per dimension a uniform (Minitron++) shape is uniform in."""

    @abstractmethod
    def describe(self, block: Any) -> str:
        """A short shape for logs (``A9h3kv``, ``F1536``, ...)."""

    @abstractmethod
    def words(self, block: Any) -> str:
        """The shape in the report's words (``8h/4kv``, ``1536``, ``32 experts x 512 (top-2), shared 1024``)."""

    @abstractmethod
    def fields(self, block: Any) -> str:
        """The shape as ``key=value`` words (``heads=9 kv=3``, ``ffn=1536``) for Minitron++'s log."""

    @abstractmethod
    def plot_width(self, block: Any) -> int:
        """One number for a width plot: heads, the ffn width, the experts' total width."""

    plot_unit: ClassVar[str]
    """What ``plot_width`` counts, for the plot's axis (``query heads``, ``ffn width`` ...)."""

    @abstractmethod
    def prefix_problem(self, parent_block: Any, child_block: Any) -> str | None:
        """Why ``child_block`` is not a prefix of ``parent_block`` (None: it is)."""

    @abstractmethod
    def roles(self, spec: ArchSpec, block: Any) -> list[Role]:
        """The block's Hugging Face tensors after its ``norm`` (``role``, expert, shape)."""

    @abstractmethod
    def score(self, acc: Accumulator, layer: Any, i: int, block: Any) -> None:
        """Register block ``i``'s importance hooks on its Megatron ``layer`` (sums keyed ``(i, name)``,
        the hidden channels its normalized input reads under ``"hidden"``)."""

    @abstractmethod
    def orders(self, block: Any, scores: Scores) -> dict[str, torch.Tensor]:
        """``{name: new -> old order}`` sorting every scored dimension, most important first."""

    @abstractmethod
    def permute(self, sd: dict[str, torch.Tensor], key: Key, block: Any, orders: dict[str, torch.Tensor]) -> None:
        """Apply ``orders`` to the block's tensors in ``sd`` (in place; the function is unchanged)."""

    # -- Megatron (HybridModel: one layer per block; imports are lazy, Megatron loads on first use) --
    @abstractmethod
    def megatron_config(self, base: Any, block: Any) -> Any:
        """``base`` (a ``TransformerConfig``) with the fields of this block."""

    @abstractmethod
    def megatron_spec(self, block: Any, config: Any, modules: dict[str, Any], chunk_size: int) -> Any:
        """The block's Megatron layer spec (``modules``: the local or Transformer Engine building blocks)."""

    @abstractmethod
    def shard_problem(self, block: Any, tp: int, ep: int, etp: int) -> str | None:
        """Why the block cannot be split at these parallel sizes (None: it can)."""

    def gguf_matrices(self, block: Any, hidden: int) -> list[tuple[str, tuple[int, int]]]:
        """The block's GGUF weight matrices ``(llama.cpp tensor role, shape)``, for pricing a quantized
        GGUF (``costs/memory.block_weight_bytes``); kinds it does not price have none."""
        return []

    def expert_tensor_parallel(self, block: Any) -> bool:
        """Whether the block holds weights that expert tensor parallelism splits (routed experts)."""
        return False

    def capability_problems(self, i: int, block: Any, ref: Any, caps: Any) -> list[str]:
        """Why block ``i`` is not served under the engine's capabilities (``EngineCapabilities``),
        judged against ``ref`` (the parent's first block of this kind, or None): here, a removed
        block the engine cannot serve; a kind adds the rules of its own shape."""
        if block.removed and not getattr(caps, f"remove_{self.name}"):
            return [f"block {i}: removed {self.name} is not served (remove_{self.name}=False)"]
        return []

    @abstractmethod
    def min_block(self, block: Any, caps: Any) -> Any:
        """The smallest shape of ``block`` the engine's capabilities (``EngineCapabilities``) let the
        search reach (the planner's smallest servable model, ``plan/serving.py``)."""

    @abstractmethod
    def sharded_sizes(self, block: Any) -> list[tuple[str, str, int]]:
        """``(parallel dimension, what, size)`` for every size of the block a parallel dimension
        (``tp``, ``ep``, ``etp``) must divide (the layout check, ``plan/layout.py``)."""

    def mixing_flops(self, block: Any, seq_len: int, full_square: bool = False) -> float:
        """Forward FLOPs per token beyond ``2 x`` its active parameters (attention scores over the
        sequence, a Mamba scan); 0 for the rest. ``full_square``: attention computed unmasked over
        all ``seq_len`` positions (the unfused CPU path), not the causal half."""
        return 0.0

    # -- counts (formulas in each kind's docstrings; a removed block is never asked) --------------
    @abstractmethod
    def params(self, block: Any, hidden: int, active: bool = False) -> int:
        """Parameters of the block, its input norm included (``active``: those one token touches)."""

    def small_params(self, block: Any, hidden: int) -> int:
        """Parameters GGUF writers keep in F32 (norms, per-head scalars): the input norm ``h``."""
        return hidden

    def kv_bytes_per_token(self, block: Any, dtype_bytes: float) -> float:
        """KV cache per token of context (attention only)."""
        return 0.0

    def state_elements(self, block: Any, conv_extra: int = 0) -> int:
        """Recurrent state per sequence, constant in context (Mamba only); ``conv_extra`` conv-state
        columns an engine keeps beyond the ``K-1`` past inputs."""
        return 0

    @abstractmethod
    def activation_width(self, block: Any, hidden: int) -> int:
        """The widest activation of one token through the block (an uncalibrated workspace estimate)."""

    def size(self, block: Any) -> int:
        """Orders a kind's options by size (the nearest wider profiled option stands in for an unprofiled one)."""
        return 0

    def parts(self, block: Any) -> tuple[Any, ...]:
        """The additively costed parts the cost table profiles separately (default: the block itself)."""
        return (block,)

    def interpolate(self, block: Any, entries: list[tuple[Any, float]]) -> float | None:
        """A cost of an unprofiled ``block`` from its kind's profiled ``(block, cost)`` entries, or None."""
        return None

    def sort_scores(self, scores: Scores, orders: dict[str, torch.Tensor]) -> Scores:
        """The scores in sorted order (a score and its order share a name)."""
        return {n: v[orders[n]] if n in orders else v for n, v in scores.items()}

    def refit(self, parent_block: Any, child_block: Any) -> tuple[str, torch.Tensor] | None:
        """The output projection a narrower child re-fits by least squares (``extract/compensate.py``):
        its role and the sorted parent's input channels the child keeps. None (the default): the
        block is kept whole, removed, or its kind has no such projection here."""
        return None

    def refit_site(self, layer: Any) -> Any:
        """The Megatron module whose input is the ``refit`` projection's input, on the block's ``layer``."""
        raise NotImplementedError(f"{self.name} blocks have no least-squares re-fit")

    def slice(
        self, parent_block: Any, child_block: Any, role: str, t: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The child's tensor of ``role`` from the sorted parent's ``t``: a prefix along every dimension
        unless the kind keeps rows in another order."""
        return t[tuple(slice(0, n) for n in shape)]


def must_keep(spec: ArchSpec, i: int, caps: Any) -> bool:
    """Whether block ``i`` may not be removed because the engine needs a block of its kind
    (``caps.keep_first_of``): the first kept block of such a kind stays."""
    kind = spec.blocks[i].kind
    if kind not in (getattr(caps, "keep_first_of", None) or ()):
        return False
    return next(j for j, b in enumerate(spec.blocks) if b.kind == kind and not b.removed) == i


def ffn_params(hidden: int, ffn: int, gated: bool) -> int:
    """One feed-forward network without norm: ``(3 if gated else 2) * h * F``."""
    return (3 if gated else 2) * hidden * ffn


def prefix_rows(n: int, keep: list[int]) -> torch.Tensor:
    """``[K, n]`` indicators of the first ``keep[k]`` of ``n`` sorted units."""
    j = torch.arange(n)
    return torch.stack([(j < k).float() for k in keep])


def need(scores: Scores, name: str, d: Decision) -> torch.Tensor:
    """``scores[name]``, or a clear error when the rank artifact lacks it (an older build wrote it)."""
    v = scores.get(name)
    if v is None:
        raise ValueError(
            f"block {d.block_index} ({d.kind} decision): the rank artifact has no {name!r} "
            "scores; it was written by an older build: delete the rank stage's directory and run again"
        )
    return v

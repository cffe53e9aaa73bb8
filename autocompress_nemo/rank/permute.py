"""Reordering a Hugging Face-named state dict along one dimension: the operations every block kind's
``permute`` (``blocks/``) is made of. Orders are ``new -> old`` index vectors; reordering is a change
of basis that leaves the function computed unchanged.

- heads: query heads (``q`` rows, ``o`` columns) with their head, K/V rows with their KV group —
  whole heads move, so RoPE's per-head layout and per-head q / k norms are untouched;
- neurons: up (gate) rows and down columns together;
- hidden channels: columns of every matrix that reads the residual stream, rows of every one that
  writes it (and their biases), the norms' weights (RMSNorm is permutation-equivariant).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def argsort_desc(x: torch.Tensor) -> torch.Tensor:
    """Stable descending order (ties keep their original order: determinism)."""
    return torch.argsort(-x.double(), stable=True)


def grouped_order(scores: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group order [G], unit order [G*u])`` (new -> old) of ``scores [G*u]``, units ``g*u .. g*u+u-1``
    belonging to group ``g``: groups by their summed score, the units inside each group by their
    own score, so a group's units stay together (attention query heads of a KV group, Mamba heads
    of a group)."""
    per_group = scores.view(n_groups, -1)
    u = per_group.shape[1]
    groups = argsort_desc(per_group.sum(dim=1))
    return groups, torch.cat([g * u + argsort_desc(per_group[g]) for g in groups.tolist()])


def check_grouped(where: str, heads: torch.Tensor, groups: torch.Tensor, n_groups: int) -> None:
    """``heads`` must keep the heads of a group together, in the group order ``groups``."""
    hpg = len(heads) // n_groups
    if not torch.equal(heads.view(n_groups, hpg) // hpg, groups.view(-1, 1).expand(-1, hpg)):
        raise ValueError(f"{where}: the head order does not keep the heads of a group together in group order")


def rows(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """Row blocks of size ``unit`` (one head = ``d`` rows) in order ``idx``."""
    return w.view(-1, unit, *w.shape[1:]).index_select(0, idx).reshape(w.shape)


def cols(w: torch.Tensor, idx: torch.Tensor, unit: int = 1) -> torch.Tensor:
    return rows(w.transpose(0, 1), idx, unit).transpose(0, 1).contiguous()


def _bias(name: str) -> str:
    return name.removesuffix(".weight") + ".bias"


def permute_heads(
    sd: dict[str, torch.Tensor],
    q: str,
    k: str,
    v: str,
    o: str,
    heads: torch.Tensor,
    groups: torch.Tensor,
    head_dim: int,
) -> None:
    """In place: query heads of ``q`` (rows) and ``o`` (columns) in order ``heads``, KV groups of ``k``
    / ``v`` (rows) in order ``groups``, ``head_dim`` rows / columns per head; biases move along."""
    for name, idx in ((q, heads), (k, groups), (v, groups)):
        sd[name] = rows(sd[name], idx, head_dim)
        if _bias(name) in sd:
            sd[_bias(name)] = rows(sd[_bias(name)], idx, head_dim)
    sd[o] = cols(sd[o], heads, head_dim)


def permute_neurons(sd: dict[str, torch.Tensor], ups: Iterable[str], down: str, order: torch.Tensor) -> None:
    """In place: ffn neurons in ``order`` — rows of the up (gate) matrices, columns of ``down``."""
    for name in ups:
        sd[name] = sd[name].index_select(0, order)
    sd[down] = cols(sd[down], order)


def permute_hidden(
    sd: dict[str, torch.Tensor],
    order: torch.Tensor,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    vectors: Iterable[str] = (),
) -> None:
    """In place: hidden channels in ``order`` — columns of the matrices that read the residual
    stream, rows of those that write it (and their biases), entries of the norm weights."""
    for name in reads:
        sd[name] = cols(sd[name], order)
    for name in writes:
        sd[name] = rows(sd[name], order)
        if _bias(name) in sd:
            sd[_bias(name)] = sd[_bias(name)][order]
    for name in vectors:
        sd[name] = sd[name][order]

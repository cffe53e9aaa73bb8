"""Parallel layout per stage: TP, SP, PP, CP, EP (and expert TP), DP — read, validated, split.

The layout comes from ``cfg.cluster`` (``tp``, ``pp``, ``cp``, ``ep``, ``etp``,
``sequence_parallel``) with per-stage overrides in ``cluster.stage_layouts``; DP is what is
left: ``dp = world / (tp * pp * cp)``. Only ``rank``, ``search`` and ``distill`` run Megatron
across GPUs; the other stages run one process (the serving engine, weight slicing, reports).

Validation follows megatron-core 0.19's rules (``parallel_state.initialize_model_parallel``
and the model's own asserts):

- ``world % (tp * pp * cp) == 0``; the dense grid is tp x cp x dp x pp;
- ``world % (etp * ep * pp) == 0`` (the expert grid: etp x ep x expert-dp x pp; with
  ``etp == tp`` this means ``ep`` divides ``cp * dp``); ``ep`` divides every MoE block's
  routed experts and ``etp`` its expert ffn;
- ``tp`` divides attention heads and KV groups, dense / shared-expert ffn, Mamba heads and
  Mamba groups of every block;
- ``pp`` is at most the number of kept blocks (the cost-based split gives every stage one);
- ``seq_len % (2 * cp) == 0`` (causal load-balanced context parallelism), and with sequence
  parallelism ``tp > 1`` and ``(seq_len / cp) % tp == 0``;
- the global batch is a multiple of ``micro_batch_size * dp``.

Every problem is collected and reported together, each naming the dimension that does not
divide and the config field to change.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from autocompress_nemo.arch.counts import block_params
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.blocks import kind_of


def __getattr__(name: str) -> tuple[str, ...]:
    """``STAGES`` (every stage a user may name) and ``DISTRIBUTED_STAGES`` (those that run Megatron
    over all GPUs of the job; the others run one process), read from the stages' declarations."""
    from autocompress_nemo.stages import graph

    if name == "STAGES":
        return graph.selectable()
    if name == "DISTRIBUTED_STAGES":
        return tuple(s.name for s in graph.stages() if s.distributed)
    raise AttributeError(name)


_LAYOUT_KEYS = ("nodes", "gpus_per_node", "tp", "pp", "cp", "ep", "etp", "sequence_parallel")


class LayoutError(ValueError):
    """A parallel layout that does not fit the model or the cluster; lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid parallel layout:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class ParallelLayout:
    stage: str
    nodes: int = 1
    procs_per_node: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size ``world / (tp * pp * cp)`` (0 when it does not divide)."""
        mp = self.tp * self.pp * self.cp
        return self.world // mp if self.world % mp == 0 else 0

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size ``world / (etp * ep * pp)`` (0 when it does not divide)."""
        eg = self.etp * self.ep * self.pp
        return self.world // eg if self.world % eg == 0 else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(world=self.world, dp=self.dp, expert_dp=self.expert_dp)
        return d

    def describe(self) -> str:
        return (
            f"{self.nodes} node(s) x {self.procs_per_node} = {self.world} rank(s): TP={self.tp} SP={'on' if self.sp else 'off'} "
            f"PP={self.pp} CP={self.cp} DP={self.dp} EP={self.ep} ETP={self.etp} expert-DP={self.expert_dp}"
        )


def _get(c: Any, key: str, default: Any = None) -> Any:
    if c is None:
        return default
    return c.get(key, default) if hasattr(c, "get") else getattr(c, key, default)


def layout_for_stage(cluster: Any, stage: str) -> ParallelLayout:
    """The layout ``stage`` runs with under ``cluster`` (``cfg.cluster``), overrides applied.

    Non-distributed stages get one process. On a ``local`` cluster without GPUs the number of
    processes is ``processes_per_node`` (gloo).
    """
    stages, distributed = __getattr__("STAGES"), __getattr__("DISTRIBUTED_STAGES")
    if stage not in stages:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(stages)}")
    if stage not in distributed:
        return ParallelLayout(stage=stage)
    base = {k: _get(cluster, k) for k in _LAYOUT_KEYS}
    over = _get(_get(cluster, "stage_layouts", {}) or {}, stage, {}) or {}
    unknown = sorted(set(over) - set(_LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"cluster.stage_layouts.{stage}: unknown key(s) {unknown}; allowed: {', '.join(_LAYOUT_KEYS)}")
    base.update(dict(over))
    gpus = int(base["gpus_per_node"] or 0)
    procs = gpus if gpus > 0 else int(_get(cluster, "processes_per_node", 1) or 1)
    tp = int(base["tp"] or 1)
    return ParallelLayout(
        stage=stage,
        nodes=int(base["nodes"] or 1),
        procs_per_node=procs,
        tp=tp,
        pp=int(base["pp"] or 1),
        cp=int(base["cp"] or 1),
        ep=int(base["ep"] or 1),
        etp=int(base["etp"] or 0) or tp,
        sp=bool(base["sequence_parallel"]),
    )


def _blocks_str(idx: list[int]) -> str:
    shown = ", ".join(str(i) for i in idx[:6])
    return f"block {shown}" if len(idx) == 1 else f"blocks {shown}{', ...' if len(idx) > 6 else ''} ({len(idx)} blocks)"


def layout_problems(
    layout: ParallelLayout, spec: ArchSpec, *, seq_len: int, global_batch: int, micro_batch: int = 1
) -> list[str]:
    """Every way ``layout`` does not fit ``spec`` / the cluster, one message each (empty if valid)."""
    L = layout
    out: list[str] = []
    where = f"stage {L.stage}"
    for name, v in (("tp", L.tp), ("pp", L.pp), ("cp", L.cp), ("ep", L.ep), ("etp", L.etp)):
        if v < 1:
            out.append(f"{where}: {name}={v} must be >= 1 (cluster.{name})")
    if out:
        return out
    mp = L.tp * L.pp * L.cp
    if L.world % mp:
        out.append(
            f"{where}: world size {L.world} ({L.nodes} node(s) x {L.procs_per_node}) is not divisible by "
            f"tp x pp x cp = {L.tp} x {L.pp} x {L.cp} = {mp}; change cluster.tp/pp/cp or the node count"
        )
    eg = L.etp * L.ep * L.pp
    if L.world % eg:
        out.append(
            f"{where}: world size {L.world} is not divisible by etp x ep x pp = {L.etp} x {L.ep} x {L.pp} = {eg} "
            f"(megatron's expert grid: ep must divide tp x cp x dp / etp); change cluster.ep or cluster.etp"
        )

    # per-block divisibility, grouped so an 88-block model gives one line per rule
    bad: dict[tuple[str, str, int, int], list[int]] = {}

    def need(dim: str, size: int, what: str, value: int, i: int) -> None:
        if value % size:
            bad.setdefault((dim, what, value, size), []).append(i)

    sizes = {"tp": L.tp, "ep": L.ep, "etp": L.etp}
    for i, b in enumerate(spec.blocks):
        for dim, what, value in [] if b.removed else kind_of(b).sharded_sizes(b):
            need(dim, sizes[dim], what, value, i)
    for (dim, what, value, size), idx in bad.items():
        out.append(f"{where}: {dim}={size} does not divide {what}={value} ({_blocks_str(idx)}); change cluster.{dim}")
    if L.ep > 1 and not any(
        dim == "ep" for b in spec.blocks if not b.removed for dim, _, _ in kind_of(b).sharded_sizes(b)
    ):
        out.append(f"{where}: ep={L.ep} but the model has no MoE block; set cluster.ep=1")

    kept = sum(1 for b in spec.blocks if not b.removed)
    if L.pp > kept:
        out.append(f"{where}: pp={L.pp} is larger than the {kept} kept blocks; every pipeline stage needs one")
    if seq_len % (2 * L.cp) and L.cp > 1:
        out.append(
            f"{where}: cp={L.cp}: seq_len={seq_len} is not divisible by 2 x cp = {2 * L.cp} (causal load balancing)"
        )
    if L.sp and L.tp == 1:
        out.append(f"{where}: sequence_parallel needs tp > 1 (tp=1); set cluster.sequence_parallel=false or raise tp")
    elif L.sp and (seq_len // max(L.cp, 1)) % L.tp:
        out.append(f"{where}: tp={L.tp} does not divide the per-CP-rank sequence {seq_len // L.cp} (sequence parallel)")
    dp = L.dp
    if dp and global_batch % (micro_batch * dp):
        out.append(
            f"{where}: dp={dp} x micro_batch_size={micro_batch} does not divide the global batch {global_batch}; "
            f"change the batch size, cluster.micro_batch_size or the data-parallel size"
        )
    return out


def validate_layout(
    layout: ParallelLayout, spec: ArchSpec, *, seq_len: int, global_batch: int, micro_batch: int = 1
) -> None:
    """Raise ``LayoutError`` listing every problem of ``layout`` (see ``layout_problems``)."""
    problems = layout_problems(layout, spec, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch)
    if problems:
        raise LayoutError(problems)


# -- pipeline split by cost ----------------------------------------------------------------


def block_train_cost(b: Block, hidden: int, seq_len: int) -> float:
    """Predicted forward FLOPs per token of one block (backward is ~2x this, same ratio):

    ``2 * active params`` (every weight multiplies-adds once) ``+ 2*s*H*d`` for attention
    (QK^T and PV, ``2 * 2 * s * H * d`` halved by the causal mask) ``+ 6*di*N`` for a Mamba
    scan (state update and read-out). A removed block costs 0.
    """
    if b.removed:
        return 0.0
    return 2.0 * block_params(b, hidden, active=True) + kind_of(b).mixing_flops(b, seq_len)


def split_pipeline(block_costs: list[float], pp: int) -> list[range]:
    """Split blocks into ``pp`` contiguous non-empty stages minimizing the largest stage cost.

    Exact linear partition by dynamic programming over prefix sums, O(pp * n^2):
    ``best[j][i] = min over m < i of max(best[j-1][m], sum(costs[m:i]))``. Ties go to the
    earliest cut, so the split is deterministic.
    """
    n = len(block_costs)
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1")
    if n < pp:
        raise ValueError(f"pp={pp} is larger than the {n} blocks to split; every pipeline stage needs one")
    prefix = [0.0, *itertools.accumulate(float(c) for c in block_costs)]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for j in range(1, pp + 1):
        for i in range(j, n - (pp - j) + 1):
            for m in range(j - 1, i):
                v = max(best[j - 1][m], prefix[i] - prefix[m])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, m
    bounds, i = [], n
    for j in range(pp, 0, -1):
        m = cut[j][i]
        bounds.append(range(m, i))
        i = m
    return bounds[::-1]


def pipeline_stages(spec: ArchSpec, pp: int, seq_len: int) -> list[range]:
    """Split ``spec.blocks`` over ``pp`` stages by predicted cost, not by block count.

    The embedding (a lookup, ~0 FLOPs) sits on the first stage and the LM head
    (``2*h*V`` FLOPs per token) on the last; the head's cost is added to the last block so
    the split leaves room for it.
    """
    costs = [block_train_cost(b, spec.hidden, seq_len) for b in spec.blocks]
    if costs:
        costs[-1] += 2.0 * spec.hidden * spec.vocab
    return split_pipeline(costs, pp)

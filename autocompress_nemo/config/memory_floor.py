"""Memory floors from shapes alone, checked before any stage runs.

Two questions are answered from the config's shapes, in milliseconds, instead of minutes into a run:

- **Can this machine hold a stage?** Each stage that trains or scores the model holds, at least, the
  model's weights (2 bytes a parameter: the narrowest dtype any stage keeps them in) and, at one time,
  the largest of: one attention score matrix ``b x H x s x s`` fp32 (Megatron's unfused attention,
  the one that runs on CPU; GPUs use fused attention and skip this term) and the logits ``b x s x V``
  fp32 (the distillation stages hold the teacher's too). Here ``b`` is the sequences one process runs
  at once (the stage's batch over the data-parallel ranks; 1 for stages that split batches into
  micro-batches), ``H`` the attention heads per tensor-parallel rank and ``s`` the sequence per
  context-parallel rank. On a GPU each rank holds at least ``1 / world`` of the weights (whatever the
  sharding: tensor, pipeline, expert, FSDP) and its own activations; on CPU the host's RAM holds the
  weights once and the activations of every local process. This is a floor, not an estimate: a stage needs more (activations saved for
  the backward pass, gradients, optimizer state), so a floor above the machine's memory is a certain
  failure (``DefaultCPUAllocator: can't allocate memory``) and is refused, naming the setting to lower
  and the largest value that clears the floor.
- **Can any student meet the budget?** The search never shrinks the vocabulary or the hidden size, so
  the embedding and LM head (``costs.memory.embedding_weight_bytes`` in the deployment dtype) are in
  every student: an absolute ``memory_bytes`` (or ``params``) budget below them is unreachable.

The machine's memory is the device's (``torch.cuda``) where CUDA runs the stages, else this host's RAM
(the smaller of the physical memory and a cgroup limit). Not checked for dry runs and Slurm clusters
(the stages run on other machines).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

FP32 = 4
WEIGHT_BYTES = 2
GiB = float(1 << 30)

# stage -> (section of its batch, batch key or a fixed count, section of its sequence length, key,
#            what splits the batch into micro-batches (None: the whole batch at once), teacher too?)
_STAGE_SHAPES: dict[str, tuple[str, str | int, str, str, bool, bool]] = {
    "rank": ("search", "batch_size", "search", "seq_len", False, False),
    "search": ("search", "batch_size", "search", "seq_len", False, True),
    "extract": ("extract", 2, "extract", "refit_seq_len", False, False),
    "distill": ("distill", "batch_size", "distill", "seq_len", True, True),
    "evaluate": ("evaluate", 2, "evaluate", "seq_len", False, False),
}


def machine_memory() -> tuple[str, int] | None:
    """(``"GPU"`` / ``"CPU"``, bytes one process may use): the first CUDA device's memory when CUDA is
    present, else the host's RAM (a cgroup's ``memory.max`` when lower). None when unknown."""
    if Path("/dev/nvidiactl").exists():
        try:
            import torch

            if torch.cuda.is_available():
                return "GPU", int(torch.cuda.get_device_properties(0).total_memory)
        except Exception:  # noqa: BLE001 - no usable CUDA: the host's memory
            pass
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return "CPU", total


def _int(x: Any, default: int = 0) -> int:
    return int(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else default


def _spec(m: dict[str, Any]) -> Any:
    from autocompress_nemo.arch.from_config import spec_from_model_config

    return spec_from_model_config(m)


def stage_floor(
    weights: float, heads: int, vocab: int, seq: int, batch: int, teacher: bool, attention_scores: bool, copies: int = 1
) -> tuple[float, str]:
    """(bytes, what dominates) of a stage holding ``weights`` bytes of weights whose ``copies`` processes
    each run ``batch`` sequences of ``seq`` tokens at once with ``heads`` attention heads (see the
    module docstring)."""
    scores = batch * heads * seq * seq * FP32 if attention_scores else 0
    logits = batch * seq * vocab * FP32 * (2 if teacher else 1)
    per = f"{copies} processes x " if copies > 1 else ""
    if scores >= logits:
        what = f"an attention score matrix ({per}{batch} x {heads} heads x {seq:,}² x 4 bytes = {_gb(copies * scores)})"
    else:
        what = (
            f"the logits ({per}{batch} x {seq:,} tokens x vocab {vocab:,} x 4 bytes"
            + (" x 2 models" if teacher else "")
            + f" = {_gb(copies * logits)})"
        )
    return weights + copies * max(scores, logits), what


def _gb(n: float) -> str:
    if n >= 1e8:
        return f"{n / 1e9:,.1f} GB"
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} kB"


def stage_memory_problems(c: dict[str, Any], machine: tuple[str, int] | None = None) -> list[str]:
    """One problem per sequence-length setting whose stages cannot fit this machine (module docstring)."""
    from autocompress_nemo.arch.counts import param_count
    from autocompress_nemo.config.resolve import data_parallel_size, world_size

    cl = c.get("cluster") or {}
    if c.get("dry_run") or cl.get("kind") == "slurm":
        return []
    machine = machine or machine_memory()
    if machine is None:
        return []
    kind, have = machine
    m = c.get("model") or {}
    try:
        spec = _spec(m)
    except Exception:  # noqa: BLE001 - the model check names a bad shape
        return []
    heads = max((getattr(b, "num_heads", 0) for b in spec.blocks if b.kind == "attention"), default=0)
    tp, cp = max(1, _int(cl.get("tp"), 1)), max(1, _int(cl.get("cp"), 1))
    dp = max(1, _int(data_parallel_size(cl), 1))
    world = max(1, _int(world_size(cl), 1))
    heads_rank = -(-heads // tp)
    params = param_count(spec)
    unfused = kind == "CPU"
    # the host's RAM holds every local process (the weights once at least, each process's activations);
    # a GPU holds its rank's share of the weights (at least 1/world of them) and its own activations
    copies = max(1, _int(cl.get("processes_per_node"), 1)) if kind == "CPU" else 1
    share = 1.0 if kind == "CPU" else 1.0 / world
    stages = [str(s) for s in c.get("stages") or _STAGE_SHAPES]
    found: dict[str, tuple[list[str], float, str, str, int, bool]] = {}
    for stage in stages:
        if stage not in _STAGE_SHAPES:
            continue
        bsec, bkey, ssec, skey, micro, teacher = _STAGE_SHAPES[stage]
        seq = _int((c.get(ssec) or {}).get(skey))
        batch = bkey if isinstance(bkey, int) else _int((c.get(bsec) or {}).get(bkey))
        if seq <= 0 or batch <= 0:
            continue
        b = 1 if micro else max(1, -(-batch // dp))
        s = -(-seq // cp)
        weights = params * WEIGHT_BYTES * (2 if teacher else 1) * share
        need, what = stage_floor(weights, heads_rank, spec.vocab, s, b, teacher, unfused and heads_rank > 0, copies)
        if need <= have:
            continue
        setting = f"{ssec}.{skey}"
        prev = found.get(setting)
        if prev is None or need > prev[1]:
            found[setting] = ([*(prev[0] if prev else []), stage], need, what, f"{bsec}.{bkey}", b, teacher)
        else:
            prev[0].append(stage)
    out = []
    for setting, (names, need, what, batch_key, b, teacher) in found.items():
        seq = _int((c.get(setting.split(".")[0]) or {}).get(setting.split(".")[1]))
        weights = params * WEIGHT_BYTES * (2 if teacher else 1) * share
        fits = _largest_fitting_seq(weights, heads_rank, spec.vocab, b, teacher, unfused, have, cp, copies)
        lower = f"lower {setting} (at most about {fits:,} fits)" if fits > 0 else f"lower {setting}"
        batch_hint = f" or {batch_key}" if b > 1 and not batch_key[-1].isdigit() else ""
        out.append(
            f"{setting}={seq:,}: {' and '.join(names)} would need at least {_gb(need)} at once — the weights of "
            f"model {m.get('name')} and {what} — but this machine has {have / GiB:,.1f} GiB of "
            f"{'GPU ' if kind == 'GPU' else ''}memory; "
            f"{lower}{batch_hint}"
        )
    return out


def _largest_fitting_seq(
    weights: float, heads: int, vocab: int, b: int, teacher: bool, unfused: bool, have: int, cp: int, copies: int
) -> int:
    """The largest sequence length (a multiple of 64) whose floor fits ``have`` bytes."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need, _ = stage_floor(weights, heads, vocab, -(-mid * 64 // cp), b, teacher, unfused and heads > 0, copies)
        if need <= have:
            lo = mid
        else:
            hi = mid - 1
    return lo * 64


def budget_floor_problems(c: dict[str, Any]) -> list[str]:
    """Absolute ``memory_bytes`` / ``params`` budgets below the embedding and LM head every student keeps."""
    from autocompress_nemo.arch.counts import embedding_params
    from autocompress_nemo.config.resolve import BudgetError, parse_budget
    from autocompress_nemo.costs.memory import embedding_weight_bytes

    m, t = c.get("model") or {}, c.get("target") or {}
    cons = (t.get("budget") or {}).get("constraints") or []
    try:
        spec = _spec(m)
    except Exception:  # noqa: BLE001 - the model check names a bad shape
        return []
    dtype = str((t.get("engine") or {}).get("dtype") or "f16")
    out = []
    for i, con in enumerate(cons):
        metric = str((con or {}).get("metric"))
        if metric not in ("memory_bytes", "params"):
            continue
        try:
            budget = parse_budget(metric, con.get("value"))
        except BudgetError:
            continue  # the budget check names it
        if budget.is_relative or budget.absolute is None:
            continue
        try:
            floor = embedding_weight_bytes(spec, dtype) if metric == "memory_bytes" else float(embedding_params(spec))
        except Exception:  # noqa: BLE001 - an unknown dtype is named by the target check
            continue
        if budget.absolute >= floor:
            continue
        unit = _gb(floor) + f" in {dtype}" if metric == "memory_bytes" else f"{floor / 1e6:,.2f}M parameters"
        head = "the embedding" + (" (tied LM head)" if spec.tied_embeddings else " and the LM head")
        out.append(
            f"target.budget.constraints[{i}]: {metric} {con.get('value')} is below what every student keeps: "
            f"{head} of model {m.get('name')} (vocab {spec.vocab:,} x hidden {spec.hidden:,}) alone take {unit}, "
            f"and the search never shrinks them; give a budget above that (what the blocks may add on top), "
            "or a relative one such as 0.6x"
        )
    return out

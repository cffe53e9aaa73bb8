"""The least-squares design for hybrid parents: per-block costs fitted over many children of the search space.

Why: a cost entry that is one difference of two timed models ``(T(parent + k X) - T(parent)) / k``
carries the noise of two measurements, divided by ``k`` only, and every entry is fitted to a model
that is *larger* than the parent, while the models the table predicts are smaller. Latency
predictors instead fit the additive model to many models drawn from the search space itself.

Model (the predictor's own decomposition, ``CostTable.block_latency``), per phase::

    T_i = c_0 + sum_j n_ij x_j + e_i

``T_i``: measured time of profiling model ``i``; ``n_ij``: how many blocks of model ``i`` use table
entry ``j`` (a MoE block uses its routed and its shared part, ``blocks/moe.moe_parts``; removed blocks
and parts use none); ``x_j >= 0``: the entry's cost; ``c_0``: the constant per forward (embedding,
final norm, LM head, framework overhead; unbounded). Solved as weighted non-negative least squares

    min_{c_0, x >= 0}  sum_i ((T_i - c_0 - n_i . x) / T_i)^2  +  lam * s^2 * |x|^2

— relative residuals (noise and the validation metric are both relative), and a vanishing ridge
(``lam = 1e-8``, ``s`` the median column norm) that only picks one solution along directions the
data cannot see: the attention block is never removed here, so a constant shared by all attention
options is indistinguishable from ``c_0`` and goes to ``c_0``; predictions of models with the
parent's block positions are unaffected by that choice.

Design (``balanced_choices``): ``N`` children of the search space; for each decision the option
indices of the ``N`` models are concatenated random permutations of its options, so every option
(removed ones included) appears ``floor(N / K)`` or ``ceil(N / K)`` times at every position, each
position independently — a balanced random design, well conditioned for ``N`` a few times the
number of unknowns.

Reported (the table's ``provenance.fit``): per phase the in-sample relative residuals (RMS, max)
and the leave-one-out ones (each model predicted by a fit without it: an honest estimate of the
error on unseen children), the design's rank and condition number.

Profiling models (``hybrid_fit``): the parent + ``N`` balanced random children of the search space
(``N = engine.settings.profile_models``, default ``profile_models_per_unknown`` x the unknowns), in one
interleaved session; children the engine cannot serve are skipped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.costs.engines.base import Engine, Workload
from autocompress_nemo.costs.profile.provenance import planned_runs, progress, run_row
from autocompress_nemo.costs.table import PHASES, spec_hash
from autocompress_nemo.search.space import apply_choices, build_space


def balanced_choices(sizes: list[int], n: int, seed: int) -> list[list[int]]:
    """``n`` choice vectors (one option index per decision; ``sizes[d]`` options for decision ``d``);
    per decision, the ``n`` indices are concatenated shuffles of ``range(sizes[d])``."""
    rng = random.Random(seed)
    cols = []
    for k in sizes:
        seq: list[int] = []
        while len(seq) < n:
            perm = list(range(k))
            rng.shuffle(perm)
            seq += perm
        cols.append(seq[:n])
    return [[cols[d][i] for d in range(len(sizes))] for i in range(n)]


def entry_parts(b: Any) -> list[Any]:
    """The table entries a block uses (``CostTable.block_latency``): none when removed, a MoE block's
    non-removed parts, otherwise the block itself."""
    return [] if b.removed else [p for p in kind_of(b).parts(b) if not p.removed]


def feature_matrix(specs: list[ArchSpec], columns: list[Any]) -> np.ndarray:
    """``n[i, j]`` = number of blocks of ``specs[i]`` that use entry ``columns[j]``."""
    index = {c: j for j, c in enumerate(columns)}
    out = np.zeros((len(specs), len(columns)))
    for i, s in enumerate(specs):
        for b in s.blocks:
            for p in entry_parts(b):
                if p not in index:
                    raise KeyError(
                        f"profiling model {s.name} uses {p}, which has no table column; add it to the profiled options"
                    )
                out[i, index[p]] += 1
    return out


@dataclass
class Fit:
    intercept: float
    costs: np.ndarray
    fitted: np.ndarray
    resid_pct: np.ndarray
    loo_pct: np.ndarray
    rank: int
    cond: float

    def summary(self) -> dict[str, float]:
        r, lo = self.resid_pct, self.loo_pct
        return {
            "rms_pct": float(np.sqrt(np.mean(r**2))),
            "max_pct": float(np.max(np.abs(r))),
            "loo_rms_pct": float(np.sqrt(np.mean(lo**2))),
            "loo_max_pct": float(np.max(np.abs(lo))),
            "loo_mean_abs_pct": float(np.mean(np.abs(lo))),
        }


def _solve(a: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """``argmin_{x_0 free, x_1.. >= 0} |(y - a x) / y|^2 + lam s^2 |x_1..|^2`` (column 0: the constant)."""
    from scipy.optimize import lsq_linear

    w = 1.0 / y
    aw, yw = a * w[:, None], y * w
    p = a.shape[1]
    s = float(np.median(np.linalg.norm(aw, axis=0))) or 1.0
    reg = np.sqrt(lam) * s * np.eye(p)[1:]
    lb = np.full(p, 0.0)
    lb[0] = -np.inf
    res = lsq_linear(
        np.vstack([aw, reg]), np.concatenate([yw, np.zeros(p - 1)]), bounds=(lb, np.inf), method="bvls", tol=1e-12
    )
    return res.x


def fit_costs(counts: np.ndarray, y: np.ndarray, lam: float = 1e-8, loo: bool = True) -> Fit:
    """Fit ``y_i = c_0 + counts_i . x`` (see the module docstring); ``y`` must be positive."""
    y = np.asarray(y, dtype=np.float64)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"fit_costs needs positive finite times, got {y[~(np.isfinite(y) & (y > 0))][:5]}")
    a = np.hstack([np.ones((len(y), 1)), counts])
    if len(y) < a.shape[1]:
        raise ValueError(f"{len(y)} profiling models for {a.shape[1]} unknowns: raise engine.settings.profile_models")
    beta = _solve(a, y, lam)
    fitted = a @ beta
    loo_pred = np.full(len(y), np.nan)
    if loo:
        for i in range(len(y)):
            keep = np.arange(len(y)) != i
            loo_pred[i] = a[i] @ _solve(a[keep], y[keep], lam)
    sv = np.linalg.svd(a / y[:, None], compute_uv=False)
    rank = int(np.sum(sv > sv[0] * 1e-10))
    return Fit(
        intercept=float(beta[0]),
        costs=beta[1:],
        fitted=fitted,
        resid_pct=100.0 * (fitted - y) / y,
        loo_pct=100.0 * (loo_pred - y) / y,
        rank=rank,
        cond=float(sv[0] / sv[rank - 1]),
    )


def hybrid_fit(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    options: list[Any],
    caps: Any,
    ffn_points: int,
    log: Callable[[str], None],
) -> tuple[list[ArchSpec], list[Any], list[dict[str, Any]], dict[str, float], list[dict[str, Any]], dict[str, Any]]:
    """(specs, measurements, block entries, intercept, runs, extra provenance): the parent + ``N``
    balanced random children of the search space (``build_space(parent, caps, ffn_points)``), costs
    by least squares; ``specs[0]`` is the parent."""
    s = engine.settings
    decisions = build_space(parent, caps, ffn_points)
    columns = list(options)
    n_unknowns = len(columns) + 1
    n = s.profile_models or int(round(float(s.profile_models_per_unknown) * n_unknowns))
    seed = s.profile_seed
    specs, seen = [parent.replace(name="parent")], {spec_hash(parent)}
    for i, ch in enumerate(balanced_choices([len(d.options) for d in decisions], n, seed)):
        child = apply_choices(parent, decisions, ch).replace(name=f"fit{i}")
        if spec_hash(child) not in seen and not engine.check_servable(child, parent):
            seen.add(spec_hash(child))
            specs.append(child)
    counts = feature_matrix(specs, columns)
    unseen = [c for j, c in enumerate(columns) if not counts[:, j].any()]
    if unseen:
        raise ValueError(f"profiling design never uses {unseen}: raise engine.settings.profile_models")
    log(
        f"[profile] hybrid fit: {len(specs)} profiling models (parent + {len(specs) - 1} balanced children of the "
        f"search space) for {n_unknowns} unknowns; engine {engine.name} ({engine.version()}), workload {workload}"
    )
    results = engine.measure_many(
        specs,
        workload,
        log=progress(log, planned_runs(engine, specs, parent.replace(name="parent")), time.time()),
        reference=parent.replace(name="parent"),
    )
    fits = {p: fit_costs(counts, np.array([getattr(m, p) for m in results])) for p in PHASES}
    intercept = {p: fits[p].intercept for p in PHASES}
    blocks = [
        {
            "block": c.__dict__,
            **{p: float(fits[p].costs[j]) for p in PHASES},
            "source": "fit",
            "appearances": int(counts[:, j].sum()),
        }
        for j, c in enumerate(columns)
    ]
    runs = [
        run_row(
            sp,
            m,
            k=0,
            block=None,
            blocks=[b.__dict__ for b in sp.blocks],
            spec_hash=spec_hash(sp),
            **{f"fit_{p}": float(fits[p].fitted[i]) for p in PHASES},
            **{f"loo_err_{p}_pct": float(fits[p].loo_pct[i]) for p in PHASES},
        )
        for i, (sp, m) in enumerate(zip(specs, results, strict=True))
    ]
    fit_prov = {
        "models": len(specs),
        "unknowns": n_unknowns,
        **{p: {**fits[p].summary(), "rank": fits[p].rank, "cond": fits[p].cond} for p in PHASES},
        "note": "relative residuals of the weighted NNLS fit (in-sample) and leave-one-out",
    }
    log(
        "[profile] fit residuals: "
        + "; ".join(
            f"{p}: rms {fits[p].summary()['rms_pct']:.2f}%, leave-one-out rms {fits[p].summary()['loo_rms_pct']:.2f}% "
            f"max {fits[p].summary()['loo_max_pct']:.2f}%"
            for p in PHASES
        )
        + f" (rank {fits['decode_ms'].rank} of "
        f"{n_unknowns}, cond {fits['decode_ms'].cond:.0f})"
    )
    return specs, results, blocks, intercept, runs, {"fit": fit_prov, "settings": {"models": len(specs), "seed": seed}}

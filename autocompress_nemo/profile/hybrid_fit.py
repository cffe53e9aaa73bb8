"""Per-block costs of a hybrid cost table fitted by least squares over many profiling models.

Why: a cost entry that is one difference of two timed models ``(T(parent + k X) - T(parent)) / k``
carries the noise of two measurements, divided by ``k`` only, and every entry is fitted to a model
that is *larger* than the parent, while the models the table predicts are smaller. Latency
predictors instead fit the additive model to many models drawn from the search space itself.

Model (the predictor's own decomposition, ``CostTable.block_latency``), per phase::

    T_i = c_0 + sum_j n_ij x_j + e_i

``T_i``: measured time of profiling model ``i``; ``n_ij``: how many blocks of model ``i`` use table
entry ``j`` (a MoE block uses its routed and its shared part, ``table.moe_parts``; removed blocks
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
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec, MoeBlock


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
    from autocompress_nemo.costs.table import moe_parts

    if b.removed:
        return []
    if isinstance(b, MoeBlock):
        return [p for p in moe_parts(b) if not p.removed]
    return [b]


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

"""PNG plots of the report (matplotlib, Agg backend), each written atomically.

- ``widths.png``: per-layer widths (attention query heads, ffn width; other block kinds by
  block index) of every student against the parent.
- ``costs.png``: predicted and measured costs per metric and model, with the absolute budget.
- ``search_trajectory.png``: KD loss, expected cost / budget per metric and router entropy
  (with the Gumbel temperature) per search step.
- ``accuracy_vs_cost.png``: held-out perplexity against the first budget's metric, with the budget
  the PASS / FAIL was decided on: as a ratio to the parent measured in the same rounds when the
  engine check recorded one, else measured (or predicted) absolute costs — the axis label says which.

A plot whose data is missing is skipped; ``write_plots`` returns the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.report.tables import COST_METRICS, UNITS, spec_of

COLORS = {"parent": "0.55", "autocompress": "tab:blue", "minitron_pp": "tab:orange"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    os.replace(tmp, path)
    return path


def _scale(metric: str, v: float) -> float:
    return v / 2**20 if metric == "memory_bytes" else v


def plot_widths(res: dict[str, Any], path: Path) -> Path | str:
    specs: dict[str, ArchSpec] = {k: s for k, e in res["models"].items() if (s := spec_of(e)) is not None}
    if not specs:
        return "no architectures in results['models']"
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    widths: dict[str, dict[str, list[int]]] = {}  # kind -> model -> its blocks' widths, in order
    for key, spec in specs.items():
        for b in spec.blocks:
            widths.setdefault(b.kind, {}).setdefault(key, []).append(kind_of(b).plot_width(b))
    kinds = sorted(widths)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(9, 2.6 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds, strict=True):
        for key in specs:
            ys = widths[kind].get(key, [])
            xs = list(range(len(ys)))
            style = {"color": COLORS.get(key, None), "label": res["models"][key]["label"]}
            if key == "parent":
                ax.bar(xs, ys, color=style["color"], alpha=0.35, label=style["label"])
            else:
                ax.plot(xs, ys, marker="o", ms=4, lw=1.5, **style)
        ax.set_ylabel(kind_of(kind).plot_unit)
        ax.set_xlabel(f"{kind} block (layer)")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Per-block widths: students against the parent (0 = removed)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_costs(res: dict[str, Any], path: Path) -> Path | str:
    models = res["models"]
    metrics = [
        m
        for m in COST_METRICS
        if any((e.get(k) or {}).get(m) is not None for e in models.values() for k in ("predicted", "measured"))
    ]
    if not metrics:
        return "no predicted or measured costs"
    budgets = {b.get("metric"): b.get("absolute") for b in (res["target"].get("budgets") or [])}
    budgets.update(
        {
            "prefill_ms": budgets.get("ttft_ms", budgets.get("prefill_ms")),
            "decode_ms": budgets.get("tpot_ms", budgets.get("decode_ms")),
        }
    )
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.4 * len(metrics), 3.8), squeeze=False)
    keys = list(models)
    for ax, m in zip(axes[0], metrics, strict=True):
        for j, key in enumerate(keys):
            e = models[key]
            for dx, kind, hatch in ((-0.2, "predicted", "//"), (0.2, "measured", "")):
                v = (e.get(kind) or {}).get(m)
                if v is not None:
                    ax.bar(
                        j + dx,
                        _scale(m, v),
                        width=0.38,
                        color=COLORS.get(key, "tab:green"),
                        hatch=hatch,
                        alpha=0.6 if kind == "predicted" else 0.95,
                        edgecolor="k",
                        lw=0.4,
                    )
        if budgets.get(m) is not None:
            ax.axhline(_scale(m, budgets[m]), color="red", ls="--", lw=1, label="budget")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(keys)), [models[k]["label"] for k in keys], fontsize=7, rotation=20)
        ax.set_title(f"{m} ({UNITS[m]})", fontsize=9)
    sources = sorted(
        {str((e.get(k) or {}).get("source")) for e in models.values() for k in ("predicted", "measured") if e.get(k)}
    )
    fig.suptitle("hatched = predicted, solid = measured\n" + "; ".join(sources), fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def plot_trajectory(res: dict[str, Any], path: Path) -> Path | str:
    traj = res.get("search_trajectory") or []
    if not traj:
        return "no search trajectory (search not run, or the parent already met the budget)"
    plt = _plt()
    steps = [r["step"] for r in traj]
    metrics = sorted({k[len("expected_") :] for r in traj for k in r if k.startswith("expected_")})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r.get("kd") for r in traj], lw=1.2, label="KD loss")
    if any(r.get("penalty") for r in traj):
        axes[0].plot(steps, [r.get("penalty") for r in traj], lw=1, alpha=0.7, label="budget penalty")
    axes[0].set_xlabel("search step")
    axes[0].set_title("loss", fontsize=9)
    axes[0].legend(fontsize=8)
    for m in metrics:
        ratio = [r[f"expected_{m}"] / r[f"budget_{m}"] if r.get(f"budget_{m}") else None for r in traj]
        axes[1].plot(steps, ratio, lw=1.2, label=m)
    axes[1].axhline(1.0, color="red", ls="--", lw=1, label="budget")
    axes[1].set_xlabel("search step")
    axes[1].set_title("expected cost / budget", fontsize=9)
    axes[1].legend(fontsize=8)
    axes[2].plot(steps, [r.get("entropy") for r in traj], lw=1.2, color="tab:purple", label="router entropy")
    axes[2].set_xlabel("search step")
    axes[2].set_title("entropy and temperature", fontsize=9)
    if any("tau" in r for r in traj):
        tw = axes[2].twinx()
        tw.plot(steps, [r.get("tau") for r in traj], lw=1, color="tab:gray", ls=":", label="tau")
        tw.set_ylabel("Gumbel temperature tau", fontsize=8)
    axes[2].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def _check_of(e: dict[str, Any], metric: str) -> dict[str, Any]:
    """The model's budget check of ``metric`` (what its PASS / FAIL was decided on), or ``{}``."""
    for c in e.get("checks") or []:
        if metric in (c.get("checked_as"), c.get("metric")):
            return c
    return {}


def decided_budget(res: dict[str, Any], metric: str) -> tuple[str, float | None, str]:
    """The budget the PASS / FAIL of ``metric`` was decided on, as ``(axis, value, where)``:

    - ``ratio``: the students' budget as a ratio to the parent measured in the same rounds
      (``budget_ratio`` of their checks; the parent sits at 1) — the quantity PASS is decided on;
    - ``absolute``: the budget the checks compared with (the evaluate stage's, from the parent
      measured then), when no ratio was recorded;
    - ``configured``: the target's absolute budget (profile time) when no check was recorded."""
    students = [e for k, e in res["models"].items() if k != "parent"]
    for e in students:
        c = _check_of(e, metric)
        if c.get("budget_ratio") is not None and c.get("ratio") is not None:
            return "ratio", float(c["budget_ratio"]), "budget / parent, both measured in the same rounds"
    for e in students:
        c = _check_of(e, metric)
        if c.get("budget") is not None:
            return "absolute", float(c["budget"]), "the budget the engine check compared with"
    budgets = res["target"].get("budgets") or []
    b = next((b.get("absolute") for b in budgets if b.get("absolute") is not None), None)
    return "configured", (None if b is None else float(b)), "the configured budget"


def accuracy_points(
    res: dict[str, Any],
) -> tuple[str, str, float | None, str, list[tuple[str, str, float, float, str]]]:
    """What ``accuracy_vs_cost.png`` draws: ``(metric, axis, budget, where, points)`` with the budget
    PASS / FAIL was decided on (``decided_budget``) and one ``(key, label, x, perplexity, how)`` per
    model — ``x`` the measured ratio to the parent (the parent at 1) when ``axis`` is ``ratio``, else
    the measured (or predicted) cost in the plot's unit."""
    models = res["models"]
    budgets = res["target"].get("budgets") or []
    metric = budgets[0].get("metric") if budgets else "params"
    metric = {"ttft_ms": "prefill_ms", "tpot_ms": "decode_ms"}.get(metric, metric)
    axis, budget, where = decided_budget(res, metric) if metric != "params" else ("configured", None, "")
    if budget is not None and axis != "ratio":
        budget = _scale(metric, budget)
    pts = []
    for key, e in models.items():
        ppl = e["accuracy"].get("perplexity")
        if ppl is None:
            continue
        meas, pred = (e.get("measured") or {}).get(metric), (e.get("predicted") or {}).get(metric)
        if metric == "params":
            cost, how = e.get("params"), "counted"
        elif axis == "ratio":
            cost, how = _check_of(e, metric).get("ratio", 1.0 if key == "parent" else None), "measured ratio"
        else:
            cost, how = (meas, "measured") if meas is not None else (pred, "predicted")
        if cost is not None:
            x = float(cost) if axis == "ratio" else _scale(metric, float(cost))
            pts.append((key, e["label"], x, float(ppl), how))
    return metric, axis, budget, where, pts


def plot_accuracy_vs_cost(res: dict[str, Any], path: Path) -> Path | str:
    """Held-out perplexity against the first budget's metric and the budget PASS / FAIL was decided on
    (``accuracy_points``)."""
    metric, axis, budget, where, pts = accuracy_points(res)
    if not pts:
        return f"no model has both a perplexity and a {metric} figure"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, label, x, y, how in pts:
        ax.scatter([x], [y], s=50, color=COLORS.get(key, "tab:green"), marker="o" if how != "predicted" else "s")
        ax.annotate(f"{label} ({how})", (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    if budget is not None and metric != "params":
        ax.axvline(budget, color="red", ls="--", lw=1, label=f"budget {budget:.4g} ({where})")
        ax.legend(fontsize=7)
    if axis == "ratio":
        ax.set_xlabel(f"{metric} / the parent's (measured in the same rounds)")
    else:
        ax.set_xlabel(f"{metric} ({UNITS.get(metric, '')})")
    ax.set_ylabel("held-out perplexity (lower is better)")
    ax.set_title("accuracy against cost", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


PLOTS = {
    "widths": plot_widths,
    "costs": plot_costs,
    "search_trajectory": plot_trajectory,
    "accuracy_vs_cost": plot_accuracy_vs_cost,
}


def write_plots(run_dir: Path, res: dict[str, Any]) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw every plot that has data; returns (written paths by name, reasons for the skipped)."""
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for name, fn in PLOTS.items():
        out = fn(res, run_dir / f"{name}.png")
        if isinstance(out, Path):
            written[name] = out
        else:
            skipped[name] = out
    return written, skipped

"""The report's "Quality versus recovery tokens" section: ``bench/bench_quality.py``'s curve for
this run (``<run>/bench_quality/default/quality.json`` and its plot; ``default@<budget>`` for one budget
of a family, ``--budget``), when that bench was run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autocompress_nemo.report.tables import fmt, table

CURVE = Path("bench_quality") / "default" / "quality.json"
"""Where ``bench/bench_quality.py`` (``--tag default``) writes the curve the report embeds."""


def curve_dir(suffix: str = "") -> Path:
    """The bench's ``--tag default`` directory of a run (``suffix``: ``@<budget>`` of a family member)."""
    return CURVE.parent.with_name(CURVE.parent.name + suffix)


def read_curve(run_dir: Path, suffix: str = "", up: int = 0) -> dict[str, Any] | None:
    """The curve of this run (or of its budget ``suffix``); ``plot_rel``: its plot relative to a
    report written ``up`` directories below the run directory (``report@<budget>/``: 1)."""
    from autocompress_nemo.context import read_json

    path = run_dir / curve_dir(suffix) / CURVE.name
    if not path.is_file():
        return None
    q = read_json(path)
    q["plot_rel"] = ("../" * up) + (curve_dir(suffix) / "quality.png").as_posix()
    return q


def gap_power_law(
    points: list[dict[str, Any]], parent_ppl: float, ratios: tuple[float, ...] = (1.5, 1.2)
) -> dict[str, Any] | None:
    """Estimated, not measured: the gap to the parent (``ppl / parent - 1``) as a power law of the
    recovery tokens, ``gap(T) = g * T**-alpha``, fitted (least squares in log-log) through the measured
    points, and the tokens at which it would reach each of ``ratios``. ``None`` with fewer than two
    points at distinct budgets or a gap that does not shrink (no power law to extrapolate)."""
    import math

    pts = [(float(p["tokens"]), p["heldout_ppl"] / parent_ppl - 1.0) for p in points if p.get("tokens")]
    pts = [(t, g) for t, g in pts if t > 0 and g > 0]
    if len({t for t, _ in pts}) < 2:
        return None
    xs, ys = [math.log(t) for t, _ in pts], [math.log(g) for _, g in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if slope >= 0:
        return None
    alpha, log_g = -slope, my - slope * mx
    out: dict[str, Any] = {
        "alpha": alpha,
        "points": len(pts),
        "source": "estimated, not measured: a power law of the gap to the parent through the measured points",
    }
    for r in ratios:
        out[f"tokens_to_{r}x"] = math.exp((log_g - math.log(r - 1.0)) / alpha)
    return out


def quality_curve_section(res: dict[str, Any]) -> list[str]:
    q = res.get("quality_curve")
    if not q:
        return ["Not measured for this run: `python bench/bench_quality.py --run <run_dir>` draws it."]
    parent = q["parent"]["heldout_ppl"]
    rows = [["parent", "—", fmt(parent), "1.00x", "—", "—"]]
    for m, points in q["curves"].items():
        label = q["labels"].get(m, m)
        before = q["before_recovery"][m]["heldout_ppl"]
        rows.append([label, "0", fmt(before), f"{before / parent:.2f}x", "—", "—"])
        for p in points:
            tps = p.get("tokens_per_s")
            rows.append(
                [
                    label,
                    f"{p['tokens']:,}",
                    fmt(p["heldout_ppl"]),
                    f"{p['ratio_to_parent']:.2f}x",
                    fmt(p["train_kd_last_tenth"]),
                    f"{tps:.0f}" if tps else "(resumed)",
                ]
            )
    lines = [
        f"`bench/bench_quality.py` on this run: each student distilled at each token budget with its own "
        f"schedule ({', '.join(f'{k}={v}' for k, v in q['distill'].items() if k in ('lr', 'min_lr', 'temperature', 'intermediate_weight', 'teacher_precision'))}"
        f"{'; overrides ' + ' '.join(q['overrides']) if q.get('overrides') else ''}). {q['measured']}.",
        "",
        table(["model", "recovery tokens", "held-out ppl", "vs parent", "train KD (last tenth)", "tokens/s"], rows),
    ]
    if "autocompress_below_minitron_at_every_budget" in q:
        lines += [
            "",
            f"AutoCompress below Minitron++ at every budget: {q['autocompress_below_minitron_at_every_budget']}.",
        ]
    ext = q.get("extrapolation") or {}
    if ext:
        lines += [
            "",
            "Tokens to reach the goals, estimated, not measured (a power law of the gap to the parent, "
            "`gap = g * tokens^-alpha`, fitted through the measured points): "
            + "; ".join(
                f"{q['labels'].get(m, m)}: alpha {e['alpha']:.2f}, 1.5x at ~{e['tokens_to_1.5x']:,.0f}, "
                f"1.2x at ~{e['tokens_to_1.2x']:,.0f} tokens"
                for m, e in ext.items()
            )
            + ".",
        ]
    if Path(q.get("plot", "")).is_file():
        lines += [
            "",
            f"![quality vs recovery tokens]({q.get('plot_rel') or (CURVE.parent / 'quality.png').as_posix()})",
        ]
    return lines

"""The report's "Timing against the parent" section: every timed model's ratio to the parent measured in
the same rounds (``costs/engines/paired.py``), the PASS / FAIL made on it, and the conditions of each
timed stage (the parent's own time and its variation between rounds, the load average, flags)."""

from __future__ import annotations

from typing import Any

from autocompress_nemo.report.tables import fmt, table

TIMED = ("decode_ms", "prefill_ms")


def _ratio(q: dict[str, Any], spread: dict[str, Any], p: str) -> str:
    if p not in q:
        return "—"
    iqr = (spread.get(p) or {}).get("rel_iqr")
    return f"{q[p]:.3f}" + (f" ± {100 * iqr:.1f}%" if iqr is not None else "")


def _conditions(stage: str, ref: dict[str, Any] | None) -> list[Any] | None:
    if not ref or "decode_ms" not in ref:
        return None
    load = ref.get("load_avg") or []
    return [
        stage,
        fmt(ref.get("decode_ms")),
        f"{100 * float(ref.get('decode_ms_variation', 0.0)):.1f}%",
        fmt(ref.get("prefill_ms")),
        f"{100 * float(ref.get('prefill_ms_variation', 0.0)):.1f}%",
        " → ".join(f"{x:.2f}" for x in load) if load else "—",
    ]


def timing_section(res: dict[str, Any]) -> list[str]:
    t = res.get("timing") or {}
    models = res["models"]
    rows = []
    for e in models.values():
        q = e.get("ratio_to_parent") or {}
        if not q:
            continue
        checks = [c for c in e.get("checks") or [] if "ratio" in c]
        verdict = (
            "; ".join(
                f"{c['metric']} {c['ratio']:.3f} ≤ {c['budget_ratio']:.3f}: {'PASS' if c.get('pass') else 'FAIL'}"
                for c in checks
            )
            or "—"
        )
        rows.append(
            [
                e["label"],
                _ratio(q, e.get("ratio_spread") or {}, "decode_ms"),
                _ratio(q, e.get("ratio_spread") or {}, "prefill_ms"),
                verdict,
            ]
        )
    if not rows and not t:
        return ["No model was timed against the parent (an estimated engine, or `engine.settings.reference=none`)."]
    out: list[str] = []
    if rows:
        out += [
            table(["model", "decode ratio to the parent", "prefill ratio", "budget check on the ratio"], rows),
            "",
            "Each model was timed in the target's engine next to the parent in the same rounds (sample by sample "
            "for prefill, in chunks of decode steps); its ratio is the median of the per-pair ratios (± their "
            "relative IQR), so the PASS / FAIL does not depend on the machine's load at that minute. Relative "
            "budgets are checked as ratios; absolute ones as the ratio times the parent's time measured with it.",
            "",
        ]
    per_stage = [
        _conditions("profile (cost table)", t.get("profile")),
        _conditions("validate", t.get("validate")),
        *(_conditions(f"check before slicing, {k}", r) for k, r in (t.get("verify") or {}).items()),
        _conditions("evaluate", t.get("evaluate")),
    ]
    cond = [c for c in per_stage if c]
    if cond:
        out += [
            table(
                [
                    "stage",
                    "parent decode ms",
                    "its variation between rounds",
                    "parent prefill ms",
                    "variation",
                    "load average (1 min, start → end)",
                ],
                cond,
            ),
            "",
        ]
    flags = t.get("flags") or []
    out += [f"- flagged: {f}" for f in flags] or ["No measurement was flagged (every ratio within its tolerance)."]
    return out

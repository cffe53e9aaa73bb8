"""The report's "Recovery path" section: each student's held-out quality at every step from the
sliced parent to the shipped weights — the plain slice, the least-squares re-fit (extract), the
blockwise local reconstruction (reconstruct, when it ran) and the global distillation (distill) —
with the tokens each step spent."""

from __future__ import annotations

from typing import Any

from autocompress_nemo.report.tables import DISPLAY, fmt, table


def recovery_path_section(res: dict[str, Any]) -> list[str]:
    rows = []
    for m, rec in (res.get("models") or {}).items():
        if m == "parent":
            continue
        label = DISPLAY.get(m, rec.get("label", m))
        refit = rec.get("refit") or {}
        local = rec.get("reconstruct") or {}
        start = (res.get("before_recovery") or {}).get(m) or {}
        after_local = (res.get("after_local") or {}).get(m) or {}
        final = rec.get("accuracy") or {}
        split = local.get("split") or {}
        lnb, lna = local.get("layer_nmse_before") or [], local.get("layer_nmse_after") or []
        rows.append(
            [
                label,
                fmt(refit.get("sliced_kd")),
                f"{fmt(refit.get('refit_kd'))} ({refit.get('tokens', 0):,} tok)" if refit.get("blocks") else "-",
                fmt(start.get("heldout_ppl")),
                (
                    f"{fmt(after_local.get('heldout_ppl'))} ({int(local.get('tokens', 0)):,} tok; layer error "
                    f"{sum(lnb) / len(lnb):.3f} -> {sum(lna) / len(lna):.3f})"
                    if local.get("tokens") and lnb and lna
                    else "- (reconstruct.fraction=0)"
                ),
                f"{fmt(final.get('heldout_ppl'))} ({int(split.get('global', 0) or rec.get('recovery_tokens', 0)):,} tok)"
                if final
                else "-",
            ]
        )
    if not rows:
        return ["Not evaluated."]
    return [
        "Held-out perplexity (PyTorch float32, this run's held-out text) at each step; KD to the parent on the "
        "search judge's batches for the slice and the re-fit; tokens each step spent.",
        "",
        table(
            [
                "model",
                "KD: plain slice",
                "KD: least-squares re-fit",
                "ppl: extracted (start)",
                "ppl: after local reconstruction",
                "ppl: after global distillation",
            ],
            rows,
        ),
    ]

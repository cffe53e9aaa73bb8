"""The report's family table (``search.budgets``): one row per budget and method — the budget, the
predicted and measured cost against it, PASS / FAIL, held-out perplexity, parameters, and what that
budget's search cost (router tokens and seconds: the first budget trains the supernet, every further
one only its own router)."""

from __future__ import annotations

from typing import Any

from autocompress_nemo.report.tables import fmt, table


def family_rows(results: list[tuple[Any, dict[str, Any]]], methods: list[str]) -> list[dict[str, Any]]:
    """``results``: (member, ``stages.report.collect_results`` of that budget) per budget, in order."""
    rows: list[dict[str, Any]] = []
    for member, res in results:
        budgets = res.get("budgets") or {}
        for m in methods:
            e = (res.get("models") or {}).get(m) or {}
            arch = ((res.get("methods") or {}).get(m) or {}).get("arch") or {}
            fam = arch.get("family") or {}
            for metric, absolute in budgets.items() or [("", None)]:
                check = (e.get("budget_check") or {}).get(metric) or {}
                rows.append(
                    {
                        "budget": str(member.value),
                        "first": bool(member.first),
                        "method": m,
                        "metric": metric,
                        "budget_absolute": absolute,
                        "predicted": (e.get("predicted") or {}).get(metric, (arch.get("predicted") or {}).get(metric)),
                        "measured": check.get("measured"),
                        "budget_measured": check.get("budget"),
                        "ratio": check.get("ratio"),
                        "pass": check.get("pass"),
                        "measured_by": e.get("measured_by", ""),
                        "heldout_ppl": (e.get("accuracy") or {}).get("heldout_ppl"),
                        "params": e.get("params", arch.get("params")),
                        "search_tokens": fam.get("search_tokens", arch.get("selection_tokens")),
                        "search_wall_s": fam.get("search_wall_s", arch.get("search_wall_s")),
                        "search_stage_s": (res.get("stages_wall_s") or {}).get(f"search_{m}{member.suffix}"),
                        "router_steps": fam.get("router_steps"),
                        "supernet_read": fam.get("supernet_read"),
                        "role": fam.get("role", ""),
                    }
                )
    return rows


def extra_cost(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Search tokens / seconds of the first budget and the mean over the further ones, for the method
    whose further budgets share the first's supernet (AutoCompress)."""
    from autocompress_nemo.stages.common import REGISTRY

    shares = {m for m, obj in REGISTRY.items() if obj.shares_supernet}
    ac = [r for r in rows if r["method"] in shares and r.get("search_tokens") is not None]
    first = [r for r in ac if r["first"]]
    extra = [r for r in ac if not r["first"]]
    if not first or not extra:
        return None
    return {
        "first_tokens": float(first[0]["search_tokens"]),
        "first_wall_s": float(first[0]["search_wall_s"] or 0.0),
        "extra_tokens": sum(float(r["search_tokens"]) for r in extra) / len(extra),
        "extra_wall_s": sum(float(r["search_wall_s"] or 0.0) for r in extra) / len(extra),
    }


def family_section(res: dict[str, Any]) -> list[str]:
    rows = res.get("family") or []
    if not rows:
        return ["not run (no `search.budgets`)"]
    out = [
        "One profile, one rank and one supernet; one router per budget (the first budget's search trains "
        "the supernet, every further budget trains only its own router on it, frozen). Each budget's "
        "stages live in `<stage>@<budget>/` and its full report in `report@<budget>/report.md`.",
        "",
        table(
            [
                "budget",
                "method",
                "metric",
                "budget (abs., at profiling)",
                "predicted",
                "budget when measured",
                "measured",
                "measured / parent",
                "verdict",
                "held-out ppl",
                "params (M)",
                "search tokens",
                "search s",
                "search stage s",
            ],
            [
                [
                    r["budget"] + (" (first)" if r["first"] else ""),
                    r["method"],
                    r["metric"],
                    fmt(r["budget_absolute"]),
                    fmt(r["predicted"]),
                    fmt(r["budget_measured"]),
                    fmt(r["measured"]),
                    fmt(r.get("ratio")),
                    "—" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL"),
                    fmt(r["heldout_ppl"]),
                    fmt(r["params"], "params"),
                    fmt(r["search_tokens"]),
                    fmt(r["search_wall_s"]),
                    fmt(r["search_stage_s"]),
                ]
                for r in rows
            ],
        ),
        "",
    ]
    cost = extra_cost(rows)
    if cost:
        out.append(
            f"Extra search cost per added budget: {cost['extra_tokens']:,.0f} tokens, {cost['extra_wall_s']:.1f} s "
            f"(the first budget: {cost['first_tokens']:,.0f} tokens, "
            f"{cost['first_wall_s']:.1f} s); router search only ('search s'); 'search stage s' is the whole stage: model build, settle, judge and engine check. "
            "A relative budget is checked on the ratio to the parent timed in the same rounds ('measured / parent'); "
            "'budget when measured' is the budget's factor times the parent's time in those rounds."
        )
    by = next((r["measured_by"] for r in rows if r["measured_by"]), "")
    if by:
        out.append(f"Measured by: {by}. Perplexity is reported as measured; it is not forced to fall with the budget.")
    return out

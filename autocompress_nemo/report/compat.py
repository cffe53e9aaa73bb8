"""Read the layout ``stages.report.collect_results`` writes today into the report schema.

The pipeline gathers its artifacts as::

    {"target": {"name", "description", "engine": str | {"name", "version", "dtype"}, "hardware": str, "workload": {...}},
     "budgets": {metric: absolute}, "budget_reference": str,
     "models": {name: {"spec", "params", "accuracy": {"heldout_ppl", "heldout_tokens", "lm_eval", ...},
                       "predicted": {...}, "measured": {...}, "measured_memory": {...},
                       "measured_by": "<engine> <version> on <device>[ (estimated, not measured)]",
                       "budget_check": {metric: {"budget", "measured", "predicted", "pass"}}}},
     "methods": {method: {"arch", "trajectory", "selection_tokens", "recovery_tokens"}},
     "validation": {"errors", "label", "estimated", "engine", "models"}, "stages_wall_s": {stage: s}}

``from_pipeline`` maps it onto the schema of ``report/__init__.py`` (keys already in that
schema are kept), so either layout can be handed to ``write_report``.
"""

from __future__ import annotations

from typing import Any

ESTIMATED = "estimated, not measured"


def looks_like_pipeline(results: dict[str, Any]) -> bool:
    models = results.get("models") or {}
    return any(k in results for k in ("methods", "stages_wall_s", "budget_reference")) or any(
        isinstance(e, dict) and ("spec" in e or "measured_by" in e) for e in models.values()
    )


def _measured_source(label: str) -> str:
    if not label:
        return ""
    return label if ESTIMATED in label else f"measured in {label}"


def _model(entry: dict[str, Any], method: dict[str, Any], validation: dict[str, Any]) -> dict[str, Any]:
    e = dict(entry)
    if "arch" not in e and isinstance(e.get("spec"), dict):
        e["arch"] = e.pop("spec")
    label = str(e.pop("measured_by", "") or "")
    if isinstance(e.get("measured"), dict):
        e["measured"] = dict(e["measured"])
        if "measured_memory" in e:
            e["measured"].setdefault("memory", e.pop("measured_memory"))
        if label:
            e["measured"].setdefault("source", _measured_source(label))
    if isinstance(e.get("predicted"), dict):
        e["predicted"] = dict(e["predicted"])
        est = bool(validation.get("estimated")) or ESTIMATED in label
        engine = label.replace(f" ({ESTIMATED})", "")
        e["predicted"].setdefault(
            "source", ESTIMATED if est else (f"predicted from the cost table measured in {engine}" if engine else "")
        )
        if not e["predicted"]["source"]:
            del e["predicted"]["source"]
    bc = e.pop("budget_check", None)
    if isinstance(bc, dict) and "checks" not in e:
        e["checks"] = [{"metric": m, "value": "budget", "checked_as": m, **c} for m, c in bc.items()]
        e.setdefault("pass", all(bool(c.get("pass")) for c in bc.values()) if bc else None)
    acc = dict(e.get("accuracy") or {})
    if "heldout_ppl" in acc:
        acc.setdefault("perplexity", acc["heldout_ppl"])
    if "heldout_tokens" in acc:
        acc.setdefault("perplexity_tokens", acc["heldout_tokens"])
    e["accuracy"] = acc
    if e.get(
        "accuracy_exported"
    ):  # stages/evaluate.py: held-out perplexity / lm-eval of the exported GGUF in llama.cpp
        e["accuracy_exported"] = dict(e["accuracy_exported"])
    if method.get("recovery_tokens"):
        e.setdefault("recovery_tokens", method["recovery_tokens"])
    arch = method.get("arch") or {}
    if arch.get("verified_in_engine"):  # search_core.verify_measured: the architecture measured before slicing
        e.setdefault("engine_check_before_slicing", arch["verified_in_engine"])
    if arch.get("quality_guard"):  # search/settle.Settler.guard: the settled child's KD next to the alternatives
        e.setdefault("quality_guard", arch["quality_guard"])
    if method.get("refit"):  # stages/extract.refit: the student's starting weights, least-squares re-fit
        e.setdefault("refit", method["refit"])
    if method.get("reconstruct"):  # stages/reconstruct.py: the blockwise local distillation's record
        e.setdefault("reconstruct", method["reconstruct"])
    if (arch.get("minitron") or {}).get("variant"):
        e.setdefault("selection_variant", arch["minitron"]["variant"])
    return e


def from_pipeline(results: dict[str, Any]) -> dict[str, Any]:
    """The report-schema view of a ``stages.report.collect_results`` dict (see the module docstring)."""
    r = dict(results)
    methods = r.pop("methods", None) or {}
    validation = r.pop("validation", None) or {}
    t = dict(r.get("target") or {})
    if isinstance(t.get("engine"), str):
        t["engine"] = {"name": t["engine"]}
    if isinstance(t.get("hardware"), str):
        t["hardware"] = {"device": t["hardware"]}
    budgets = r.pop("budgets", None)
    reference = r.pop("budget_reference", "")
    if isinstance(budgets, dict) and not t.get("budgets"):
        t["budgets"] = [{"metric": m, "value": reference or "—", "absolute": v} for m, v in budgets.items()]
    r["target"] = t
    r["models"] = {k: _model(e, methods.get(k, {}), validation) for k, e in (r.get("models") or {}).items() if e}
    if "search_trajectory" not in r and methods.get("autocompress", {}).get("trajectory"):
        r["search_trajectory"] = methods["autocompress"]["trajectory"]
    tokens = dict(r.get("tokens") or {})
    if "autocompress" in methods:
        tokens.setdefault("search", methods["autocompress"].get("selection_tokens"))
    if "minitron_pp" in methods:
        tokens.setdefault("minitron_scoring", methods["minitron_pp"].get("selection_tokens"))
    rec = [m.get("recovery_tokens") for m in methods.values() if m.get("recovery_tokens")]
    if rec:
        tokens.setdefault("recovery", max(rec))
    r["tokens"] = {k: v for k, v in tokens.items() if v is not None}
    if validation and "cost_model_validation" not in r:
        src = next(
            (
                e["measured"].get("source")
                for e in r["models"].values()
                if isinstance(e.get("measured"), dict) and e["measured"].get("source")
            ),
            "",
        )
        how = ESTIMATED if validation.get("estimated") else (src or f"measured in {validation.get('engine', '?')}")
        r["cost_model_validation"] = {
            "errors": validation.get("errors", {}),
            "errors_absolute": validation.get("errors_absolute", {}),
            "source": how,
            "n_models": validation.get("models"),
        }
    wall = r.pop("stages_wall_s", None)
    if isinstance(wall, dict) and "wall_time_s" not in r:
        r["wall_time_s"] = {k: float(v) for k, v in wall.items() if isinstance(v, int | float)}
    return r

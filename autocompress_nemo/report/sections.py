"""The sections of ``report.md``, one function each, joined by ``render_markdown``."""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.report.family import family_section
from autocompress_nemo.report.outputs import outputs_section
from autocompress_nemo.report.quality_curve import quality_curve_section
from autocompress_nemo.report.quantization import quantization_section
from autocompress_nemo.report.recovery_path import recovery_path_section
from autocompress_nemo.report.tables import (
    COST_METRICS,
    DISPLAY,
    NO_SOURCE,
    UNITS,
    block_width,
    fmt,
    spec_of,
    table,
)
from autocompress_nemo.report.timing import timing_section


def _summary(res: dict[str, Any]) -> list[str]:
    m = res["models"]
    out = []
    for key, e in m.items():  # every student (the parent is the reference, not judged)
        if key == "parent" or not isinstance(e, dict) or "label" not in e:
            continue
        src = (e.get("measured") or {}).get("source")
        if e.get("pass") is None:
            out.append(f"- {e['label']}: budget compliance not measured.")
        else:
            verdict = "meets every budget" if e["pass"] else "MISSES at least one budget"
            out.append(f"- {e['label']} {verdict} ({src}).")
    ac, mpp = m.get("autocompress"), m.get("minitron_pp")
    p_ac = (ac or {}).get("accuracy", {}).get("perplexity")
    p_mpp = (mpp or {}).get("accuracy", {}).get("perplexity")
    tokens = res["tokens"].get("recovery")
    if p_ac is not None and p_mpp is not None:
        better = "lower" if p_ac < p_mpp else ("equal" if p_ac == p_mpp else "HIGHER")
        out.append(
            f"- Held-out perplexity after {fmt(tokens)} recovery tokens each: AutoCompress {p_ac:.4g} vs "
            f"Minitron++ {p_mpp:.4g} — AutoCompress is {better}."
        )
    elif mpp is None:
        out.append("- Minitron++ baseline: not run (run with `baseline=true` to compare).")
    return out


def _target(res: dict[str, Any]) -> list[str]:
    t = res["target"]
    if not t:
        return ["Target not recorded."]
    hw, eng, wl = t.get("hardware") or {}, t.get("engine") or {}, t.get("workload") or {}
    lines = [
        f"**{t.get('name', '?')}** — {t.get('description', '')}".rstrip(" —"),
        "",
        f"- hardware: {hw.get('device', hw.get('name', '?'))}",
        f"- engine: {eng.get('name', '?')} {eng.get('version', '')} ({eng.get('dtype', '?')})".replace("  ", " "),
        "- workload: "
        + ", ".join(f"{k} {wl[k]}" for k in ("batch", "input_len", "output_len", "context_len") if k in wl),
        "",
    ]
    budgets = t.get("budgets") or []
    if budgets:
        lines.append(
            table(
                ["budget metric", "as configured", "absolute", "unit"],
                [
                    [
                        b.get("metric"),
                        b.get("value"),
                        fmt(b.get("absolute"), b.get("metric", "")),
                        UNITS.get(b.get("metric", ""), ""),
                    ]
                    for b in budgets
                ],
            )
        )
    else:
        lines.append("No budgets recorded.")
    return lines


def _models(res: dict[str, Any]) -> list[str]:
    m = res["models"]
    p_par = (m.get("parent") or {}).get("params")
    rows = []
    for e in m.values():
        spec = spec_of(e)
        kept = "—"
        if spec is not None:
            kept = f"{sum(not b.removed for b in spec.blocks)}/{len(spec.blocks)}"
        ratio = f"{e['params'] / p_par:.3f}" if e.get("params") and p_par else "—"
        rows.append([e["label"], fmt(e.get("params"), "params"), ratio, kept, fmt(e.get("recovery_tokens"))])
    return [table(["model", "params (M)", "x parent", "blocks kept", "recovery tokens"], rows)]


def _costs(res: dict[str, Any]) -> list[str]:
    rows = []
    for e in res["models"].values():
        for kind in ("predicted", "measured"):
            d = e.get(kind)
            if not d:
                rows.append([e["label"], kind, *(["—"] * len(COST_METRICS)), "not run"])
                continue
            rows.append([e["label"], kind, *(fmt(d.get(k), k) for k in COST_METRICS), d.get("source", NO_SOURCE)])
    header = ["model", "figure", *(f"{k} ({UNITS[k]})" for k in COST_METRICS), "source"]
    return [table(header, rows)]


def _checks(res: dict[str, Any]) -> list[str]:
    rows = []
    for e in res["models"].values():
        src = (e.get("measured") or {}).get("source", NO_SOURCE)
        for c in e.get("checks") or []:
            metric = c.get("checked_as") or c.get("metric", "")
            verdict = (
                "reference"
                if c.get("reference")
                else ("—" if c.get("pass") is None else ("PASS" if c["pass"] else "FAIL"))
            )
            rows.append(
                [
                    e["label"],
                    f"{c.get('metric')} ≤ {c.get('value')}",
                    fmt(c.get("budget"), metric),
                    fmt(c.get("measured"), metric),
                    fmt(c.get("predicted"), metric),
                    verdict,
                    c.get("note", ""),
                    src,
                ]
            )
    if not rows:
        return ["No engine measurement against the budgets was recorded."]
    return [
        table(["model", "constraint", "budget", "measured", "predicted", "result", "note", "measured: source"], rows),
        "",
        "Units as in the cost table (ms, MiB, tok/s); a throughput budget is checked as the "
        "equivalent per-step decode time.",
    ]


def _accuracy(res: dict[str, Any]) -> list[str]:
    models = res["models"]
    tasks: list[tuple[str, str]] = []
    for e in models.values():
        for task, metrics in (e["accuracy"].get("lm_eval") or {}).items():
            for k in metrics:
                if "stderr" not in k and (task, k) not in tasks:
                    tasks.append((task, k))
    header = ["model", "perplexity (held-out)", "tokens", *(f"{t} {k}" for t, k in tasks)]
    rows = []
    for e in models.values():
        a = e["accuracy"]
        lm = a.get("lm_eval") or {}
        rows.append(
            [
                e["label"],
                fmt(a.get("perplexity")),
                fmt(a.get("perplexity_tokens")),
                *(fmt(lm.get(t, {}).get(k)) for t, k in tasks),
            ]
        )
    out = [table(header, rows)]
    heldout = next((e["accuracy"].get("heldout") for e in models.values() if e["accuracy"].get("heldout")), None)
    if heldout:
        out += ["", f"Held-out text: {heldout}."]
    if not tasks:
        out += ["", "No lm-eval tasks were run."]
    out += ["", "Perplexities and lm-eval above: the project's PyTorch (Megatron) model on this machine."]
    file_rows = []
    for e in models.values():
        f = e.get("accuracy_exported")
        if not f:
            continue
        lm = f.get("lm_eval") or {}
        file_rows.append(
            [
                e["label"],
                f.get("file", ""),
                fmt(f.get("heldout_ppl")),
                fmt(e["accuracy"].get("perplexity")),
                f"{100 * float(f.get('rel_diff_vs_pytorch', 0.0)):+.3f} %",
                *(fmt(lm.get(t, {}).get(k)) for t, k in tasks),
                f.get("measured_by", ""),
            ]
        )
    if file_rows:
        out += [
            "",
            "Measured on the exported file:",
            "",
            table(
                [
                    "model",
                    "file",
                    "perplexity (file)",
                    "perplexity (PyTorch)",
                    "difference",
                    *(f"{t} {k}" for t, k in tasks),
                    "measured by",
                ],
                file_rows,
            ),
        ]
    return out


def _before_recovery(res: dict[str, Any]) -> list[str]:
    """The architectures alone: each extracted student (sliced from the sorted parent) before
    any recovery distillation, on the same held-out text."""
    br = res.get("before_recovery") or {}
    if not br:
        return ["Not evaluated."]
    rows = [
        [DISPLAY.get(k, k), fmt(v.get("heldout_ppl")), fmt(v.get("kd_to_parent")), fmt(v.get("heldout_tokens"))]
        for k, v in br.items()
    ]
    return [table(["student (extracted, no recovery)", "perplexity (held-out)", "KD loss to parent", "tokens"], rows)]


def _refit(res: dict[str, Any]) -> list[str]:
    """The student's starting weights (``extract/compensate.py``): the plain slice of the sorted parent
    or its least-squares re-fit output projections, with what the re-fit changed."""
    rows = []
    for e in res["models"].values():
        r = e.get("refit")
        if not r or not r.get("blocks"):
            continue
        blocks = r["blocks"]
        err = {k: sum(b[k] for b in blocks) / len(blocks) for k in ("sliced_error", "refit_error")}
        rows.append(
            [
                e["label"],
                "least-squares re-fit" if r.get("used") else "plain slice (the re-fit was no better)",
                str(len(blocks)),
                f"{r.get('tokens', 0):,}",
                f"{err['sliced_error']:.4f} -> {err['refit_error']:.4f}",
                f"{fmt(r.get('sliced_kd'))} -> {fmt(r.get('refit_kd'))}",
            ]
        )
    if not rows:
        return [
            "Every student starts from the plain slice of the sorted parent (`extract.refit=none`, or nothing narrowed)."
        ]
    return [
        "The output projection of every narrowed attention / MLP block re-fit by least squares to what the "
        "parent's whole block wrote, on calibration tokens (`extract.refit`); kept only where it lowers the KD "
        "to the parent on the search judge's batches. Measured in PyTorch on this run's calibration text.",
        "",
        table(
            [
                "model",
                "starting weights",
                "re-fit projections",
                "calibration tokens",
                "mean relative output error (slice -> re-fit)",
                "KD to parent (slice -> re-fit)",
            ],
            rows,
        ),
    ]


def _guard(res: dict[str, Any]) -> list[str]:
    """The quality guard before slicing (``search/settle.py``): the chosen child's loss next to
    the router's final expected loss and the uniform child's at the same predicted targets, and
    the pre-recovery / final held-out perplexity of the same student."""
    br = res.get("before_recovery") or {}
    rows = []
    for key, e in res["models"].items():
        g = e.get("quality_guard")
        if not g:
            continue
        pre = (br.get(key) or {}).get("heldout_ppl")
        rows.append(
            [
                e["label"],
                g.get("judge", ""),
                fmt(g.get("router_expected_kd")),
                fmt(g.get("uniform_kd")),
                fmt(g.get("child_kd")),
                fmt(g.get("final_kd")),
                g.get("verdict", ""),
                fmt(pre),
                fmt((e.get("accuracy") or {}).get("perplexity")),
            ]
        )
    if not rows:
        return ["No quality guard recorded (the parent met the budget, or an older run)."]
    return [
        table(
            [
                "model",
                "judge",
                "router expected KD",
                "uniform child KD",
                "chosen child KD",
                "final child KD",
                "guard",
                "perplexity before recovery",
                "perplexity after recovery",
            ],
            rows,
        ),
        "",
        "KD losses to the parent on the search's calibration batches (PyTorch, this machine); the router's "
        "figure is the mean over its last steps on its training batches; the uniform child is the best of the "
        "uniform children within the same targets by that loss (`search.guard_uniform` of them, widest first). "
        "An AutoCompress child over `search.guard_factor` times the uniform child's KD is replaced by the best of "
        "the uniform child and that child grown to the same targets (Minitron++: recorded only). "
        "Perplexities: held-out text, PyTorch.",
    ]


def _widths(res: dict[str, Any]) -> list[str]:
    specs: dict[str, ArchSpec] = {e["label"]: s for e in res["models"].values() if (s := spec_of(e)) is not None}
    if not specs:
        return ["No architectures recorded."]
    labels = list(specs)
    if all(s.is_dense_layered() for s in specs.values()) and len({s.num_layers for s in specs.values()}) == 1:
        n = next(iter(specs.values())).num_layers
        header = ["layer", *(f"{lab} attention" for lab in labels), *(f"{lab} ffn" for lab in labels)]
        rows = []
        for i in range(n):
            rows.append(
                [
                    i,
                    *(block_width(specs[lab].layers()[i][0]) for lab in labels),
                    *(block_width(specs[lab].layers()[i][1]) for lab in labels),
                ]
            )
        return [table(header, rows)]
    n = max(len(s.blocks) for s in specs.values())
    rows = [
        [i, *(f"{s.blocks[i].kind} {block_width(s.blocks[i])}" if i < len(s.blocks) else "—" for s in specs.values())]
        for i in range(n)
    ]
    return [table(["block", *labels], rows)]


def _validation(res: dict[str, Any]) -> list[str]:
    v = res["cost_model_validation"]
    if not v or not v.get("errors"):
        return ["Cost-model validation not run: predicted costs are unvalidated."]
    rows = [
        [k, fmt(e.get("mape")), fmt(e.get("max_ape")), fmt(e.get("bias")), fmt(e.get("n"))]
        for k, e in v["errors"].items()
    ]
    out = [
        table(["metric", "mean abs error %", "max abs error %", "bias %", "models"], rows),
        "",
        f"Source: {v.get('source', NO_SOURCE)}"
        + (f"; {v['n_models']} models not used to build the table." if v.get("n_models") else "."),
    ]
    old = v.get("errors_absolute") or {}
    if old:  # the same models judged on their own absolute times (no reference): what the load does
        out += [
            "",
            "Measured as ratios to the parent timed in the same rounds (above). The same models judged on "
            "their own absolute times, as before the reference was timed:",
            "",
            table(
                ["metric", "mean abs error %", "max abs error %", "bias %"],
                [[k, fmt(e.get("mape")), fmt(e.get("max_ape")), fmt(e.get("bias"))] for k, e in old.items()],
            ),
        ]
    return out


def _tokens_wall(res: dict[str, Any]) -> list[str]:
    t, w = res["tokens"], res["wall_time_s"]
    out = [
        table(["tokens", "count"], [[k.replace("_", " "), fmt(v)] for k, v in t.items()])
        if t
        else "Token counts not recorded.",
        "",
    ]
    if w:
        rows = [[k, f"{v:.1f}"] for k, v in w.items()] + [["total", f"{sum(w.values()):.1f}"]]
        out.append(table(["stage", "wall time (s)"], rows))
    else:
        out.append("Wall times not recorded.")
    return out


def _selection(res: dict[str, Any]) -> list[str]:
    """How each student's architecture was settled before any weights were sliced: the engine
    measurements of ``search.verify_rounds`` (a miss tightens the predicted target and repairs),
    and which Minitron++ variant ran."""
    rows, notes = [], []
    for e in res["models"].values():
        for r in e.get("engine_check_before_slicing") or []:
            for m, c in (r.get("measured") or {}).items():
                b = (r.get("budget_measured") or r.get("budget") or {}).get(m)
                ok = r.get("pass") if b is None else c <= b
                rows.append(
                    [
                        e["label"],
                        r.get("round"),
                        m,
                        fmt(c, m),
                        fmt((r.get("predicted") or {}).get(m), m),
                        fmt((r.get("predicted_target") or {}).get(m), m),
                        "PASS" if ok else "over",
                    ]
                )
        if e.get("selection_variant"):
            notes.append(f"- {e['label']}: {e['selection_variant']}.")
    out = []
    if rows:
        out += [
            table(["model", "round", "metric", "measured", "predicted", "predicted target", "result"], rows),
            "",
            "Measured in the target's engine on the architecture alone (random weights) before slicing; a "
            "round over budget tightens that metric's predicted target by the table's error on that model "
            "and repairs again.",
            "",
        ]
    out += notes
    return out or [
        "No architecture was measured before slicing (the engine is an estimate, or search.verify_rounds=0)."
    ]


def render_markdown(res: dict[str, Any]) -> str:
    run = res["run"]
    parts = [f"# AutoCompress report{(' — ' + run['name']) if run.get('name') else ''}", ""]
    if run.get("command"):
        parts += [f"Command: `{run['command']}`" + (f" ({run['created']})" if run.get("created") else ""), ""]
    sections = [
        *([("Family: one student per budget", family_section(res))] if res.get("family") else []),
        ("Summary", _summary(res)),
        ("Target and budgets", _target(res)),
        ("Models", _models(res)),
        ("Costs: predicted and measured", _costs(res)),
        ("Budget compliance", _checks(res)),
        ("Accuracy", _accuracy(res)),
        ("What quantization costs", quantization_section(res)),
        ("Before recovery distillation", _before_recovery(res)),
        ("Quality versus recovery tokens", quality_curve_section(res)),
        ("Per-block widths", _widths(res)),
        ("Architecture checks before slicing", _selection(res)),
        ("Quality guard before slicing", _guard(res)),
        ("Starting weights", _refit(res)),
        ("Recovery path", recovery_path_section(res)),
        ("Cost-model validation", _validation(res)),
        ("Timing against the parent", timing_section(res)),
        ("Outputs and what consumes them", outputs_section(res)),
        ("Tokens and wall time", _tokens_wall(res)),
    ]
    for title, lines in sections:
        parts += [f"## {title}", "", *lines, ""]
    plots = res.get("plots") or {}
    skipped = res.get("plots_skipped") or {}
    if plots or skipped:
        parts += ["## Plots", ""]
        parts += [f"![{name}]({file})" for name, file in plots.items()]
        parts += [f"- {name}: not drawn ({why})" for name, why in skipped.items()]
        parts.append("")
    if res["notes"]:
        parts += ["## Notes", "", *(f"- {n}" for n in res["notes"]), ""]
    return "\n".join(parts)

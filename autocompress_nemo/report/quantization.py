"""The report's "What quantization costs" section (a quantized llama.cpp deployment dtype): each
model's held-out perplexity in PyTorch (float32), as an F16 GGUF and in the deployment dtype in
llama.cpp, the increase quantization adds, the effective bits per weight of the quantized file and its
lm-eval scores — the parent quantized by the same quantizer as the students
(``stages/evaluate.quantization_costs``)."""

from __future__ import annotations

from typing import Any

from autocompress_nemo.report.tables import fmt, table


def quantization_section(res: dict[str, Any]) -> list[str]:
    models = res["models"]
    recs = {k: e["accuracy_quantization"] for k, e in models.items() if e.get("accuracy_quantization")}
    if not recs:
        return ["Not measured: the deployment dtype is not a llama.cpp quantization (or no GGUF was written)."]
    dtype = next(iter(recs.values()))["dtype"]
    tasks: list[tuple[str, str]] = []
    for r in recs.values():
        for task, metrics in ((r.get(dtype) or {}).get("lm_eval") or {}).items():
            tasks += [(task, k) for k in metrics if "stderr" not in k and (task, k) not in tasks]
    rows = []
    for k, r in recs.items():
        q = r.get(dtype) or {}
        lm = q.get("lm_eval") or {}
        rows.append(
            [
                models[k]["label"],
                fmt((models[k].get("accuracy") or {}).get("perplexity")),
                fmt(r["f16"]["heldout_ppl"]),
                fmt(q.get("heldout_ppl")),
                f"{100 * float(r['ppl_increase']):+.2f} %",
                fmt(q.get("bpw_matrices")),
                fmt(q.get("fallbacks")),
                *(fmt(lm.get(t, {}).get(m)) for t, m in tasks),
            ]
        )
    by = next(iter(recs.values())).get("measured_by", "llama.cpp")
    return [
        table(
            [
                "model",
                "perplexity (PyTorch, float32)",
                "perplexity (F16 GGUF)",
                f"perplexity ({dtype} GGUF)",
                f"{dtype} vs F16",
                "bits per weight (matrices)",
                "fallback tensors",
                *(f"{t} {m} ({dtype})" for t, m in tasks),
            ],
            rows,
        ),
        "",
        f"GGUF figures measured in {by}, on the same held-out text as the PyTorch ones; every file quantized "
        f"by llama.cpp's own quantizer (the parent exactly as the students), so the {dtype} column is what the "
        "deployment serves and the last perplexity column pair is what quantization costs on top of pruning.",
    ]

"""The whole pipeline on a tiny model with the real engine (llama.cpp on this CPU): every
stage runs, the report is written, the students are measured in llama.cpp and meet the
budget there, and the exported GGUF (``deci`` when heterogeneous) loads and generates text.

The budget is the memory llama.cpp allocates (weights + KV cache + compute buffers, 0.8x the
parent's, measured the same way): a budget the tiny model can reach and that the engine measures
the same way every time. Its decode time (~0.1-0.2 ms a token) sits at the timing noise floor of a
shared CPU: the parent itself can measure 40 % apart between profiling and evaluation, so a decode
budget could not be required to pass. Decode time is still measured and reported.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: engines)")
BUDGET = [  # memory_bytes <= 0.8x the parent's, both measured in llama.cpp
    "budget@target.budget=fit_device_memory",
    "target.budget.name=memory_0.8x",
    "target.budget.constraints.0.value=0.8x",
]


def test_tiny_pipeline_end_to_end_in_llama_cpp(tmp_path, capsys) -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    cfg = compose(
        [
            "model=tiny_llama",
            "+target=tiny_cpu",
            "search=quick",
            "baseline=true",
            f"run_dir={tmp_path}/run",
            "evaluate.lm_eval_items=16",
            "evaluate.heldout_batches=2",
            "search.minitron_retrain_steps=2",
            *BUDGET,
        ]
    )
    out = run_pipeline(cfg)
    run = tmp_path / "run"
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    for name in ("parent", "autocompress", "minitron_pp"):
        m = ev["models"][name]
        assert m["measured_by"].startswith("llama_cpp"), m["measured_by"]
        assert m["measured"]["decode_ms"] > 0 and m["measured"]["memory_bytes"] > 0, m["measured"]
        assert m["accuracy"]["heldout_ppl"] > 1
        assert "stdlib_next_line" in m["accuracy"]["lm_eval"]
    assert not ev["models"]["parent"]["budget_check"]["memory_bytes"]["pass"]  # the budget binds
    for name in ("autocompress", "minitron_pp"):  # the recovered students, measured in llama.cpp, meet it
        check = ev["models"][name]["budget_check"]
        assert set(check) == {"memory_bytes"} and all(c["pass"] for c in check.values()), (name, check)
    assert set(ev["before_recovery"]) == {"autocompress", "minitron_pp"}
    for m in ("autocompress", "minitron_pp"):  # the chosen architecture was measured in llama.cpp before slicing
        verified = json.loads((run / f"search_{m}" / "arch.json").read_text())["verified_in_engine"]
        assert verified and verified[0]["measured"]["memory_bytes"] > 0, verified
        # the student sliced is one the engine measured within the budget: the last round passed, or a
        # later (grown) child missed and the last passing one was kept
        assert verified[-1]["pass"] or verified[-1].get("action") == "kept the last passing child", verified
        assert any(v["pass"] for v in verified), verified
        guard = json.loads((run / f"search_{m}" / "arch.json").read_text())["quality_guard"]
        assert guard["final_kd"] <= guard["factor"] * guard["uniform_kd"] + 1e-9, guard
    # accuracy measured on the exported file in llama.cpp, next to the PyTorch figure
    on_file = ev["models"]["autocompress"]["accuracy_exported"]
    assert abs(on_file["rel_diff_vs_pytorch"]) < 0.01, on_file
    parity = json.loads((run / "export_autocompress" / "parity.json").read_text())
    assert parity["pass"] and parity["max_abs_dlogit"] <= parity["tolerance"]
    report = (run / "report.md").read_text()
    assert "## Budget compliance" in report and "measured in llama_cpp" in report
    version = json.loads((run / "profile" / "cost_table" / "cost_table.json").read_text())["provenance"][
        "engine_version"
    ]
    assert f"- engine: llama_cpp {version} (f16)" in report  # the version the table measured, not "?"
    assert out["report"].endswith("report.md")
    ggufs = list((run / "export_autocompress").glob("*.gguf"))
    assert len(ggufs) == 1
    llm = llama_cpp.Llama(model_path=str(ggufs[0]), n_ctx=64, n_threads=1, verbose=False)
    res = llm("def main(", max_tokens=6, temperature=0.0)
    assert res["usage"]["completion_tokens"] >= 1
    assert (run / "export_autocompress" / "hf" / "config.json").is_file()


def test_quantized_deployment_is_evaluated_after_quantization(tmp_path) -> None:
    """A Q8_0 deployment: the students are measured after llama.cpp's quantizer, and every model —
    the parent quantized the same way — gets its held-out perplexity as an F16 GGUF and as a Q8_0
    GGUF in llama.cpp, lm-eval in Q8_0, and the report's "What quantization costs" table."""
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    cfg = compose(
        [
            "model=tiny_llama",
            "+target=tiny_cpu",
            "target.engine.dtype=q8_0",
            "search=quick",
            f"run_dir={tmp_path}/run",
            "evaluate.lm_eval_items=8",
            "evaluate.heldout_batches=1",
            *BUDGET,
        ]
    )
    run_pipeline(cfg)
    run = tmp_path / "run"
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    for name in ("parent", "autocompress"):
        m = ev["models"][name]
        q = m["accuracy_quantization"]
        assert q["dtype"] == "q8_0", q
        # the F16 file is the project's model (llama.cpp vs float32 PyTorch), Q8_0 is a small step from it
        assert abs(q["f16"]["heldout_ppl"] / m["accuracy"]["heldout_ppl"] - 1) < 0.01, (name, q)
        assert abs(q["ppl_increase"]) < 0.05, (name, q)
        assert 8.4 < q["q8_0"]["bpw_matrices"] < 8.6, q  # Q8_0: 34 bytes per 32 weights
        assert "stdlib_next_line" in q["q8_0"]["lm_eval"], q
    # the student's Q8_0 figure is its exported, quantized file
    exported = ev["models"]["autocompress"]["accuracy_exported"]
    assert ev["models"]["autocompress"]["accuracy_quantization"]["q8_0"]["heldout_ppl"] == exported["heldout_ppl"]
    qrec = json.loads((run / "export_autocompress" / "quantization.json").read_text())
    assert qrec["dtype"] == "q8_0" and qrec["predicted_exact"], qrec
    report = (run / "report.md").read_text()
    section = report.split("## What quantization costs", 1)[1].split("\n## ", 1)[0]
    assert "perplexity (q8_0 GGUF)" in section and "Parent" in section and "AutoCompress" in section, section

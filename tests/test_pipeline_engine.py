"""The whole pipeline on a tiny model with the real engine (llama.cpp on this CPU): every
stage runs, the report is written, the students are measured in llama.cpp against the
budget, and the exported GGUF (``deci`` when heterogeneous) loads and generates text."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: engines)")


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
        ]
    )
    out = run_pipeline(cfg)
    run = tmp_path / "run"
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    for name in ("parent", "autocompress", "minitron_pp"):
        m = ev["models"][name]
        assert m["measured_by"].startswith("llama_cpp"), m["measured_by"]
        assert m["accuracy"]["heldout_ppl"] > 1
        assert "stdlib_next_line" in m["accuracy"]["lm_eval"]
    assert set(ev["before_recovery"]) == {"autocompress", "minitron_pp"}
    for m in ("autocompress", "minitron_pp"):  # the chosen architecture was measured in llama.cpp before slicing
        verified = json.loads((run / f"search_{m}" / "arch.json").read_text())["verified_in_engine"]
        assert verified[0]["measured"]["decode_ms"] > 0
        # the student sliced is one the engine measured within the budget, unless the measurement put the
        # budget below the smallest child (tiny models decode in ~0.05 ms: at the timing noise floor), said so
        assert verified[-1]["pass"] or "target unreachable" in verified[-1].get("action", ""), verified
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

"""The whole pipeline on tiny hybrid MoE models with CPU targets, in both hybrid engines:

- llama.cpp (``tiny_hybrid_cpu``, model ``tiny_hybrid_moe``: ``M*EM*E``, 4 experts top-2, shared
  expert): profiled, validated and measured in llama.cpp; the student is exported as a
  ``nemotron_h_moe`` GGUF gated by its logits' parity with the PyTorch student, and its held-out
  perplexity is measured on that file in llama.cpp;
- the PyTorch-eager fallback (``tiny_hybrid_eager_cpu``, model ``tiny_hybrid``: ``M*EME-``, which
  llama.cpp refuses for its dense MLP block next to MoE blocks): transformers' NemotronH on CPU, a
  measurement engine, not a production serving engine; export writes a Nemotron-H HF directory and
  no GGUF.

The report must show the per-block MoE shapes and the students' costs measured in the engine
against the budget."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec("mamba_ssm") is None,
        reason="Mamba blocks need mamba-ssm (models/hybrid/builder.py MAMBA_INSTALL)",
    ),
]
pytest.importorskip("transformers.models.nemotron_h", reason="transformers without NemotronH")


@pytest.mark.parametrize(
    "model, target, engine",
    [("tiny_hybrid_moe", "tiny_hybrid_cpu", "llama_cpp"), ("tiny_hybrid", "tiny_hybrid_eager_cpu", "torch_eager")],
    ids=["llama_cpp", "torch_eager"],
)
def test_tiny_hybrid_pipeline_end_to_end(tmp_path, model, target, engine) -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    if engine == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed")
    cfg = compose(
        [
            f"model={model}",
            f"+target={target}",
            "search=quick",
            "baseline=false",
            f"run_dir={tmp_path}/run",
            "search.steps=6",
            "search.calib_sequences=4",
            "distill.tokens=1024",
            "evaluate.lm_eval_items=8",
            "evaluate.heldout_batches=1",
            "target.engine.settings.decode_steps=16",
            "target.engine.repeats=2",
        ]
    )
    out = run_pipeline(cfg)
    run = tmp_path / "run"
    table = json.loads((run / "profile" / "cost_table" / "cost_table.json").read_text())
    assert table["provenance"]["engine"] == engine and not table["provenance"]["estimated"]
    kinds = {b["block"]["kind"] for b in table["blocks"]}
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    assert set(ev["budgets"]) == {"decode_ms", "memory_bytes"}
    for name in ("parent", "autocompress"):
        m = ev["models"][name]
        assert m["measured"]["decode_ms"] > 0 and m["measured_memory"]["weights"] > 0
        assert set(m["budget_check"]) == {"decode_ms", "memory_bytes"}
    report = (run / "report.md").read_text()
    assert "## Budget compliance" in report and engine in report
    assert "experts x" in report and "(top-" in report  # per-block expert shapes
    assert out["report"].endswith("report.md")
    hf = json.loads((run / "export_autocompress" / "hf" / "config.json").read_text())
    assert hf["model_type"] in ("nemotron_h", "nemotron_h_puzzle")
    ggufs = list((run / "export_autocompress").glob("*.gguf"))
    if engine == "torch_eager":
        assert "not a production serving engine" in table["provenance"]["serving"]
        assert kinds == {"attention", "mlp", "moe", "mamba"}
        assert ev["models"]["parent"]["measured_by"].startswith("torch_eager PyTorch eager")
        assert "shared" in report
        assert not ggufs
        return
    assert kinds == {"attention", "moe", "mamba"}
    assert ev["models"]["parent"]["measured_by"].startswith("llama_cpp llama-cpp-python"), ev["models"]["parent"]
    assert ev["models"]["parent"]["measured_memory"]["state"] > 0  # the Mamba state, as llama.cpp reports it
    parity = json.loads((run / "export_autocompress" / "parity.json").read_text())
    assert parity["pass"] and parity["max_abs_dlogit"] <= parity["tolerance"] and parity["dtype"] == "f16"
    assert [g.name for g in ggufs] == [parity["file"]]
    on_file = ev["models"]["autocompress"]["accuracy_exported"]
    torch_ppl = ev["models"]["autocompress"]["accuracy"]["heldout_ppl"]
    assert abs(on_file["heldout_ppl"] / torch_ppl - 1.0) < 0.02, (on_file["heldout_ppl"], torch_ppl)

"""The whole pipeline on the tiny hybrid MoE model (``M*EME-``, 4 experts, shared expert) with a
CPU target (issue 6). The engine is PyTorch eager (transformers' NemotronH) on CPU — a measurement
engine, not a production serving engine — because llama.cpp cannot serve per-block expert counts.
The report must show per-block expert counts and shared-expert widths, and the students' costs
measured in that engine against the budget; export writes a Nemotron-H HF directory, no GGUF."""

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


def test_tiny_hybrid_pipeline_end_to_end(tmp_path) -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline

    cfg = compose(
        [
            "model=tiny_hybrid",
            "+target=tiny_hybrid_cpu",
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
    assert table["provenance"]["engine"] == "torch_eager" and not table["provenance"]["estimated"]
    assert "not a production serving engine" in table["provenance"]["serving"]
    kinds = {b["block"]["kind"] for b in table["blocks"]}
    assert kinds == {"attention", "mlp", "moe", "mamba"}
    ev = json.loads((run / "evaluate" / "evaluation.json").read_text())
    assert set(ev["budgets"]) == {"decode_ms", "memory_bytes"}
    for name in ("parent", "autocompress"):
        m = ev["models"][name]
        assert m["measured_by"].startswith("torch_eager PyTorch eager"), m["measured_by"]
        assert m["measured"]["decode_ms"] > 0 and m["measured_memory"]["weights"] > 0
        assert set(m["budget_check"]) == {"decode_ms", "memory_bytes"}
    report = (run / "report.md").read_text()
    assert "## Budget compliance" in report and "torch_eager" in report
    assert "experts x" in report and "shared" in report and "(top-" in report  # per-block expert counts / widths
    assert out["report"].endswith("report.md")
    hf = json.loads((run / "export_autocompress" / "hf" / "config.json").read_text())
    assert hf["model_type"] in ("nemotron_h", "nemotron_h_puzzle")
    assert not list((run / "export_autocompress").glob("*.gguf"))

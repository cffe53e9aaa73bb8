"""The report: report.md / report.json / PNG plots written, provenance labels present, and a
missing baseline (or missing trajectory) tolerated and said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.report import write_report

PARENT = ArchSpec.llama(hidden=64, vocab=128, layers=3, heads=4, kv_groups=2, ffn=96, head_dim=16, name="parent")
A, M = AttentionBlock, MlpBlock
AC = PARENT.replace(blocks=(A(4, 2, 16), M(96), A(2, 1, 16), M(32), A(0, 0, 16), M(64)), name="ac")
MPP = ArchSpec.llama(hidden=64, vocab=128, layers=3, heads=2, kv_groups=2, ffn=64, head_dim=16, name="mpp")
MEASURED = "measured in llama-cpp-python 0.3.36 on x86-64 CPU, 2 cores"
ESTIMATED = "estimated, not measured"


def _costs(scale: float, source: str) -> dict:
    return {
        "prefill_ms": 10 * scale,
        "decode_ms": 2 * scale,
        "response_latency_ms": 10 * scale + 64 * 2 * scale,
        "throughput_tps": 500 / scale,
        "memory_bytes": 3e6 * scale,
        "source": source,
    }


def _engine_check(scale: float, budget: float) -> dict:
    meas = _costs(scale, "")
    meas.pop("source")
    return {
        "source": MEASURED,
        "measured": meas,
        "pass": meas["decode_ms"] <= budget,
        "checks": [
            {
                "metric": "decode_ms",
                "value": "0.6x",
                "checked_as": "decode_ms",
                "budget": budget,
                "measured": meas["decode_ms"],
                "predicted": 1.9 * scale,
                "pass": meas["decode_ms"] <= budget,
            }
        ],
    }


def _results(baseline: bool = True, trajectory: bool = True) -> dict:
    budget = 0.6 * 2.0
    models = {
        "parent": {
            "arch": PARENT.to_dict(),
            "predicted": _costs(1.0, ESTIMATED),
            "measured": _costs(1.0, MEASURED),
            "accuracy": {
                "perplexity": 12.5,
                "perplexity_tokens": 4096,
                "heldout": "stdlib held-out files",
                "lm_eval": {"tiny_mc": {"acc,none": 0.6, "acc_stderr,none": 0.1}},
            },
        },
        "autocompress": {
            "arch": AC.to_dict(),
            "predicted": _costs(0.55, ESTIMATED),
            "engine_check": _engine_check(0.58, budget),
            "recovery_tokens": 200_000,
            "accuracy": {"perplexity": 15.0, "lm_eval": {"tiny_mc": {"acc,none": 0.55}}},
        },
    }
    if baseline:
        models["minitron_pp"] = {
            "arch": MPP.to_dict(),
            "predicted": _costs(0.57, ESTIMATED),
            "engine_check": _engine_check(0.62, budget),
            "recovery_tokens": 200_000,
            "accuracy": {"perplexity": 16.0, "lm_eval": {"tiny_mc": {"acc,none": 0.5}}},
        }
    traj = [
        {
            "step": s,
            "tau": 2.0 - s / 25,
            "kd": 1.0 / (1 + s),
            "penalty": 0.1 * (s < 20),
            "entropy": 3.0 - s / 20,
            "expected_decode_ms": 2.0 - s / 50,
            "budget_decode_ms": budget,
        }
        for s in range(40)
    ]
    return {
        "run": {"name": "tiny_cpu__tiny", "command": "python -m autocompress_nemo.search target=tiny_cpu"},
        "target": {
            "name": "tiny_cpu",
            "description": "test target",
            "hardware": {"device": "x86-64 CPU, 2 cores"},
            "engine": {"name": "llama_cpp", "version": "llama-cpp-python 0.3.36", "dtype": "f16"},
            "workload": {"batch": 1, "input_len": 32, "output_len": 8, "context_len": 128},
            "budgets": [{"metric": "decode_ms", "value": "0.6x", "absolute": budget}],
        },
        "models": models,
        "cost_model_validation": {
            "errors": {"decode_ms": {"mape": 2.1, "max_ape": 3.0, "bias": -0.5, "n": 8}},
            "source": MEASURED,
            "n_models": 8,
        },
        "tokens": {"search": 51_200, "minitron_scoring": 8_192, "recovery": 200_000},
        "wall_time_s": {"profile": 30.0, "search": 120.5, "distill": 300.0},
        "search_trajectory": traj if trajectory else [],
    }


def test_report_files_plots_and_provenance(tmp_path: Path) -> None:
    paths = write_report(tmp_path, _results())
    for name in ("report.md", "report.json", "widths", "costs", "search_trajectory", "accuracy_vs_cost"):
        assert name in paths, name
    for name in ("widths", "costs", "search_trajectory", "accuracy_vs_cost"):
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (tmp_path / "report.md").read_text()
    assert MEASURED in md and ESTIMATED in md and "source not recorded" not in md
    # every measured/predicted cost row carries its source in the last column
    cost_rows = [ln for ln in md.splitlines() if ln.split("|")[2:3] in ([" measured "], [" predicted "])]
    assert len(cost_rows) == 6 and all(ln.rstrip(" |").endswith((MEASURED, ESTIMATED)) for ln in cost_rows)
    check_rows = [ln for ln in md.splitlines() if "| decode_ms ≤ 0.6x |" in ln]
    assert len(check_rows) == 2 and all(ln.rstrip(" |").endswith(MEASURED) for ln in check_rows)
    assert "AutoCompress meets every budget" in md and "Minitron++ MISSES at least one budget" in md
    assert "AutoCompress 15 vs Minitron++ 16 — AutoCompress is lower" in md
    assert "| 2 | 4h/2kv | removed | 2h/2kv | 96 | 64 | 64 |" in md  # layer 2: attention removed in AutoCompress
    assert "200,000" in md and "51,200" in md and "mean abs error %" in md
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["models"]["autocompress"]["params"] == param_count(AC)
    assert rep["models"]["autocompress"]["measured"]["source"] == MEASURED
    assert rep["models"]["minitron_pp"]["pass"] is False
    assert set(rep["plots"]) == {"widths", "costs", "search_trajectory", "accuracy_vs_cost"}


def test_report_without_baseline_or_trajectory(tmp_path: Path) -> None:
    res = _results(baseline=False, trajectory=False)
    res["models"]["autocompress"]["accuracy"]["perplexity"] = 20.0
    del res["cost_model_validation"]
    paths = write_report(tmp_path, res)
    md = paths["report.md"].read_text()
    assert "Minitron++ baseline: not run" in md
    assert "search_trajectory: not drawn (no search trajectory" in md
    assert "Cost-model validation not run" in md
    assert "search_trajectory" not in paths and paths["widths"].is_file()
    rep = json.loads(paths["report.json"].read_text())
    assert "minitron_pp" not in rep["models"] and "search_trajectory" in rep["plots_skipped"]


def test_report_says_when_autocompress_is_worse(tmp_path: Path) -> None:
    res = _results()
    res["models"]["autocompress"]["accuracy"]["perplexity"] = 17.0
    md = write_report(tmp_path, res)["report.md"].read_text()
    assert "AutoCompress 17 vs Minitron++ 16 — AutoCompress is HIGHER" in md


def test_report_needs_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to report"):
        write_report(tmp_path, {"models": {}})


def test_report_reads_the_pipeline_layout(tmp_path: Path) -> None:
    """``stages.report.collect_results`` output (its own key names) is mapped onto the report schema."""
    label = "llama_cpp llama-cpp-python 0.3.36 on x86-64 CPU, 2 cores"
    meas = {
        "prefill_ms": 5.0,
        "decode_ms": 1.1,
        "response_latency_ms": 75.4,
        "throughput_tps": 909.0,
        "memory_bytes": 2e6,
    }

    def model(spec: ArchSpec, ppl: float, ok: bool) -> dict:
        return {
            "spec": spec.to_dict(),
            "params": param_count(spec),
            "accuracy": {
                "heldout_ppl": ppl,
                "heldout_tokens": 2048,
                "lm_eval": {"stdlib_next_line": {"acc,none": 0.4}},
            },
            "predicted": dict(meas),
            "measured": dict(meas),
            "measured_memory": {"weights": 1e6, "kv": 1e6},
            "measured_by": label,
            "budget_check": {"decode_ms": {"budget": 1.2, "measured": 1.1, "predicted": 1.0, "pass": ok}},
        }

    traj = [
        {
            "step": s,
            "tau": 1.0,
            "kd": 0.5,
            "penalty": 0.0,
            "entropy": 1.0,
            "expected_decode_ms": 1.3,
            "budget_decode_ms": 1.2,
        }
        for s in range(5)
    ]
    results = {
        "target": {
            "name": "cpu_chat",
            "description": "d",
            "engine": "llama_cpp",
            "hardware": "cpu_2core",
            "workload": {"batch": 1, "input_len": 256, "output_len": 64, "context_len": 1024},
        },
        "budgets": {"decode_ms": 1.2},
        "budget_reference": "0.6x the parent measured in validation",
        "models": {
            "parent": model(PARENT, 10.0, False),
            "autocompress": model(AC, 12.0, True),
            "minitron_pp": model(MPP, 13.0, True),
        },
        "methods": {
            "autocompress": {
                "trajectory": traj,
                "selection_tokens": 1000,
                "recovery_tokens": 5000,
                "arch": {
                    "verified_in_engine": [
                        {
                            "round": 0,
                            "measured": {"decode_ms": 1.31},
                            "predicted": {"decode_ms": 1.19},
                            "predicted_target": {"decode_ms": 1.2},
                            "pass": False,
                        },
                        {
                            "round": 1,
                            "measured": {"decode_ms": 1.1},
                            "predicted": {"decode_ms": 1.0},
                            "predicted_target": {"decode_ms": 1.079},
                            "pass": True,
                        },
                    ]
                },
            },
            "minitron_pp": {
                "trajectory": [],
                "selection_tokens": 800,
                "recovery_tokens": 5000,
                "arch": {"minitron": {"variant": "width only, every layer kept"}},
            },
        },
        "validation": {
            "errors": {"decode_ms": {"mape": 1.0, "max_ape": 2.0, "bias": 0.1, "n": 6}},
            "label": "measured",
            "estimated": False,
            "engine": "llama_cpp",
            "models": 6,
        },
        "stages_wall_s": {"profile": 10.0, "distill_autocompress": 50.0, "rank": None},
    }
    paths = write_report(tmp_path, results)
    md = paths["report.md"].read_text()
    assert f"measured in {label}" in md and f"predicted from the cost table measured in {label}" in md
    assert "AutoCompress 12 vs Minitron++ 13 — AutoCompress is lower" in md
    assert "| AutoCompress | 0 | decode_ms | 1.31 | 1.19 | 1.2 | over |" in md
    assert "| AutoCompress | 1 | decode_ms | 1.1 | 1 | 1.079 | PASS |" in md
    assert "- Minitron++: width only, every layer kept." in md
    assert "| search | 1,000 |" in md and "| recovery | 5,000 |" in md and "| distill_autocompress | 50.0 |" in md
    assert "search_trajectory" in paths and "0.6x the parent measured in validation" in md
    rep = json.loads(paths["report.json"].read_text())
    # the parent is the budgets' reference (issue 37): never listed as FAIL against its student's budget
    assert rep["models"]["autocompress"]["pass"] is True and rep["models"]["parent"]["pass"] is None
    assert rep["models"]["autocompress"]["accuracy"]["perplexity"] == 12.0


def test_report_lists_every_output_with_the_command_that_reads_it(tmp_path: Path) -> None:
    """Issue 18: the student GGUF (llama.cpp), the HF directory (transformers / vLLM / TensorRT-LLM) and
    the Megatron checkpoint (Megatron-LM / Megatron-Bridge, distill.init_from) each with its command."""
    from autocompress_nemo.report.outputs import collect_outputs

    run = tmp_path / "runs" / "x"
    (run / "export_autocompress" / "hf").mkdir(parents=True)
    (run / "export_autocompress" / "s.gguf").write_bytes(b"GGUF")
    ck = run / "export_autocompress" / "megatron"
    ck.mkdir(parents=True)
    (ck / "latest_checkpointed_iteration.txt").write_text("64")
    rows = collect_outputs(run, ["autocompress", "minitron_pp"])
    by = {r["consumer"]: r for r in rows}
    assert set(by) == {
        "llama.cpp",
        "transformers",
        "vLLM",
        "TensorRT-LLM",
        "Megatron-LM / Megatron-Bridge",
        "this project",
    }
    assert "llama-cli -m" in by["llama.cpp"]["command"] and "vllm serve" in by["vLLM"]["command"]
    assert "--use-dist-ckpt" in by["Megatron-LM / Megatron-Bridge"]["command"]
    assert f"distill.init_from={ck}" in by["this project"]["command"]
    res = _results()
    res["outputs"] = rows
    md = write_report(tmp_path / "r", res)["report.md"].read_text()
    assert "## Outputs and what consumes them" in md and "trtllm-serve" in md
    md = write_report(tmp_path / "r2", _results())["report.md"].read_text()
    assert "No student was exported by this run" in md


def test_quality_curve_section_embeds_the_bench(tmp_path) -> None:
    """``bench/bench_quality.py``'s curve (``bench_quality/default/quality.json``) is read back by
    the report stage and shown per method and budget with the ratio to the parent and the plot."""
    from autocompress_nemo.report.quality_curve import CURVE, quality_curve_section, read_curve
    from autocompress_nemo.utils.artifacts import write_json_atomic

    assert read_curve(tmp_path) is None
    assert "Not measured" in quality_curve_section({"quality_curve": None})[0]
    plot = tmp_path / CURVE.parent / "quality.png"
    plot.parent.mkdir(parents=True)
    plot.write_bytes(b"png")
    point = dict(
        tokens=32768, heldout_ppl=16.0, ratio_to_parent=16.0 / 11.2, train_kd_last_tenth=0.5, tokens_per_s=150.0
    )
    write_json_atomic(
        tmp_path / CURVE,
        {
            "parent": {"heldout_ppl": 11.2},
            "labels": {"autocompress": "AutoCompress"},
            "before_recovery": {"autocompress": {"heldout_ppl": 45.0}},
            "curves": {"autocompress": [point]},
            "distill": {"lr": 5e-4},
            "overrides": [],
            "measured": "held-out perplexity in PyTorch",
            "plot": str(plot),
        },
    )
    text = "\n".join(quality_curve_section({"quality_curve": read_curve(tmp_path)}))
    assert "| AutoCompress | 32,768 | 16" in text and "1.43x" in text and "4.02x" in text
    assert "lr=0.0005" in text and "](bench_quality/default/quality.png)" in text


def test_gap_power_law_recovers_an_exact_power_law_and_refuses_what_is_not_one() -> None:
    """The estimate of the tokens to reach 1.5x / 1.2x the parent: on points that follow
    ``gap = 4 * (T / 32768)**-0.5`` exactly, alpha is 0.5 and the gap reaches 0.5 (1.5x) at
    32768 * 64 tokens; a curve that does not improve, or one point, gives no estimate."""
    from autocompress_nemo.report.quality_curve import gap_power_law

    parent = 10.0
    pts = [{"tokens": t, "heldout_ppl": parent * (1 + 4 * (t / 32768) ** -0.5)} for t in (32768, 131072, 524288)]
    e = gap_power_law(pts, parent)
    assert e is not None and abs(e["alpha"] - 0.5) < 1e-9 and e["points"] == 3
    assert abs(e["tokens_to_1.5x"] / (32768 * 64) - 1) < 1e-9
    assert abs(e["tokens_to_1.2x"] / (32768 * 400) - 1) < 1e-9
    assert "estimated, not measured" in e["source"]
    assert gap_power_law(pts[:1], parent) is None
    flat = [{"tokens": t, "heldout_ppl": 20.0 + t / 1e6} for t in (32768, 131072)]
    assert gap_power_law(flat, parent) is None


def test_a_family_budget_report_embeds_its_own_curve(tmp_path) -> None:
    """A family's ``report@<budget>/report.md`` reads ``bench_quality/default@<budget>`` (written by
    ``bench_quality.py --budget``) and links its plot from one directory down."""
    from autocompress_nemo.report.quality_curve import CURVE, curve_dir, quality_curve_section, read_curve
    from autocompress_nemo.utils.artifacts import write_json_atomic

    d = tmp_path / curve_dir("@0.6x")
    d.mkdir(parents=True)
    (d / "quality.png").write_bytes(b"png")
    write_json_atomic(
        d / CURVE.name,
        {
            "parent": {"heldout_ppl": 11.2},
            "labels": {},
            "before_recovery": {"autocompress": {"heldout_ppl": 30.0}},
            "curves": {"autocompress": []},
            "distill": {},
            "measured": "held-out perplexity in PyTorch",
            "plot": str(d / "quality.png"),
        },
    )
    assert read_curve(tmp_path) is None and read_curve(tmp_path, "@0.45x") is None
    text = "\n".join(quality_curve_section({"quality_curve": read_curve(tmp_path, "@0.6x", up=1)}))
    assert "](../bench_quality/default@0.6x/quality.png)" in text and "2.68x" in text


def test_starting_weights_section_says_what_the_refit_changed(tmp_path) -> None:
    """``extract_<method>/arch.json``'s ``refit`` record (``stages/extract.refit``) is shown per student:
    re-fit or plain slice, the mean relative output error and the KD to the parent before and after."""
    res = _results()
    blocks = [
        {"block": 1, "sliced_error": 0.4, "refit_error": 0.2},
        {"block": 3, "sliced_error": 0.2, "refit_error": 0.1},
    ]
    res["models"]["autocompress"]["refit"] = {
        "tokens": 8192,
        "sliced_kd": 2.38,
        "refit_kd": 1.70,
        "used": True,
        "blocks": blocks,
    }
    res["models"]["minitron_pp"]["refit"] = {
        "tokens": 8192,
        "sliced_kd": 1.0,
        "refit_kd": 1.2,
        "used": False,
        "blocks": blocks,
    }
    md = write_report(tmp_path, res)["report.md"].read_text()
    sec = md.split("## Starting weights", 1)[1].split("\n## ", 1)[0]
    assert "| least-squares re-fit | 2 | 8,192 | 0.3000 -> 0.1500 | 2.38 -> 1.7" in sec, sec
    assert "plain slice (the re-fit was no better)" in sec
    md = write_report(tmp_path / "none", _results())["report.md"].read_text()
    assert "Every student starts from the plain slice" in md.split("## Starting weights", 1)[1]

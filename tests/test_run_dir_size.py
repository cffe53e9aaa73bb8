"""Disk in proportion (issue 37): each stage keeps its weights once, in the precision it was trained
in; the other formats (Hugging Face, GGUF, the Megatron-LM checkpoint) are exports, written once by
the export stage; a resumable stage's optimizer checkpoints go when it completes. Before, extract
wrote the student three times (safetensors, HF, Megatron) and distill twice, and two optimizer
checkpoints stayed per student: 7.9 GB for the 135M default."""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.config.entry import compose
from tests.cfg_utils import TINY_ROOFLINE, statuses

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin", ".gguf", ".distcp")


def _weight_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def _bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def test_each_stage_keeps_its_weights_once_and_exports_hold_the_formats(tmp_path) -> None:
    from autocompress_nemo.search.__main__ import run_pipeline

    run = tmp_path / "run"
    cfg = compose(
        [
            *TINY_ROOFLINE,
            "search.steps=4",
            "distill.tokens=2048",
            "reconstruct.fraction=0.25",
            "stages=[profile,rank,search,extract,reconstruct,distill,export]",
            f"run_dir={run}",
        ]
    )
    res = run_pipeline(cfg)
    out = statuses(res)
    assert set(out.values()) == {"ran"}, out
    # the record says what each stage held and (the compute stages) what arithmetic it did:
    # bench/bench_pipeline.py sets those FLOPs against the machine's matmul rate
    rows = {r["stage"]: r for r in res["record"]}
    assert all(0.05 < r["peak_rss_gb"] < 64 for r in rows.values()), rows
    for stage in ("rank", "reconstruct_autocompress", "distill_autocompress"):
        assert rows[stage]["flops"] > 0, rows[stage]
    assert "flops" not in rows["export_autocompress"]
    for stage in ("rank", "extract_autocompress", "reconstruct_autocompress", "distill_autocompress"):
        files = _weight_files(run / stage)
        assert [p.name for p in files] == ["model.safetensors"], (stage, files)
    export = run / "export_autocompress"
    assert (export / "hf" / "config.json").is_file()
    assert (export / "megatron" / "latest_checkpointed_iteration.txt").read_text().strip() != "release"
    assert not list(run.glob("*.ckpt")), "a complete stage's optimizer checkpoints are removed"
    # the run directory against the models it holds (the sorted parent, each student as each stage left it)
    models = _bytes([run / s / "model.safetensors" for s in ("rank", "extract_autocompress", "distill_autocompress")])
    # (the token cache, ``<run_dir>/.cache``, is the tokenized corpus: data, its size the corpus's, not the models')
    total = _bytes([p for p in run.rglob("*") if p.is_file() and ".cache" not in p.relative_to(run).parts])
    assert total <= 3 * models, f"run directory {total:,} bytes for {models:,} bytes of models"

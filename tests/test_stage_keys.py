"""Stages declare what they read (``autocompress_nemo/stages/``): the cache key is derived from
the declaration, and a stage that reads an undeclared key fails instead of reusing an artifact
made with another value. Changing ``cluster.ep``, ``seed`` or ``data`` reruns exactly the stages
that read it (issue 12)."""

from __future__ import annotations

import pytest
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from autocompress_nemo.config.entry import compose
from autocompress_nemo.pipeline import Run
from autocompress_nemo.stages import all_stages
from tests.cfg_utils import TINY_ROOFLINE, statuses

TINY = [
    *TINY_ROOFLINE,
    "search.steps=4",
    "stages=[profile,rank,search,extract]",
]
CACHED = {"profile", "validate", "rank", "search", "extract", "reconstruct", "distill", "export", "evaluate"}
# which stages read what, written out by hand (the declarations must agree)
READERS = {
    "cluster.ep=2": {
        "profile",
        "validate",
        "rank",
        "search",
        "extract",
        "reconstruct",
        "distill",
        "export",
        "evaluate",
    },
    "seed=7": {"validate", "rank", "search", "extract", "reconstruct", "distill", "export", "evaluate"},
    "data.seed=7": {"rank", "search", "extract", "reconstruct", "distill", "export", "evaluate"},
    "distill.tokens=4096": {"reconstruct", "distill"},  # the recovery budget: local + global
    "distill.lr=0.001": {"distill"},
    "reconstruct.fraction=0.25": {"reconstruct", "distill"},
    "reconstruct.loss=cosine": {"reconstruct"},
    "evaluate.heldout_batches=3": {"evaluate"},
    "search.ffn_options=3": {"profile", "validate", "search"},
}


def _keys(tmp_path, extra=()) -> dict[str, str]:
    run = Run(compose([*TINY, f"run_dir={tmp_path}/run", *extra]), say=lambda s: None)
    return {s.name: run.config_hash(s.reads, [], s.name) for s in all_stages() if s.name in CACHED}


@pytest.mark.parametrize("override", sorted(READERS))
def test_a_change_reruns_exactly_the_stages_that_read_it(tmp_path, override) -> None:
    base, changed = _keys(tmp_path), _keys(tmp_path, [override])
    assert {s for s in base if base[s] != changed[s]} == READERS[override]


def test_cluster_settings_no_stage_reads_do_not_rerun(tmp_path) -> None:
    """Where the job runs (Slurm partition, container) changes no stage's result."""
    base = _keys(tmp_path)
    assert base == _keys(tmp_path, ["cluster.partition=batch", "cluster.container_image=nvcr.io/x:1"])


def test_a_stage_cannot_read_what_it_did_not_declare(tmp_path) -> None:
    from autocompress_nemo.context import Context

    cfg = compose([*TINY, f"run_dir={tmp_path}/run"])
    view = Context(cfg).for_stage(("search.seq_len", "seed"))
    assert int(view.cfg.search.seq_len) == int(cfg.search.seq_len) and int(view.cfg.seed) == int(cfg.seed)
    with pytest.raises((ConfigAttributeError, ConfigKeyError)):
        _ = view.cfg.search.steps
    with pytest.raises((ConfigAttributeError, ConfigKeyError)):
        _ = view.cfg.cluster.ep
    with pytest.raises(KeyError, match="declare it"):
        _ = view.parent  # the parent reads model: undeclared
    with pytest.raises(ConfigKeyError, match="not_a_key"):
        Context(cfg).for_stage(("search.not_a_key",))


def test_the_pipeline_reruns_what_reads_a_changed_key(tmp_path, capsys) -> None:
    """The tiny pipeline, then ``data.seed`` changed: profile is reused, rank and what follows rerun;
    then ``seed`` changed as well."""
    from autocompress_nemo.search.__main__ import run_pipeline

    def run(*extra: str) -> dict[str, str]:
        return statuses(run_pipeline(compose([*TINY, f"run_dir={tmp_path}/run", *extra])))

    run()
    out = run("data.seed=7")
    assert out == {
        "profile": "skipped",
        **dict.fromkeys(("rank", "search_autocompress", "extract_autocompress"), "ran"),
    }
    out = run("data.seed=7")
    assert set(out.values()) == {"skipped"}


def test_a_stage_not_asked_for_is_reused_when_complete(tmp_path, capsys) -> None:
    """Validate ran in an earlier invocation (a Slurm chain runs one stage per job): a later
    ``stages=[rank,search]`` reads it, so its search is the full run's (skipped, not recomputed)."""
    from autocompress_nemo.search.__main__ import run_pipeline

    def run(stages: str) -> dict[str, str]:
        return statuses(run_pipeline(compose([*TINY, f"run_dir={tmp_path}/run", f"stages={stages}"])))

    run("[profile,validate,rank,search]")
    out = run("[rank,search]")
    assert out["validate"] == "reused" and out["search_autocompress"] == "skipped", out

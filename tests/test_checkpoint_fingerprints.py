"""Checkpoints and cache keys cover everything they depend on (issue 19).

A stage's checkpoint directory (``<run_dir>/<stage>.ckpt``) carries the stage's cache key; a
checkpoint made from other inputs — another search setting, other data, another architecture — is
set aside and never resumed; a truncated checkpoint is reported by path and set aside; the cache
keys of stages that read ``data`` cover what the corpus files hold, not only their paths.

The tiny pipeline runs once (a module fixture); each test works on a copy of that run directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

from autocompress_nemo.config.entry import compose
from autocompress_nemo.pipeline import FINGERPRINT, Run
from autocompress_nemo.stages import all_stages
from autocompress_nemo.utils.artifacts import sha256_file
from tests.cfg_utils import TINY_ROOFLINE, recorded, statuses, why

TINY = [
    *TINY_ROOFLINE,
    "search.steps=4",
    "search.checkpoint_every=2",
    "distill.tokens=1024",  # 4 steps of 2 x 128 tokens
    "distill.checkpoint_every=2",
    "stages=[profile,rank,search,extract,distill]",
    "keep_checkpoints=true",  # what these tests inspect; by default a complete stage's checkpoints are removed
]
SEARCH, EXTRACT, DISTILL = "search_autocompress", "extract_autocompress", "distill_autocompress"


def _pipeline(run_dir: Path, capsys, *extra: str) -> str:
    from autocompress_nemo.search.__main__ import run_pipeline

    run_pipeline(compose([*TINY, f"run_dir={run_dir}", *extra]))
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("base") / "run"
    from autocompress_nemo.search.__main__ import run_pipeline

    run_pipeline(compose([*TINY, f"run_dir={run_dir}"]))
    return run_dir


@pytest.fixture
def run_dir(base_run, tmp_path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(base_run, dest)
    return dest


def _fingerprint(run_dir: Path, stage: str) -> str:
    import json

    return json.loads((run_dir / f"{stage}.ckpt" / FINGERPRINT).read_text())["fingerprint"]


@pytest.mark.slow
def test_checkpoints_carry_their_stage_fingerprint_and_resume_when_it_holds(run_dir, capsys) -> None:
    """The positive control: a stage killed after its last checkpoint resumes from it."""
    for stage in (SEARCH, DISTILL):
        m = __import__("json").loads((run_dir / stage / "manifest.json").read_text())
        assert _fingerprint(run_dir, stage) == m["config_hash"]
    assert (run_dir / f"{SEARCH}.ckpt" / "checkpoints" / "latest.json").is_file()
    shutil.rmtree(run_dir / DISTILL)  # killed after its last checkpoint, before the artifact
    out = _pipeline(run_dir, capsys)
    assert "distill: resumed from step 4/4" in out, out
    shutil.rmtree(run_dir / SEARCH)
    out = _pipeline(run_dir, capsys, "stages=[profile,rank,search]")
    assert "search: resumed from step 4/4" in out, out
    assert "set aside" not in out


@pytest.mark.slow
def test_a_search_setting_change_never_resumes_the_old_router(run_dir, capsys) -> None:
    old_traj = (run_dir / SEARCH / "trajectory.json").read_text()
    old_fp = _fingerprint(run_dir, SEARCH)
    out = _pipeline(run_dir, capsys, "search.router_lr=0.05")
    assert statuses(recorded(run_dir))[SEARCH] == "ran" and "config changed" in why(recorded(run_dir), SEARCH)
    assert f"[{SEARCH}.ckpt] checkpoint made from other inputs (fingerprint {old_fp}" in out, out
    assert "search: resumed" not in out
    assert (run_dir / f"{SEARCH}.ckpt.stale" / "checkpoints" / "latest.json").is_file()  # kept for inspection
    assert _fingerprint(run_dir, SEARCH) != old_fp
    assert (run_dir / SEARCH / "trajectory.json").read_text() != old_traj  # the new setting took effect


@pytest.mark.slow
def test_an_architecture_change_sets_the_distill_checkpoint_aside(run_dir, capsys) -> None:
    """A tighter budget gives another student: distill starts over (no size-mismatch crash, no resume)."""
    old_spec = (run_dir / EXTRACT / "spec.json").read_text()
    out = _pipeline(run_dir, capsys, "target.budget.constraints.0.value=0.4x")
    assert (run_dir / EXTRACT / "spec.json").read_text() != old_spec, "precondition: the architecture changed"
    assert f"[{DISTILL}.ckpt] checkpoint made from other inputs" in out, out
    assert "distill: resumed" not in out
    assert statuses(recorded(run_dir))[DISTILL] == "ran"


@pytest.mark.slow
def test_a_data_seed_change_retrains_the_student(run_dir, capsys) -> None:
    """``data.seed=99``: rank, search, extract and distill recompute; distill does not resume the old
    checkpoint and its weights differ from the old run's."""
    old = sha256_file(run_dir / DISTILL / "model.safetensors")
    out = _pipeline(run_dir, capsys, "data.seed=99")
    st = statuses(recorded(run_dir))
    assert st["profile"] == "skipped"
    for stage in ("rank", SEARCH, EXTRACT, DISTILL):
        assert st[stage] == "ran" and "config changed" in why(recorded(run_dir), stage), st
    assert "resumed" not in out
    assert sha256_file(run_dir / DISTILL / "model.safetensors") != old


@pytest.mark.slow
def test_a_truncated_router_checkpoint_is_reported_and_set_aside(run_dir, capsys) -> None:
    root = run_dir / f"{SEARCH}.ckpt" / "checkpoints"
    (shard,) = (root / "step_000004").glob("*.pt")  # the trainer's torch.save shard of the router
    shard.write_bytes(shard.read_bytes()[:200])
    shutil.rmtree(run_dir / SEARCH)  # killed after the checkpoint, before the artifact
    out = _pipeline(run_dir, capsys)
    assert f"search: checkpoint {shard} cannot be read" in out, out
    assert f"set aside as {root}.corrupt; starting from step 0" in out
    assert "search: resumed" not in out
    assert (run_dir / SEARCH / "manifest.json").is_file()


@pytest.mark.slow
def test_a_truncated_distill_checkpoint_is_reported_and_set_aside(run_dir, capsys) -> None:
    root = run_dir / f"{DISTILL}.ckpt" / "checkpoints"
    (shard,) = (root / "iter_0000004").glob("*.distcp")  # the Megatron-LM distributed checkpoint's data
    shard.write_bytes(shard.read_bytes()[:300])
    shutil.rmtree(run_dir / DISTILL)
    out = _pipeline(run_dir, capsys)
    assert f"distill: checkpoint {root / 'iter_0000004'} cannot be read" in out, out
    assert f"set aside as {root}.corrupt; starting from step 0" in out
    assert "distill: resumed" not in out
    assert (run_dir / DISTILL / "manifest.json").is_file()
    assert (root / "latest.json").is_file()  # a fresh checkpoint of the new run


# -- data content in the cache keys -------------------------------------------------------------------
def _corpus(root: Path, n: int = 24) -> Path:
    """A small text corpus: the first ``n`` stdlib modules between 4 and 40 KB."""
    src = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True)
    picked = [p for p in sorted(src.glob("*.py")) if 4_000 < p.stat().st_size < 40_000][:n]
    for p in picked:
        shutil.copy(p, root / p.name)
    return root


def _data(corpus: Path) -> list[str]:
    """The corpus as the run's data, two of its files held out."""
    held = ",".join(p.name for p in sorted(corpus.iterdir())[-2:])
    return ["data.kind=files", f"data.paths=[{corpus}]", f"data.heldout_files=[{held}]"]


def _keys(run_dir: Path, corpus: Path) -> dict[str, str]:
    cfg = compose([*TINY, f"run_dir={run_dir}", *_data(corpus)])
    run = Run(cfg, say=lambda s: None)
    return {s.name: run.config_hash(s.reads, [], s.name) for s in all_stages()}


def test_the_data_content_is_in_the_keys_of_exactly_the_stages_that_read_data(tmp_path) -> None:
    from tests.test_stage_keys import READERS

    corpus = _corpus(tmp_path / "corpus")
    base = _keys(tmp_path / "run", corpus)
    first = sorted(corpus.iterdir())[0]
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched, same content
    assert _keys(tmp_path / "run", corpus) == base
    first.write_text(first.read_text() + "\n# one more line\n")  # rewritten
    changed = _keys(tmp_path / "run", corpus)
    assert {s for s in base if base[s] != changed[s]} == READERS["data.seed=7"]
    cache = tmp_path / "run" / ".cache" / "data_hashes.json"
    assert cache.is_file() and str(first.resolve()) in cache.read_text()


@pytest.mark.slow
def test_rewritten_data_files_rerun_the_stages_that_read_them(tmp_path, capsys) -> None:
    corpus = _corpus(tmp_path / "corpus")
    data = [*_data(corpus), "stages=[profile,rank]"]
    _pipeline(tmp_path / "run", capsys, *data)
    _pipeline(tmp_path / "run", capsys, *data)
    assert statuses(recorded(tmp_path / "run"))["rank"] == "skipped"
    for f in sorted(corpus.iterdir())[:3]:
        f.write_text(f.read_text().replace("def ", "def  "))
    _pipeline(tmp_path / "run", capsys, *data)
    st = statuses(recorded(tmp_path / "run"))
    assert st["profile"] == "skipped" and st["rank"] == "ran", st
    assert "config changed" in why(recorded(tmp_path / "run"), "rank")


# -- a corrupt shard under tensor parallelism: every rank starts over, none hangs ---------------------------
def _tp2_distill(rank: int, world: int, out_dir: str) -> dict:
    from conftest import tiny_hetero_spec, tiny_uniform_spec
    from test_distill import _cfg, batch_fn

    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits

    init_distributed(tp=2, seed=0)
    teacher = build_model(tiny_uniform_spec(), init_seed=0, impl="local")
    student = build_model(tiny_hetero_spec(), init_seed=1, impl="local")
    said: list[str] = []
    res = distill(student, teacher, forward_logits, batch_fn(128, 4, 16), _cfg(4), out_dir, 7, log=said.append)
    return {"start": res["resumed_from_step"], "said": said}


@pytest.mark.distributed
def test_a_corrupt_shard_on_one_rank_restarts_every_rank(tmp_path) -> None:
    from autocompress_nemo.distributed.spawn import spawn

    out = tmp_path / "distill"
    first = spawn(_tp2_distill, 2, str(out))
    assert [o["start"] for o in first] == [0, 0]
    ckpt = out / "checkpoints" / "iter_0000004"  # a Megatron-LM distributed checkpoint
    shard = ckpt / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # rank 1's file only
    again = spawn(_tp2_distill, 2, str(out))
    assert [o["start"] for o in again] == [0, 0]  # both start over (a resume on one rank would diverge)
    said = "\n".join(again[1]["said"])
    assert f"distill: checkpoint {ckpt} cannot be read" in said, said
    assert f"set aside as {out / 'checkpoints'}.corrupt" in said
    assert (out / "checkpoints.corrupt" / "iter_0000004" / "__1_0.distcp").is_file()


@pytest.mark.slow
def test_minitron_candidates_resume_only_for_their_fingerprint(tmp_path, capsys) -> None:
    """Minitron++ keeps the candidates it scored (``candidates.json`` in the fingerprinted checkpoint
    directory): a killed search resumes after them; a damaged file is set aside; other settings start over."""
    run_dir = tmp_path / "run"
    mini = ["search.method=minitron_pp", "search.minitron_retrain_steps=0", "stages=[profile,rank,search]"]
    first = _pipeline(run_dir, capsys, *mini)
    assert "minitron++ candidate 2/2" in first and "resumed" not in first
    ckpt = run_dir / "search_minitron_pp.ckpt" / "candidates.json"
    arch = json.loads((run_dir / "search_minitron_pp" / "arch.json").read_text())
    shutil.rmtree(run_dir / "search_minitron_pp")  # killed after scoring, before the artifact
    out = _pipeline(run_dir, capsys, *mini)
    assert f"minitron++: resumed with 2/2 candidates scored ({ckpt})" in out, out
    assert "minitron++ candidate 1/2" not in out
    assert json.loads((run_dir / "search_minitron_pp" / "arch.json").read_text())["child"] == arch["child"]
    shutil.rmtree(run_dir / "search_minitron_pp")
    ckpt.write_text(ckpt.read_text()[:40])
    out = _pipeline(run_dir, capsys, *mini)
    assert f"minitron++: checkpoint {ckpt} cannot be used (JSONDecodeError" in out and "candidate 1/2" in out, out
    out = _pipeline(run_dir, capsys, *mini, "search.minitron_score_batches=1")
    assert "[search_minitron_pp.ckpt] checkpoint made from other inputs" in out and "resumed" not in out, out

"""The pretrained hybrid parent (``model=stdlib_hybrid``, ``autocompress_nemo/pretrain``): language
modelling in the project's own training loop, the held-out stop rule, resume after a kill, the parent
cache and the message when the parent is not built. Tiny dimensions (hidden 32, ``M*E``), 40 stdlib
modules, SmolLM2's tokenizer: seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.validate import collect_problems, validate
from autocompress_nemo.pretrain.cache import is_complete, missing_message, parent_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=stdlib_hybrid",
    "model.hidden=32",
    "model.pattern=M*E",
    "model.heads=2",
    "model.kv_groups=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.expert_ffn=32",
    "model.shared_ffn=32",
    "model.top_k=2",
    "model.mamba_heads=4",
    "model.mamba_head_dim=16",
    "model.mamba_state=16",
    "model.mamba_groups=2",
    "data.max_documents=40",
    "model.source.pretrain.tokens=4096",  # cap: 16 steps of 4 x 64
    "model.source.pretrain.batch_size=4",
    "model.source.pretrain.seq_len=64",
    "model.source.pretrain.lr=2e-2",
    "model.source.pretrain.min_lr=2e-3",
    "model.source.pretrain.warmup_steps=2",
    "model.source.pretrain.eval_every_tokens=1024",  # every 4 steps
    "model.source.pretrain.eval_sequences=8",
    "model.source.pretrain.checkpoint_every=2",
]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty parent cache (the token cache too) for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("AUTOCOMPRESS_NEMO_CACHE", str(root))
    return root


def _tiny(path: Path, *extra: str):
    cfg = compose([*TINY, f"model.source.path={path}", *extra])
    validate(cfg, building_parent=True)
    return cfg


def _pretrain(cfg):
    from autocompress_nemo.pretrain.run import pretrain

    lines: list[str] = []
    return pretrain(cfg, say=lines.append), lines


def test_stop_rule() -> None:
    from autocompress_nemo.pretrain.run import plateau

    rule = plateau(0.03)
    assert rule([{"ppl": 100.0, "tokens": 0}]) is None  # one evaluation: nothing to compare
    assert rule([{"ppl": 100.0, "tokens": 0}, {"ppl": 96.0, "tokens": 10}]) is None  # 4 % drop: go on
    why = rule([{"ppl": 100.0, "tokens": 0}, {"ppl": 96.0, "tokens": 10}, {"ppl": 94.0, "tokens": 20}])
    assert why is not None and "2.08%" in why and "< 3%" in why  # 96 -> 94: 2.1 % < 3 %
    assert rule([{"ppl": 100.0, "tokens": 0}, {"ppl": 101.0, "tokens": 10}]) is not None  # rising: stop
    assert plateau(0.0)([{"ppl": 1.0, "tokens": 0}, {"ppl": 5.0, "tokens": 1}]) is None  # 0: run to the cap


def test_pretrain_learns_stops_and_resumes_to_the_same_parent(cache, tmp_path, monkeypatch) -> None:
    """Loss and held-out perplexity fall; a stop threshold no interval can meet (99 %) ends the run at
    the second evaluation (step 8 of a 16-step cap); a run killed after its step-4 checkpoint and
    started again reaches the uninterrupted run's weights and perplexities; the written directory is
    a parent any command loads (``model.source.path``)."""
    from safetensors.torch import load_file

    import autocompress_nemo.distill.recover as recover

    stop = "model.source.pretrain.stop_rel_drop=0.99"
    whole, lines = _pretrain(_tiny(tmp_path / "whole", stop))
    assert whole["steps_cap"] == 16 and whole["steps"] == 8 and whole["tokens"] == 8 * 4 * 64
    assert "a drop of" in whole["stopped"] and "< 99%" in whole["stopped"]
    ppl = [p["ppl"] for p in whole["curve"]]
    assert [p["tokens"] for p in whole["curve"]] == [0, 1024, 2048]
    assert ppl[0] > 10000 and ppl[1] < 0.8 * ppl[0] and ppl[2] < 0.8 * ppl[1], ppl  # random init: ~ vocab size
    assert whole["final_train_loss"] < 0.8 * whole["first_train_loss"], whole["train_history"]
    assert whole["reloaded_ppl"] == pytest.approx(whole["final_ppl"], rel=1e-4)
    assert any("stopping after step 8/16" in s for s in lines), lines
    out = Path(whole["path"])
    assert is_complete(out) and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_h"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True

    # killed after the checkpoint of step 4 (in step 6), then started again
    calls = {"n": 0}
    real = recover.lm_loss

    def dies_in_step_6(logits, ids):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt("killed")
        return real(logits, ids)

    monkeypatch.setattr(recover, "lm_loss", dies_in_step_6)
    with pytest.raises(KeyboardInterrupt):
        _pretrain(_tiny(tmp_path / "killed", stop))
    assert not (tmp_path / "killed").exists()  # nothing half-written where the parent goes
    monkeypatch.setattr(recover, "lm_loss", real)
    again, lines = _pretrain(_tiny(tmp_path / "killed", stop))
    assert again["resumed_from_step"] == 4 and any("resumed from step 4/16" in s for s in lines), lines
    assert again["steps"] == 8 and again["stopped"] == whole["stopped"]
    assert [p["ppl"] for p in again["curve"]] == pytest.approx([p["ppl"] for p in whole["curve"]], rel=1e-6)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(Path(again["path"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)

    # built: a second call does nothing; any command loads it
    same, lines = _pretrain(_tiny(tmp_path / "whole", stop))
    assert same["final_ppl"] == whole["final_ppl"] and "already built" in lines[0]
    cfg = compose([*TINY, f"model.source.path={out}", "engine@target.engine=roofline"])  # serves hybrids
    validate(cfg)
    from autocompress_nemo.models.parent import load_parent

    spec, sd, tok = load_parent(cfg.model)
    assert spec.pattern == "M*E" and spec.tied_embeddings and tok is not None and len(tok) == 49152
    assert sum(v.numel() for k, v in sd.items() if "e_score_correction_bias" not in k) == whole["parameters"]


def test_missing_parent_names_the_command(cache) -> None:
    """Not built: one problem naming the cache directory, the one command that builds it and how long
    it takes; the command-line program says it in one message, exit status 2, no traceback."""
    cfg = compose(["model=stdlib_hybrid"])
    problems = collect_problems(cfg)
    want = "`python -m autocompress_nemo.pretrain model=stdlib_hybrid`"
    assert [p for p in problems if want in p] == [missing_message(cfg.model)], problems
    where = parent_dir(cfg.model)
    assert where.parent == cache / "parents" and where.name.startswith("stdlib_hybrid-")
    minutes = f"about {cfg.model.source.pretrain.minutes} minutes"  # the recipe's estimate
    assert minutes in missing_message(cfg.model) and str(where) in missing_message(cfg.model)
    assert not collect_problems(cfg, building_parent=True)  # the command that builds it is not refused
    assert not [p for p in collect_problems(compose(["model=stdlib_hybrid", "dry_run=true"])) if want in p]
    # another shape is another parent
    assert parent_dir(compose(["model=stdlib_hybrid", "model.hidden=128"]).model) != where
    r = subprocess.run(
        [sys.executable, "-m", "autocompress_nemo.config", "model=stdlib_hybrid"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "AUTOCOMPRESS_NEMO_CACHE": str(cache), "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert want in r.stderr and minutes in r.stderr and "Traceback" not in r.stderr, r.stderr

"""The KD judge can price a child as extract will start it (``search.judge_refit``): with the
re-fit correction on, the supernet child's KD equals the KD of the extracted student whose narrowed
output projections are re-fit by least squares on extract's calibration batches, one child per
forward and several per forward alike; a child kept whole is judged as before."""

from __future__ import annotations

import pytest
import torch

from autocompress_nemo.distill.kd import kd_loss
from autocompress_nemo.extract.compensate import collect_grams, refit_blocks, refit_state_dict
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.search.judge import KdJudge, RefitCorrection
from autocompress_nemo.search.space import apply_choices, build_space, uniform_candidates
from tests.method_utils import CAPS, megatron_from_hf, tiny_parent


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)
    yield


def _batches(vocab: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def test_the_refit_judge_scores_the_refit_student() -> None:
    spec, sd = tiny_parent()
    decisions = build_space(spec, CAPS, ffn_options=4)
    judge_b, calib = _batches(spec.vocab, 2, 5), _batches(spec.vocab, 3, 71)
    ridge = 0.03

    def make(refit: bool) -> KdJudge:
        fn = (lambda m: RefitCorrection(m, spec, decisions, calib, forward_logits, ridge)) if refit else None
        return KdJudge(megatron_from_hf(spec, sd), spec, decisions, judge_b, forward_logits, refit=fn)

    plain, fitted, grouped = make(False), make(True), make(True)
    children = [
        c for c in uniform_candidates(spec, decisions) if refit_blocks(spec, apply_choices(spec, decisions, c))
    ][:4]
    assert len(children) >= 3
    parent_m = megatron_from_hf(spec, sd)
    for ch in children:
        child = apply_choices(spec, decisions, ch)
        blocks = refit_blocks(spec, child)
        grams, _ = collect_grams(parent_m, spec, blocks, calib, forward_logits)
        csd, _ = refit_state_dict(spec, sd, child, slice_state_dict(spec, sd, child), grams, ridge)
        student = megatron_from_hf(child, csd)
        with torch.no_grad():
            ref = sum(float(kd_loss(forward_logits(student, x), forward_logits(parent_m, x), 1.0)) for x in judge_b) / 2
        got = fitted.loss(ch)
        assert got == pytest.approx(ref, rel=2e-4, abs=1e-6), (ch, got, ref)
        assert got < plain.loss(ch)  # the re-fit repairs part of what the narrowing lost
    grouped.max_group = 3
    many = grouped.losses(children)
    torch.testing.assert_close(
        torch.tensor(many), torch.tensor([fitted.loss(c) for c in children]), rtol=1e-4, atol=1e-6
    )
    whole = [d.parent_option for d in decisions]
    assert fitted.loss(whole) == pytest.approx(plain.loss(whole), abs=1e-6)
    for j in (plain, fitted, grouped):
        j.close()


def test_a_pipeline_with_the_refit_judge_extracts_the_child_it_judged(tmp_path, capsys) -> None:
    """``search.judge_refit=true`` through search and extract on the tiny roofline job: arch.json says
    the judge re-fit, the guard's final KD is the re-fit student's KD that extract measures (extract
    refuses to train otherwise), and ``extract.*`` is part of the search's cache key."""
    import json

    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.__main__ import run_pipeline
    from tests.cfg_utils import TINY_ROOFLINE, statuses, why

    args = [*TINY_ROOFLINE, "search.steps=4", "stages=[profile,rank,search,extract]", f"run_dir={tmp_path}/run"]
    out = run_pipeline(compose([*args, "search.judge_refit=true"]))
    assert statuses(out)["extract_autocompress"] == "ran"
    rec = json.loads((tmp_path / "run" / "extract_autocompress" / "arch.json").read_text())
    assert rec["judge"]["refit"] is True and rec["quality_guard"]["judge_refit"] is True
    assert rec["refit"]["blocks"], rec["refit"]  # the tiny child narrows blocks: there is a re-fit to check
    assert rec["refit"]["refit_kd"] == pytest.approx(rec["quality_guard"]["final_kd"], rel=0.02, abs=1e-3)
    assert "KD of the re-fit student" in capsys.readouterr().out
    again = run_pipeline(compose([*args, "search.judge_refit=true", "extract.ridge=0.1"]))
    assert statuses(again)["search_autocompress"] == "ran" and "config changed" in why(again, "search_autocompress")

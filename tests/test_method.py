"""The method on tiny Megatron models: reordering invariance, masked supernet == extracted
child, router moving to the budget, extraction meeting it, repair."""

from __future__ import annotations

import json

import pytest
import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.extract.repair import option_importance, repair
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.rank.importance import collect_importance
from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores, sorted_importance
from autocompress_nemo.search.autocompress import check_budget_reachable, run_router_search
from autocompress_nemo.search.judge import KdJudge, ProxyJudge
from autocompress_nemo.search.space import apply_choices, build_space
from autocompress_nemo.search.supernet import Supernet
from tests.cfg_utils import ROUTER, search_cfg
from tests.method_utils import CAPS, ParamCost, megatron_from_hf, tiny_parent


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)  # idempotent; the same seed for every test
    yield


def _batches(vocab: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def _ranked():
    spec, sd = tiny_parent()
    model = megatron_from_hf(spec, sd)
    imp = collect_importance(model, spec, _batches(spec.vocab, 2), forward_logits)
    perms = permutations_from_scores(spec, imp)
    sorted_sd = apply_permutations(spec, sd, perms)
    return spec, sd, model, imp, perms, sorted_sd


def test_importance_shapes_and_reorder_invariance() -> None:
    spec, sd, model, imp, perms, sorted_sd = _ranked()
    assert imp.hidden.shape == (spec.hidden,)
    assert [sorted(b) for b in imp.blocks] == [["heads"], ["ffn"]] * spec.num_layers
    assert all(b["heads"].shape == (4,) for b in imp.blocks[0::2]) and all(
        b["ffn"].shape == (64,) for b in imp.blocks[1::2]
    )
    assert all(float(v.min()) > 0 for b in imp.blocks for v in b.values())
    x = _batches(spec.vocab, 1, seed=5)[0]
    with torch.no_grad():
        ref = forward_logits(model, x)
        sorted_model = megatron_from_hf(spec, sorted_sd)
        out = forward_logits(sorted_model, x)
    assert torch.allclose(ref, out, atol=1e-5), (ref - out).abs().max()
    s_imp = sorted_importance(spec, imp, perms)
    for s in s_imp.blocks[1::2]:  # sorted descending (ffn strictly by score; heads grouped)
        assert torch.all(s["ffn"][:-1] >= s["ffn"][1:])


def test_masked_supernet_equals_extracted_child() -> None:
    spec, _, _, _, _, sorted_sd = _ranked()
    decisions = build_space(spec, CAPS, ffn_options=4)
    model = megatron_from_hf(spec, sorted_sd)
    sn = Supernet(model, spec, decisions)
    x = _batches(spec.vocab, 1, seed=7)[0]
    g = torch.Generator().manual_seed(0)
    removed = []  # per trial: did the compared child have a removed block?
    for trial in range(3):
        choices = [int(torch.randint(0, len(d.options), (1,), generator=g)) for d in decisions]
        if trial == 0:  # make sure a removed attention block is covered
            choices[[d.kind for d in decisions].index("attention", 1)] = 0
        child = apply_choices(spec, decisions, choices)
        sn.set_choices(choices)
        with torch.no_grad():
            masked = forward_logits(model, x)
            child_model = megatron_from_hf(child, slice_state_dict(spec, sorted_sd, child))
            direct = forward_logits(child_model, x)
        assert torch.allclose(masked, direct, atol=1e-5), (trial, child.pattern, (masked - direct).abs().max())
        removed.append([b.kind for b in child.blocks if b.removed])
    # the masked supernet equalled the sliced child with an attention block removed (trial 0 forces one)
    assert "attention" in removed[0], removed
    sn.remove()


CFG = {**ROUTER, "steps": 60, "checkpoint_every": 0}


def test_router_moves_to_budget_and_extraction_meets_it() -> None:
    spec, _, _, imp, perms, sorted_sd = _ranked()
    decisions = build_space(spec, CAPS, ffn_options=4)
    model = megatron_from_hf(spec, sorted_sd)
    cost = ParamCost()
    budget = {"params": 0.75 * param_count(spec)}
    assert check_budget_reachable(spec, decisions, cost, budget) is None
    batches = _batches(spec.vocab, 8, seed=11)
    out = run_router_search(
        model,
        spec,
        decisions,
        cost,
        budget,
        lambda s: batches[s % len(batches)],
        forward_logits,
        search_cfg(**CFG),
        seed=0,
        log=lambda s: None,
        router_init="parent",
    )
    first, last = out.trajectory[0]["expected_params"], out.trajectory[-1]["expected_params"]
    assert first > 1.1 * budget["params"]  # started far above the budget
    assert abs(last / budget["params"] - 1) <= CFG["slack"] + 0.02, (first, last, budget)
    # extraction: snap + repair meets the budget by the exact predictor
    judge = KdJudge(model, spec, decisions, batches[:2], forward_logits)
    fixed, _ = repair(spec, decisions, out.choices, cost.predict, budget, judge)
    judge.close()
    assert cost.predict(apply_choices(spec, decisions, fixed))["params"] <= budget["params"]


@pytest.mark.parametrize("kind", ["kd", "importance"])
def test_repair_fixes_over_budget_snap(kind: str) -> None:
    spec, _, _, imp, perms, sorted_sd = _ranked()
    decisions = build_space(spec, CAPS, ffn_options=4)
    cost = ParamCost()
    budget = {"params": 0.7 * param_count(spec)}
    parent_choices = [d.parent_option for d in decisions]
    if kind == "kd":
        judge = KdJudge(
            megatron_from_hf(spec, sorted_sd), spec, decisions, _batches(spec.vocab, 2, seed=5), forward_logits
        )
    else:
        judge = ProxyJudge(option_importance(decisions, sorted_importance(spec, imp, perms)))
    fixed, steps = repair(spec, decisions, parent_choices, cost.predict, budget, judge)
    assert steps > 0
    assert cost.predict(apply_choices(spec, decisions, fixed))["params"] <= budget["params"]
    # lazy greedy: every move measured once, then a few re-measurements per step, not one per decision
    assert judge.calls <= 1 + len(decisions) + 5 * steps


def test_infeasible_budget_and_parent_meets() -> None:
    spec, *_ = _ranked()
    decisions = build_space(spec, CAPS, ffn_options=4)
    with pytest.raises(ValueError, match="smallest architecture in the search space costs params="):
        check_budget_reachable(spec, decisions, ParamCost(), {"params": 1000.0})
    assert check_budget_reachable(spec, decisions, ParamCost(), {"params": 2.0 * param_count(spec)}) == "parent"


def test_rerun_from_saved_scores_reproduces_sorted_parent(tmp_path) -> None:
    import json

    from autocompress_nemo.rank.importance import Importance
    from autocompress_nemo.rank.reorder import Permutations

    spec, sd, _, imp, perms, sorted_sd = _ranked()
    (tmp_path / "scores.json").write_text(json.dumps(imp.to_dict()))
    (tmp_path / "perms.json").write_text(json.dumps(perms.to_dict()))
    imp2 = Importance.from_dict(json.loads((tmp_path / "scores.json").read_text()))
    again = apply_permutations(spec, sd, permutations_from_scores(spec, imp2))
    from_perms = apply_permutations(spec, sd, Permutations.from_dict(json.loads((tmp_path / "perms.json").read_text())))
    for k, v in sorted_sd.items():
        assert torch.equal(again[k], v) and torch.equal(from_perms[k], v), k


def test_search_killed_midway_resumes_to_the_same_result(tmp_path) -> None:
    spec, _, _, _, _, sorted_sd = _ranked()
    decisions = build_space(spec, CAPS, ffn_options=4)
    budget = {"params": 0.75 * param_count(spec)}
    batches = _batches(spec.vocab, 8, seed=11)

    def run(ckpt, fail_at=None):
        def batch_at(s):
            if fail_at is not None and s == fail_at:
                raise KeyboardInterrupt("killed")
            return batches[s % len(batches)]

        model = megatron_from_hf(spec, sorted_sd)
        return run_router_search(
            model,
            spec,
            decisions,
            ParamCost(),
            budget,
            batch_at,
            forward_logits,
            search_cfg(**{**CFG, "steps": 12, "checkpoint_every": 4}),
            seed=0,
            checkpoint=ckpt,
            log=lambda s: None,
            router_init="parent",
        )

    ref = run(None)
    ckpt = str(tmp_path / "search")
    with pytest.raises(KeyboardInterrupt):
        run(ckpt, fail_at=9)
    assert json.loads((tmp_path / "search" / "checkpoints" / "latest.json").read_text())["step"] == 8
    resumed = run(ckpt)
    assert resumed.choices == ref.choices
    assert [r["kd"] for r in resumed.trajectory] == pytest.approx([r["kd"] for r in ref.trajectory], abs=1e-6)
    assert sum(resumed.probs, []) == pytest.approx(sum(ref.probs, []), abs=1e-6)

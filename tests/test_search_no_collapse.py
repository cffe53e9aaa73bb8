"""The search cannot wreck the student whatever the engine check measures (issue 11).

The real SmolLM2-135M, sorted by activation importance, the default (``cpu_chat``) search space,
a short router search toward a decode budget of 0.6x the parent, then settle (repair / grow /
quality guard judged by the KD loss) and the engine check before slicing, twice:

- quiet: an engine that measures exactly what the table predicts;
- busy: an engine whose first two checks run 30 % and 40 % slow (a loaded minute), then exact.

At commit 9344955 the busy run tightened the target twice and the importance proxy put every cut
on the early layers' MLPs (ffn 192 in layers 0-19): pre-recovery perplexity 15,156 against 45.
Here the busy child's pre-recovery held-out perplexity must stay within 2x of the quiet child's.
(``bench/bench_repair_order.py`` runs the old rule — importance proxy, no grow-back — on the same
setup and prints both perplexities side by side.)

The "engine" is scripted: decode time proportional to the non-embedding weights plus a constant
per kept attention block (decode on a CPU is weight-bandwidth bound), scaled per check.
"""

from __future__ import annotations

import math

import pytest

from tests.collapse_utils import decode_cost, heldout_ppl, router_choice, settle_and_verify, smollm2_sorted

# a few hundred masked SmolLM2 forwards: ~2.5 min for the first test on a quiet 2-core machine, more under load
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def setup(megatron_tp1, smollm2_gguf):
    s = smollm2_sorted(smollm2_gguf)
    # the KD judge on 2 x 64 tokens, half the default's 128: a child costs half the forward (every
    # test here is judge calls: ~330 children), and the collapse this guards against is the
    # importance proxy's, whatever the judge's tokens (bench/bench_repair_order.py keeps 128)
    s.judge_seq = 64
    return s


def test_busy_engine_checks_do_not_collapse_the_student(setup) -> None:
    s = setup
    start = router_choice(s, steps=8)
    quiet, q_hist, q_settler = settle_and_verify(s, start, factors=[1.0])
    busy, b_hist, b_settler = settle_and_verify(s, start, factors=[1.3, 1.4, 1.0])
    assert [h["pass"] for h in b_hist[:2]] == [False, False], b_hist  # the busy checks did tighten
    assert b_hist[-1]["pass"]
    assert decode_cost(s, busy) <= s.budget["decode_ms"]
    # the grow-back spent the budget again: within 10 % of the quiet child's predicted cost
    assert decode_cost(s, busy) >= 0.9 * decode_cost(s, quiet), (decode_cost(s, busy), decode_cost(s, quiet))
    q_ppl, b_ppl = heldout_ppl(s, quiet), heldout_ppl(s, busy)
    print(f"pre-recovery held-out ppl: quiet {q_ppl:.2f}, busy {b_ppl:.2f}; guard {b_settler.guards[-1]}")
    assert math.isfinite(b_ppl) and b_ppl <= 2.0 * q_ppl, (q_ppl, b_ppl)
    # the guard ran on every settled child and recorded the three numbers
    g = b_settler.guards[-1]
    assert g["child_kd"] > 0 and g["uniform_kd"] is not None and g["router_expected_kd"] is not None
    assert g["final_kd"] <= g["factor"] * g["uniform_kd"] + 1e-9


def test_guard_repairs_differently_a_child_far_worse_than_the_router(setup) -> None:
    """A deliberately wrecked child (the first two MLPs at their narrowest, the rest at the
    parent's width) is caught by the guard — far over the router's loss — and replaced by the
    search's own choice settled again, in small steps, to the wrecked child's cost."""
    from autocompress_nemo.search.space import apply_choices

    s = setup
    parent = [d.parent_option for d in s.decisions]
    wrecked = list(parent)
    for i, d in enumerate(s.decisions):
        if d.kind == "mlp" and d.block_index // 2 < 2:
            wrecked[i] = 1 if d.options[0].removed else 0
    judge = s.kd_judge()
    one_cut = next(i for i, d in enumerate(s.decisions) if d.kind == "mlp")
    router_kd = judge.loss(parent[:one_cut] + [parent[one_cut] - 1] + parent[one_cut + 1 :])
    settler = s.settler(grow=0.1, router_kd=router_kd)
    settler.origin = parent
    target = {"decode_ms": decode_cost(s, wrecked) * 1.001}
    out = settler.guard(wrecked, target)
    g = settler.guards[-1]
    assert g["verdict"].startswith("replaced"), g
    assert out != wrecked and g["final_kd"] < g["child_kd"] / 1.5, g
    assert s.cost.predict(apply_choices(s.parent, s.decisions, out))["decode_ms"] <= target["decode_ms"]
    assert heldout_ppl(s, out) < heldout_ppl(s, wrecked)

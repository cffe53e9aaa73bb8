"""The KD judge batches children: several children in one forward (the batch repeated once per child,
each child's one-hot masks on its own rows) give each child the loss of its own forward, the memo
is shared with ``loss``, and the progress of a long judging call counts up to its total and no
further (the guard's 32 uniform children, a repair step's moves)."""

from __future__ import annotations

import pytest
import torch

from autocompress_nemo.extract.repair import judge_many, progress_lines
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.search.judge import KdJudge
from autocompress_nemo.search.space import build_space, uniform_candidates
from tests.method_utils import CAPS, megatron_from_hf, tiny_parent


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)
    yield


def _judge(spec, sd, decisions, seed: int = 5) -> KdJudge:
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, spec.vocab, (2, 16), generator=g) for _ in range(2)]
    return KdJudge(megatron_from_hf(spec, sd), spec, decisions, batches, forward_logits)


def test_grouped_children_get_the_loss_of_their_own_forward() -> None:
    spec, sd = tiny_parent()
    decisions = build_space(spec, CAPS, ffn_options=4)
    children = uniform_candidates(spec, decisions)[:7]
    children.append(children[0])  # a repeat is judged once
    one = _judge(spec, sd, decisions)
    assert one.group_size() > 1
    seq = [one.loss(ch) for ch in children]
    assert one.calls == len(children) - 1

    many = _judge(spec, sd, decisions)
    many.max_group = 3  # groups of 3, 3, 1
    lines: list[str] = []
    got = judge_many(many, children, progress_lines(lines.append, "search:guard", "uniform children judged"))
    assert many.calls == len(children) - 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(seq), rtol=1e-5, atol=1e-7)
    assert len(set(got)) > 1  # the children differ
    # shared memo: a later single call is free; a single call after a group is its own forward
    assert many.loss(children[2]) == got[2] and many.calls == len(children) - 1
    parent = [d.parent_option for d in decisions]
    assert many.loss(parent) == pytest.approx(one.loss(parent), rel=1e-5, abs=1e-7)
    counts = [tuple(map(int, ln.split("]")[0].split()[-1].split("/"))) for ln in lines]
    assert counts and counts[-1] == (len(children), len(children))
    assert all(d <= t for d, t in counts), lines
    # the elapsed time is this call's (a batched first report past 1 printed seconds since the epoch)
    assert all(float(ln.split("(")[1].split(" s,")[0]) < 3600 for ln in lines), lines
    one.close()
    many.close()


def test_progress_lines_never_pass_their_total() -> None:
    lines: list[str] = []
    p = progress_lines(lines.append, "repair", "moves judged", 4)
    for i in range(1, 13):
        p(i, 10)  # a caller that overshoots its total
    assert lines and all(int(ln.split("/")[0].split()[-1]) <= 10 for ln in lines), lines
    assert lines[-1].startswith("[repair 10/10]")

"""The router search survives a non-finite step: the update is skipped (the logits stay finite and
the search ends with valid choices), and a checkpoint holding non-finite logits is not resumed."""

from __future__ import annotations

import torch

from autocompress_nemo.arch.counts import param_count
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.search.autocompress import run_router_search
from autocompress_nemo.search.space import build_space
from tests.cfg_utils import ROUTER, search_cfg
from tests.method_utils import CAPS, ParamCost, megatron_from_hf, tiny_parent


def test_nan_step_is_skipped_and_nan_checkpoint_not_resumed(tmp_path, megatron_tp1) -> None:
    spec, sd = tiny_parent()
    model = megatron_from_hf(spec, sd)
    decisions = build_space(spec, CAPS, ffn_options=4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab, (2, 16), generator=g) for _ in range(6)]
    calls = {"n": 0}

    def forward(m, x):  # noqa: ANN001, ANN202 - the student's forward of step 3 (call 6) goes NaN
        calls["n"] += 1
        out = forward_logits(m, x)
        return out * float("nan") if calls["n"] == 6 else out

    logs: list[str] = []
    ckpt = tmp_path / "search"

    def search(fwd):  # noqa: ANN001, ANN202 - the same search, resumable from ``ckpt``
        budget = {"params": 0.75 * param_count(spec)}
        return run_router_search(
            model,
            spec,
            decisions,
            ParamCost(),
            budget,
            lambda s: batches[s],
            fwd,
            search_cfg(**ROUTER, steps=6, checkpoint_every=1),
            seed=1,
            log=logs.append,
            checkpoint=ckpt,
        )

    out = search(forward)
    assert [r["skipped"] for r in out.trajectory] == [False, False, True, False, False, False]
    assert any("update skipped" in s for s in logs)
    assert all(len(p) == len(d.options) and all(v == v for v in p) for p, d in zip(out.probs, decisions, strict=True))
    assert all(0 <= c < len(d.options) for c, d in zip(out.choices, decisions, strict=True))
    # a checkpoint whose logits went non-finite (older code) is not resumed
    shard = next((ckpt / "checkpoints").glob("step_*/*.pt"))
    st = torch.load(shard, weights_only=False)
    st["model"] = {k: v * float("nan") if k.startswith("router.") else v for k, v in st["model"].items()}
    torch.save(st, shard)
    logs.clear()
    again = search(forward_logits)
    assert any("holds non-finite weights (router.logits.0); starting from step 0" in s for s in logs), logs
    assert len(again.trajectory) == 6  # search_cfg(steps=6): every step, from step 0

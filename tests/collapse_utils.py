"""The real SmolLM2-135M, importance-sorted, with the default search space and a scripted decode
cost: the setup of tests/test_search_no_collapse.py and bench/bench_repair_order.py."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.counts import block_params, param_count
from autocompress_nemo.arch.spec import ArchSpec, Block
from autocompress_nemo.models.builder import forward_logits

SEQ = 128
CALIB_FILES = ("argparse.py", "subprocess.py")
HELDOUT_FILES = ("textwrap.py", "json/decoder.py")


def _stdlib_ids(tok: Any, files: Sequence[str]) -> torch.Tensor:
    root = Path(os.__file__).parent
    ids: list[int] = []
    for f in files:
        ids += tok((root / f).read_text(encoding="utf-8"))["input_ids"]
    n = len(ids) // SEQ
    return torch.tensor(ids[: n * SEQ]).view(n, SEQ)


class DecodeCost:
    """Scripted decode time: ``W_MS`` per non-embedding weight plus ``ATTN_MS`` per kept attention
    block plus a constant (CPU decode is weight-bandwidth bound); exact and differentiable faces."""

    W_MS, ATTN_MS, CONST_MS = 2.8e-7, 0.1, 3.0

    def _block(self, b: Block, hidden: int) -> float:
        return self.W_MS * block_params(b, hidden) + (self.ATTN_MS if b.kind == "attention" and not b.removed else 0.0)

    def predict(self, spec: ArchSpec) -> dict[str, float]:
        return {"decode_ms": self.CONST_MS + sum(self._block(b, spec.hidden) for b in spec.blocks)}

    def expected(
        self, options: list[list[Block]], probs: list[torch.Tensor], spec: ArchSpec
    ) -> dict[str, torch.Tensor]:
        total = torch.tensor(self.predict(spec)["decode_ms"] - sum(self._block(o[-1], spec.hidden) for o in options))
        for opts, p in zip(options, probs, strict=True):
            total = total + (p * torch.tensor([self._block(o, spec.hidden) for o in opts])).sum()
        return {"decode_ms": total}


@dataclass
class Setup:
    parent: ArchSpec
    sorted_sd: dict[str, torch.Tensor]
    model: torch.nn.Module
    decisions: list[Any]
    cost: DecodeCost
    budget: dict[str, float]
    calib: torch.Tensor
    heldout: torch.Tensor
    importance: list[list[float]]
    search_cfg: Any
    judge: Any = None
    judge_seq: int = SEQ
    """Tokens per row of the KD judge's batch (2 rows): 128, as search.judge_batches / judge_seq_len."""

    def kd_judge(self) -> Any:
        from autocompress_nemo.search.judge import KdJudge

        if self.judge is None:
            batch = self.calib[-2:, : self.judge_seq]
            self.judge = KdJudge(self.model, self.parent, self.decisions, [batch], forward_logits)
        return self.judge

    def settler(self, grow: float | None = 0.1, judge: Any = None, router_kd: float | None = None) -> Any:
        from autocompress_nemo.search.settle import Settler

        return Settler(
            self.parent,
            self.decisions,
            self.cost.predict,
            judge if judge is not None else self.kd_judge(),
            grow_threshold=grow,
            router_kd=router_kd,
            log=lambda s: None,
        )


def smollm2_sorted(gguf: Path, budget_factor: float = 0.6) -> Setup:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.extract.repair import option_importance
    from autocompress_nemo.models.llama import load_gguf
    from autocompress_nemo.rank.importance import collect_importance
    from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores, sorted_importance
    from autocompress_nemo.search.space import build_space
    from autocompress_nemo.stages import common as stages
    from tests.method_utils import megatron_from_hf

    cfg = compose([])
    spec, sd, tok = load_gguf(gguf)
    calib, heldout = _stdlib_ids(tok, CALIB_FILES), _stdlib_ids(tok, HELDOUT_FILES)
    model = megatron_from_hf(spec, sd)
    imp = collect_importance(model, spec, [calib[i : i + 2] for i in range(0, 8, 2)], forward_logits)
    perms = permutations_from_scores(spec, imp)
    sorted_sd = apply_permutations(spec, sd, perms)
    del model, sd
    model = megatron_from_hf(spec, sorted_sd)
    decisions = build_space(spec, stages.search_capabilities(cfg), int(cfg.search.ffn_options))
    cost = DecodeCost()
    return Setup(
        parent=spec,
        sorted_sd=sorted_sd,
        model=model,
        decisions=decisions,
        cost=cost,
        budget={"decode_ms": budget_factor * cost.predict(spec)["decode_ms"]},
        calib=calib,
        heldout=heldout[:4],
        importance=option_importance(decisions, sorted_importance(spec, imp, perms)),
        search_cfg=cfg.search,
    )


def router_choice(s: Setup, steps: int) -> Any:
    """A short router search (the default preset's settings, ``steps`` steps on 2 x 128 tokens)."""
    from omegaconf import OmegaConf

    from autocompress_nemo.search.autocompress import run_router_search

    cfg = OmegaConf.merge(s.search_cfg, {"steps": steps, "checkpoint_every": 0})
    train = s.calib[8:]
    return run_router_search(
        s.model,
        s.parent,
        s.decisions,
        s.cost,
        s.budget,
        lambda i: train[(2 * i) % (len(train) - 1) :][:2],
        forward_logits,
        cfg,
        seed=0,
        log=lambda m: None,
    )


def settle_and_verify(
    s: Setup,
    outcome: Any,
    factors: list[float],
    judge: Any = None,
    grow: float | None = 0.1,
    rounds: int = 3,
    old_rule: bool = False,
) -> tuple[list[int], list[dict[str, Any]], Any]:
    """Settle the router's choice and run the engine check with a scripted engine measuring
    ``factors[i]`` times the table on its i-th check (the last factor repeats). ``old_rule``: the
    rule of commit 9344955 — the importance proxy judges, no quality guard, no grow-back after a
    passing check (``verify_rounds`` 2)."""
    from autocompress_nemo.search.settle import verify_measured

    traj = outcome.trajectory
    if old_rule:
        from autocompress_nemo.search.judge import ProxyJudge

        judge, rounds = ProxyJudge(s.importance), 2
    settler = s.settler(grow=grow, judge=judge, router_kd=sum(r["kd"] for r in traj[-2:]) / 2)
    settler.use_guard = not old_rule
    settler.origin = list(outcome.choices)
    calls = [0]

    def measure(child: ArchSpec) -> dict[str, float]:
        f = factors[min(calls[0], len(factors) - 1)]
        calls[0] += 1
        return {"decode_ms": f * s.cost.predict(child)["decode_ms"]}

    start = settler(list(outcome.choices), s.budget)
    final, hist = verify_measured(
        s.parent,
        s.decisions,
        start,
        s.cost.predict,
        s.budget,
        settler,
        measure,
        rounds,
        None if old_rule else grow,
        "scripted",
        lambda m: None,
    )
    return final, hist, settler


def decode_cost(s: Setup, choices: list[int]) -> float:
    from autocompress_nemo.search.space import apply_choices

    return s.cost.predict(apply_choices(s.parent, s.decisions, choices))["decode_ms"]


def heldout_ppl(s: Setup, choices: list[int]) -> float:
    """Pre-recovery held-out perplexity of the child sliced from the sorted parent."""
    from autocompress_nemo.distill.kd import lm_loss
    from autocompress_nemo.extract.slice import slice_state_dict
    from autocompress_nemo.search.space import apply_choices
    from tests.method_utils import megatron_from_hf

    child = apply_choices(s.parent, s.decisions, choices)
    model = megatron_from_hf(child, slice_state_dict(s.parent, s.sorted_sd, child))
    model.eval()
    with torch.no_grad():
        losses = [float(lm_loss(forward_logits(model, s.heldout[i : i + 2]), s.heldout[i : i + 2])) for i in (0, 2)]
    assert param_count(child) > 0
    return float(torch.tensor(sum(losses) / len(losses)).exp())

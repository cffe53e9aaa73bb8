"""Memory floors from shapes, before any stage (issue 39): a sequence length the machine cannot hold
is refused naming the setting to lower and the largest value that clears the floor; a memory budget
below the embedding every student keeps is refused; neither refuses what fits.

Before issue 39 ``model=tiny_llama +target=tiny_cpu search.seq_len=100000`` was accepted, profiling
ran, then a rank died in Megatron's attention ("DefaultCPUAllocator: can't allocate memory: you tried to
allocate 320000000000 bytes") with a traceback."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.memory_floor import budget_floor_problems, stage_memory_problems
from tests.cfg_utils import TINY_ROOFLINE

GiB = 1 << 30


def _plain(*overrides: str) -> dict:
    return OmegaConf.to_container(compose([*TINY_ROOFLINE, *overrides]), resolve=True)  # type: ignore[return-value]


def test_the_allocation_that_killed_the_rank_is_refused_up_front() -> None:
    c = _plain("search.seq_len=100000")
    (p,) = stage_memory_problems(c, ("CPU", 16 * GiB))
    # the 320,000,000,000 bytes Megatron's unfused attention asked for: 2 sequences x 4 heads x 100,000² x fp32
    assert p.startswith("search.seq_len=100,000: rank and search would need at least 320.0 GB"), p
    assert "(2 x 4 heads x 100,000² x 4 bytes = 320.0 GB)" in p and "16.0 GiB of memory" in p, p
    assert "lower search.seq_len (at most about" in p and p.endswith("or search.batch_size"), p


def test_the_suggested_length_fits_and_the_next_does_not() -> None:
    c = _plain("search.seq_len=100000")
    (p,) = stage_memory_problems(c, ("CPU", 16 * GiB))
    fits = int(p.split("at most about ")[1].split(" fits")[0].replace(",", ""))
    assert fits > 1000
    assert stage_memory_problems(_plain(f"search.seq_len={fits}"), ("CPU", 16 * GiB)) == []
    assert stage_memory_problems(_plain(f"search.seq_len={fits + 128}"), ("CPU", 16 * GiB)) != []


def test_the_default_lengths_and_a_gpu_with_fused_attention_pass() -> None:
    assert stage_memory_problems(_plain(), ("CPU", 2 * GiB)) == []
    # GPUs run fused attention (no s x s matrix): only the weights and the logits count
    assert stage_memory_problems(_plain("search.seq_len=100000"), ("GPU", 80 * GiB)) == []


def test_distillation_names_its_own_setting_and_dry_runs_are_not_checked() -> None:
    c = _plain("distill.seq_len=60000", "distill.tokens=10000000")
    (p,) = stage_memory_problems(c, ("CPU", 8 * GiB))
    assert p.startswith("distill.seq_len=60,000: distill would need at least"), p
    assert "(1 x 4 heads" in p, p  # distillation splits its batch into micro-batches: one sequence at least
    assert stage_memory_problems({**c, "dry_run": True}, ("CPU", 8 * GiB)) == []


@pytest.mark.parametrize(
    ("value", "refused"),
    [("20KB", True), ("100KB", True), ("200KB", False), ("0.5x", False)],
)
def test_a_memory_budget_below_the_embedding_is_refused(value, refused) -> None:
    # tiny_llama: vocab 512 x hidden 64, untied: 2 x 32,768 weights of 2 bytes (bf16) + the final norm (64 x f32)
    c = _plain(f"target.budget.constraints=[{{metric: memory_bytes, value: {value}}}]")
    p = budget_floor_problems(c)
    assert bool(p) == refused, p
    if refused:
        assert f"memory_bytes {value} is below what every student keeps" in p[0]
        assert "alone take 131.3 kB in bf16" in p[0], p[0]


def test_a_parameter_budget_below_the_embedding_is_refused() -> None:
    c = _plain("target.budget.constraints=[{metric: params, value: 50K}]")
    (p,) = budget_floor_problems(c)
    assert "params 50K is below what every student keeps" in p and "0.07M parameters" in p, p

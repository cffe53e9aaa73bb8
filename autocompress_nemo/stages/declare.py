"""A stage's declaration (:class:`Stage`), the key groups reads through the context imply, and
what a stage's entry receives (:class:`Inputs`).

The declarations are the pipeline: ``stages/graph.py`` collects them, and the runner
(``pipeline.walk``), the console scripts (``cli.py``), config validation's stage list and
``autocompress --graph`` are all read from them; nobody writes the order down a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
STUDENT = "distill|reconstruct|extract"
"""The need "the latest student": distilled, else locally reconstructed, else extracted."""
ALWAYS: tuple[str, ...] = ("run_dir", "cache_dir")
"""Where the run lives and keeps its caches (token streams, lm-eval task files): never part of a cache key."""


@dataclass
class Inputs:
    """What the runner hands a stage's entry: the artifacts of its declared needs (``self[need]``,
    keyed as declared: ``"rank"``, or ``"distill|reconstruct|extract"`` for the first of those
    alternatives that ran), the method (per-method stages), the checkpoint directory (resumable
    stages), every method's artifacts of this budget (``by_method[stage][method]``) and the run."""

    run: Any
    dirs: dict[str, Path | None]
    method: str | None = None
    checkpoint: Path | None = None
    by_method: dict[str, dict[str, Path]] = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)
    """What a family's budgets share (``first_search``: the first budget's AutoCompress search;
    ``members``: the budgets done, for the report)."""

    def __getitem__(self, need: str) -> Path:
        d = self.dirs.get(need)
        if d is None:
            raise KeyError(f"stage input {need!r} is not available (declared needs: {sorted(self.dirs)})")
        return d

    def get(self, need: str) -> Path | None:
        return self.dirs.get(need)


Entry = Callable[[Any, Path, Inputs], Any]


@dataclass(frozen=True)
class Stage:
    """A stage's declaration.

    ``reads``: the config keys it reads (dotted, a whole section or one key) — its cache key and
    the only keys its context holds. ``needs``: the stages whose artifacts it consumes; an entry
    ``"a|b"`` takes the first of ``a``, ``b`` that runs (``distill|reconstruct|extract``: the
    latest student). ``optional``: stages it reads when they run or are complete from an earlier
    invocation, and otherwise does without (``validate``). ``per_method``: once per method
    (``search_autocompress``, ``search_minitron_pp``); ``per_budget``: once per budget of a family;
    ``resumable``: gets a fingerprinted checkpoint directory; ``distributed``: runs Megatron over
    every GPU of the job (its parallel layout: ``plan/layout.py``); ``cached=False``: rewritten every run;
    ``rank0_only``: under torch.distributed only rank 0 runs it (engine timing), the others wait.
    ``joins``: it runs whenever one of these runs (``reconstruct`` is part of ``distill``'s recovery).
    ``enabled(cfg)``: ``None`` when the stage runs, else why it is passed through (its consumers
    take the next alternative). ``script``: what its console script ``autocompress-<name>`` writes
    (no script when empty). ``entry(ctx, out, inputs)``: the work."""

    name: str
    reads: tuple[str, ...]
    needs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    rank0_only: bool = False
    per_method: bool = False
    per_budget: bool = False
    resumable: bool = False
    distributed: bool = False
    cached: bool = True
    joins: tuple[str, ...] = ()
    enabled: Callable[[Any], str | None] | None = None
    script: str = ""
    entry: Entry | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", tuple(dict.fromkeys(self.reads)))  # ordered, no repeats

    def dir_name(self, method: str | None = None) -> str:
        return f"{self.name}_{method}" if self.per_method and method else self.name

    @property
    def required(self) -> tuple[str, ...]:
        """Every stage name ``needs`` mentions (alternatives included)."""
        return tuple(n for need in self.needs for n in need.split("|"))

    def why_disabled(self, cfg: Any) -> str | None:
        return self.enabled(cfg) if self.enabled is not None else None


def reads(*groups: tuple[str, ...] | str) -> tuple[str, ...]:
    """The union of key groups, in order."""
    out: list[str] = []
    for g in groups:
        out += [g] if isinstance(g, str) else list(g)
    return tuple(dict.fromkeys(out))

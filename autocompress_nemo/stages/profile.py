"""profile / validate: the cost table of the target, measured in its engine, and the table's
predicted-vs-measured error on whole models (``profile/stage.py`` does the work)."""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.context import Context
from autocompress_nemo.stages.declare import Stage
from autocompress_nemo.stages.layout import ProfileDir, ValidateDir


def run(ctx: Context, out: Path) -> None:
    """Build the cost table (``ProfileDir.table``)."""
    from autocompress_nemo.profile.stage import run_profile

    run_profile(ctx.cfg, out)


def validate(ctx: Context, out: Path, profile: ProfileDir) -> None:
    """Measure the parent, the smallest child and random children end to end (``ValidateDir``)."""
    from autocompress_nemo.profile.stage import run_validate

    run_validate(ctx.cfg, profile.table, out)
    assert ValidateDir(out).validation.is_file(), "run_validate wrote no validation.json"


# cluster.ep: MoE options keep expert counts in multiples of EP (config.resolve.search_capabilities)
STAGE = Stage(
    "profile",
    reads=("target", "model", "search.ffn_options", "cluster.ep"),
    rank0_only=True,
    script="the target's cost table in <run_dir>/profile; add `validate` for <run_dir>/validate "
    "(>= 12 models measured in the engine vs the table's predictions)",
    entry=lambda ctx, out, inp: run(ctx, out),
)
VALIDATE = Stage(
    "validate",
    reads=("target", "model", "seed", "search.ffn_options", "cluster.ep"),
    needs=("profile",),
    rank0_only=True,
    entry=lambda ctx, out, inp: validate(ctx, out, ProfileDir(inp["profile"])),
)

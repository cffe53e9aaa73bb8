"""rank: importance of every channel / head / expert / block from one calibration pass on the
parent, the permutations that sort them, and the sorted parent (``RankDir``)."""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.arch.counts import forward_flops_per_token
from autocompress_nemo.context import Context, save_weights
from autocompress_nemo.rank.importance import collect_importance
from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores, sorted_importance
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import RankDir
from autocompress_nemo.utils import work
from autocompress_nemo.utils.artifacts import write_json_atomic


def run(ctx: Context, out: Path) -> None:
    spec, sd, _ = ctx.parent
    s = ctx.cfg.search
    art = RankDir(out)
    model = ctx.model(spec, sd)
    n_batches = max(1, int(s.calib_sequences) // int(s.batch_size))
    batches = [ctx.batch_at("calib", i, int(s.batch_size), int(s.seq_len)) for i in range(n_batches)]
    imp = collect_importance(model, spec, batches, ctx.forward, log=ctx.say)
    # what ranking needs: the parent's layers forward once over the calibration tokens (no LM head)
    work.add(forward_flops_per_token(spec, int(s.seq_len), head=False) * imp.tokens)
    perms = permutations_from_scores(spec, imp, sort_hidden=bool(s.search_hidden))
    write_json_atomic(art.scores, imp.to_dict())
    write_json_atomic(art.sorted_scores, sorted_importance(spec, imp, perms).to_dict())
    write_json_atomic(art.permutations, perms.to_dict())
    save_weights(out, spec, apply_permutations(spec, sd, perms))
    scored = sorted({name for b in imp.blocks for name in b})
    ctx.say(
        f"[rank] {imp.tokens} calibration tokens; scored and reordered {', '.join(scored)}"
        + (", hidden channels" if perms.hidden is not None else " (hidden channels scored, kept in order)")
    )


STAGE = Stage(
    "rank",
    reads=reads(
        PARENT,
        LAYOUT,
        DATA,
        "search.calib_sequences",
        "search.seq_len",
        "search.batch_size",
        "search.search_hidden",
    ),
    distributed=True,
    script="the importance-sorted parent in <run_dir>/rank",
    entry=lambda ctx, out, inp: run(ctx, out),
)

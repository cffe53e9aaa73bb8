"""rank: importance of every channel / head / expert / block from one calibration pass on the
parent, the permutations that sort them, and the sorted parent (``RankDir``)."""

from __future__ import annotations

from pathlib import Path

from autocompress_nemo.context import Context, save_weights
from autocompress_nemo.stages.declare import DATA, LAYOUT, PARENT, Stage, reads
from autocompress_nemo.stages.layout import RankDir
from autocompress_nemo.utils.artifacts import write_json_atomic

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
)


def run(ctx: Context, out: Path) -> None:
    spec, sd, _ = ctx.parent
    s = ctx.cfg.search
    art = RankDir(out)
    model = ctx.model(spec, sd)
    n_batches = max(1, int(s.calib_sequences) // int(s.batch_size))
    batches = [ctx.batch_at("calib", i, int(s.batch_size), int(s.seq_len)) for i in range(n_batches)]
    if spec.is_dense_layered():
        from autocompress_nemo.rank.importance import collect_importance
        from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores

        imp = collect_importance(model, spec, batches, ctx.forward, bool(ctx.cfg.cluster.sequence_parallel))
        perms = permutations_from_scores(spec, imp, sort_hidden=bool(s.search_hidden))
        write_json_atomic(art.scores, imp.to_dict())
        write_json_atomic(art.permutations, perms.to_dict())
        save_weights(out, spec, apply_permutations(spec, sd, perms))
        ctx.say(
            f"[rank] {imp.tokens} calibration tokens; block importance "
            + " ".join(f"{s.attn_block:.2f}/{s.mlp_block:.2f}" for s in imp.layers[:6])
            + " ..."
        )
        return
    # MoE / Mamba hybrids: routed experts (routing mass x output), expert / shared-expert / MLP
    # neurons, Mamba heads, attention heads / KV groups and hidden channels (rank/moe_mamba.py)
    from autocompress_nemo.rank.moe_mamba import collect_moe_mamba_importance
    from autocompress_nemo.rank.reorder_hybrid import (
        apply_moe_mamba_permutations,
        sorted_scores,
    )
    from autocompress_nemo.rank.reorder_hybrid import permutations_from_scores as hybrid_permutations

    himp = collect_moe_mamba_importance(model, spec, batches, ctx.forward)
    hperms = hybrid_permutations(spec, himp, sort_hidden=bool(s.search_hidden))
    write_json_atomic(art.scores, himp.to_dict())
    write_json_atomic(art.sorted_scores, sorted_scores(himp, hperms).to_dict())
    write_json_atomic(art.permutations, hperms.to_dict())
    save_weights(out, spec, apply_moe_mamba_permutations(spec, sd, hperms))
    ctx.say(
        f"[rank] hybrid {spec.pattern}: {himp.tokens} calibration tokens; scored and reordered routed experts, "
        "expert / shared-expert / MLP neurons, Mamba heads, attention heads / KV groups"
        + (", hidden channels" if hperms.hidden is not None else " (hidden channels scored, kept in order)")
    )

"""The stages for MoE / Mamba hybrid parents (Nemotron-H family), called from ``stages.py``'s
dispatch lines (``if not spec.is_dense_layered(): return stages_hybrid.<stage>(...)``).

What differs from the dense stages:

- rank: ``rank/moe_mamba.py`` scores, in one calibration pass on the Megatron hybrid model, routed
  experts (routing mass x output), expert ffn neurons, shared-expert neurons, Mamba heads,
  attention query heads / KV groups, dense-MLP neurons and hidden channels;
  ``rank/reorder_hybrid.py`` sorts them on the Hugging Face-named parent (function unchanged).
- search: the hybrid space (``search/space_hybrid.py``) and supernet; repair / growth use
  ``option_importance`` (below): the summed sorted scores each option keeps, for every kind of
  decision (all measured; no prior).
- extract: ``extract/slice_hybrid.py``; the Hugging Face directory is Nemotron-H (Puzzle format
  when heterogeneous, ``models/nemotron_h.export_hf``).
- distill: the Megatron model reads / writes Nemotron-H names (``models/hybrid``).
- export: Hugging Face directory + Megatron checkpoint. No GGUF: llama.cpp's ``deci`` is Llama-
  only and its ``nemotron_h_moe`` takes one global expert count / width (see
  ``costs/engines/torch_eager.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MoeBlock
from autocompress_nemo.context import Context, load_weights, read_json, save_weights
from autocompress_nemo.utils.artifacts import write_json_atomic


# -- rank -------------------------------------------------------------------------------------------
def rank(ctx: Context, out: Path) -> None:
    """Importance of every dimension (``rank/moe_mamba.py``), the permutations, the sorted parent.

    Writes ``scores.json`` / ``sorted_scores.json`` (``MoeMambaImportance.to_dict``: ``tokens``,
    ``hidden``, per block ``experts``, ``expert_ffn``, ``shared_ffn``, ``mamba_heads``, ``heads``,
    ``ffn``), ``permutations.json`` (``MoeMambaPermutations.to_dict``) and the sorted weights.
    Hidden channels are reordered when ``search.search_hidden`` is set, as for dense parents."""
    from autocompress_nemo.rank.moe_mamba import collect_moe_mamba_importance
    from autocompress_nemo.rank.reorder_hybrid import (
        apply_moe_mamba_permutations,
        permutations_from_scores,
        sorted_scores,
    )

    spec, sd, _ = ctx.parent
    s = ctx.cfg.search
    model = ctx.model(spec, sd)
    n_batches = max(1, int(s.calib_sequences) // int(s.batch_size))
    batches = [ctx.batch_at("calib", i, int(s.batch_size), int(s.seq_len)) for i in range(n_batches)]
    imp = collect_moe_mamba_importance(model, spec, batches, ctx.forward)
    perms = permutations_from_scores(spec, imp, sort_hidden=bool(s.search_hidden))
    write_json_atomic(out / "scores.json", imp.to_dict())
    write_json_atomic(out / "sorted_scores.json", sorted_scores(imp, perms).to_dict())
    write_json_atomic(out / "permutations.json", perms.to_dict())
    save_weights(out, spec, apply_moe_mamba_permutations(spec, sd, perms))
    ctx.say(
        f"[rank] hybrid {spec.pattern}: {imp.tokens} calibration tokens; scored and reordered routed experts, "
        "expert / shared-expert / MLP neurons, Mamba heads, attention heads / KV groups"
        + (", hidden channels" if perms.hidden is not None else " (hidden channels scored, kept in order)")
    )


def option_importance(decisions: list[Any], sorted_imp: Any, parent: ArchSpec) -> list[list[float]]:
    """Summed sorted scores kept by every option: the first ``E'`` experts' first ``F'`` neurons, the
    first shared / MLP neurons, the first Mamba heads, the first ``H'/G'`` query heads of each of the
    first ``G'`` KV groups; a removed option keeps 0."""
    from autocompress_nemo.extract.slice import kept_heads

    out = []
    for d in decisions:
        s = sorted_imp.blocks[d.block_index]

        def need(name: str, d: Any = d, s: Any = s) -> torch.Tensor:
            v = getattr(s, name)
            if v is None:
                raise ValueError(
                    f"block {d.block_index} ({d.kind} decision): the rank artifact has no {name!r} "
                    "scores; it was written by an older build: delete the rank stage's directory and "
                    "run again"
                )
            return v

        row = []
        for o in d.options:
            if o.removed:
                row.append(0.0)
            elif d.kind == "moe_routed":
                row.append(float(need("expert_ffn")[: o.num_experts, : o.expert_ffn].sum()))
            elif d.kind == "moe_shared":
                row.append(float(need("shared_ffn")[: o.shared_ffn].sum()))
            elif d.kind == "mamba":
                row.append(float(need("mamba_heads")[: o.num_heads].sum()))
            elif d.kind == "attention":
                hpg = parent.blocks[d.block_index].heads_per_group
                row.append(float(need("heads")[kept_heads(hpg, o.num_kv_groups, o.heads_per_group)].sum()))
            elif d.kind == "mlp":
                row.append(float(need("ffn")[: o.ffn].sum()))
            else:
                raise ValueError(f"block {d.block_index}: no importance for decisions of kind {d.kind!r}")
        out.append(row)
    return out


# -- search -------------------------------------------------------------------------------------------
def search(
    ctx: Context, out: Path, method: str, rank_dir: Path, table_path: Path, validation_dir: Path | None, ckpt_dir: Path
) -> None:
    """``stages.search`` for hybrids: the shared search core with the hybrid importance per option."""
    from autocompress_nemo import stages

    spec, sd = load_weights(rank_dir)
    from autocompress_nemo.rank.moe_mamba import MoeMambaImportance

    imp = MoeMambaImportance.from_dict(read_json(rank_dir / "sorted_scores.json"))
    stages.search_core(
        ctx,
        out,
        method,
        spec,
        sd,
        lambda ds: option_importance(ds, imp, spec),
        table_path,
        validation_dir,
        ckpt_dir,
        describe=describe,
    )


def describe(spec: ArchSpec) -> str:
    """Per-block shapes in one line (experts x width (top-k) + shared; Mamba heads/groups)."""
    out = []
    for b in spec.blocks:
        if b.removed:
            out.append(f"{b.kind}:removed")
        elif isinstance(b, MoeBlock):
            out.append(f"E{b.num_experts}x{b.expert_ffn}k{b.top_k}+s{b.shared_ffn}")
        elif isinstance(b, MambaBlock):
            out.append(f"M{b.num_heads}h{b.num_groups}g")
        elif isinstance(b, AttentionBlock):
            out.append(f"A{b.num_heads}h{b.num_kv_groups}kv")
        else:
            out.append(f"F{b.ffn}")
    return " ".join(out)


# -- extract / distill / export ---------------------------------------------------------------------
def export(ctx: Context, out: Path, student_dir: Path) -> None:
    from autocompress_nemo.models.nemotron_h import export_hf

    spec, sd = load_weights(student_dir)
    export_hf(spec, sd, out / "hf", tokenizer=None)
    ctx.say(
        f"[export] Nemotron-H Hugging Face directory ({'uniform' if spec.is_uniform() else 'Puzzle per-block'}) "
        f"-> {out / 'hf'}. No GGUF: llama.cpp's deci architecture is Llama-only and its nemotron_h_moe takes one "
        "global expert count and width, so a hybrid with per-block experts cannot be written for it"
    )
    model = ctx.model(spec, sd)
    torch.save({"arch_spec": spec.to_dict(), "megatron_state_dict": model.state_dict()}, out / "megatron_model.pt")


# -- validation candidates ---------------------------------------------------------------------------
def validation_candidates(
    parent: ArchSpec, caps: Any, n_random: int = 6, seed: int = 0, ffn_points: int = 8
) -> list[ArchSpec]:
    """The parent, the smallest servable child, a uniform middle and random children of the hybrid
    search space (per-block options drawn independently), for predicted-vs-measured validation."""
    import random

    from autocompress_nemo.search.space import apply_choices, build_space

    rng = random.Random(seed)
    decisions = build_space(parent, caps, ffn_points)
    out = [
        parent.replace(name="parent"),
        apply_choices(parent, decisions, [min(1, len(d.options) - 1) for d in decisions]).replace(name="smallest"),
        apply_choices(parent, decisions, [len(d.options) // 2 for d in decisions]).replace(name="middle"),
    ]
    for i in range(n_random):
        out.append(
            apply_choices(parent, decisions, [rng.randrange(len(d.options)) for d in decisions]).replace(
                name=f"random{i}"
            )
        )
    return out

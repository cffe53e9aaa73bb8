"""The stages for MoE / Mamba hybrid parents (Nemotron-H family), called from ``stages.py``'s
dispatch lines (``if not spec.is_dense_layered(): return stages_hybrid.<stage>(...)``).

What differs from the dense stages:

- rank: ``rank/moe_mamba.py`` scores routed experts (routing mass x output), expert ffn neurons,
  shared-expert neurons and Mamba heads and reorders them (function unchanged). Attention heads
  and dense-MLP neurons of hybrids are not scored or reordered in this build (the dense scorer
  walks Llama layers); their options keep the parent's first heads / neurons.
- search: the hybrid space (``search/space_hybrid.py``) and supernet; repair / growth use
  ``option_importance`` (below): summed sorted scores kept by each option; for the unscored
  attention / MLP options, the kept fraction of the parent width times the mean full-option
  importance of the scored decisions (a stated prior, not a measurement).
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

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.context import Context, load_weights, read_json, save_weights
from autocompress_nemo.utils.artifacts import write_json_atomic

_FIELDS = ("experts", "expert_ffn", "shared_ffn", "mamba_heads")


def _imp_to_dict(imp: Any) -> dict[str, Any]:
    return {"tokens": imp.tokens, "blocks": [{f: None if getattr(b, f) is None else getattr(b, f).tolist()
                                             for f in _FIELDS} for b in imp.blocks]}


def _imp_from_dict(d: dict[str, Any]) -> Any:
    from autocompress_nemo.rank.moe_mamba import BlockScores, MoeMambaImportance

    return MoeMambaImportance(blocks=[BlockScores(**{f: None if b[f] is None else torch.tensor(b[f], dtype=torch.float64)
                                                     for f in _FIELDS}) for b in d["blocks"]], tokens=int(d["tokens"]))


# -- rank -------------------------------------------------------------------------------------------
def rank(ctx: Context, out: Path) -> None:
    """Expert / expert-neuron / shared-neuron / Mamba-head importance, the permutations, the sorted parent."""
    from autocompress_nemo.rank.moe_mamba import (
        apply_moe_mamba_permutations,
        collect_moe_mamba_importance,
        permutations_from_scores,
        sorted_scores,
    )

    spec, sd, _ = ctx.parent
    s = ctx.cfg.search
    model = ctx.model(spec, sd)
    n_batches = max(1, int(s.calib_sequences) // int(s.batch_size))
    batches = [ctx.batch_at("calib", i, int(s.batch_size), int(s.seq_len)) for i in range(n_batches)]
    imp = collect_moe_mamba_importance(model, spec, batches, ctx.forward)
    perms = permutations_from_scores(spec, imp)
    write_json_atomic(out / "scores.json", _imp_to_dict(imp))
    write_json_atomic(out / "sorted_scores.json", _imp_to_dict(sorted_scores(imp, perms)))
    write_json_atomic(out / "permutations.json", {k: {str(g): t.tolist() for g, t in getattr(perms, k).items()}
                                                  for k in ("experts", "expert_ffn", "shared_ffn", "mamba_groups",
                                                            "mamba_heads")})
    save_weights(out, spec, apply_moe_mamba_permutations(spec, sd, perms))
    ctx.say(f"[rank] hybrid {spec.pattern}: {imp.tokens} calibration tokens; scored routed experts, expert / "
            "shared-expert neurons and Mamba heads (attention / MLP blocks of hybrids are not reordered)")


def option_importance(decisions: list[Any], sorted_imp: Any, parent: ArchSpec) -> list[list[float]]:
    """Summed sorted scores kept by every option (see the module docstring for attention / MLP)."""
    rows: list[list[float] | None] = []
    for d in decisions:
        s = sorted_imp.blocks[d.block_index]
        row: list[float] | None = []
        for o in d.options:
            if o.removed:
                row.append(0.0)
            elif d.kind == "moe_routed":
                if s.expert_ffn is not None:
                    row.append(float(s.expert_ffn[: o.num_experts, : o.expert_ffn].sum()))
                else:
                    row.append(float(s.experts[: o.num_experts].sum()) if s.experts is not None else 0.0)
            elif d.kind == "moe_shared":
                row.append(float(s.shared_ffn[: o.shared_ffn].sum()) if s.shared_ffn is not None else 0.0)
            elif d.kind == "mamba" and s.mamba_heads is not None:
                row.append(float(s.mamba_heads[: o.num_heads].sum()))
            else:
                row = None
                break
        rows.append(row)
    full = [r[-1] for r in rows if r]
    scale = sum(full) / len(full) if full else 1.0
    out = []
    for d, r in zip(decisions, rows, strict=True):
        if r is None:
            p = parent.blocks[d.block_index]
            out.append([scale * _frac(o, p) for o in d.options])
        else:
            out.append(r)
    return out


def _frac(o: Any, p: Any) -> float:
    if o.removed:
        return 0.0
    if isinstance(o, AttentionBlock):
        return o.num_heads / max(1, p.num_heads)
    if isinstance(o, MlpBlock):
        return o.ffn / max(1, p.ffn)
    return 1.0


# -- search -------------------------------------------------------------------------------------------
def search(ctx: Context, out: Path, method: str, rank_dir: Path, table_path: Path, validation_dir: Path | None,
           ckpt_dir: Path) -> None:
    """``stages.search`` for hybrids: the shared search core with the hybrid importance per option."""
    from autocompress_nemo import stages

    spec, sd = load_weights(rank_dir)
    imp = _imp_from_dict(read_json(rank_dir / "sorted_scores.json"))
    stages.search_core(ctx, out, method, spec, sd, lambda ds: option_importance(ds, imp, spec), table_path,
                       validation_dir, ckpt_dir, describe=describe)


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
    ctx.say(f"[export] Nemotron-H Hugging Face directory ({'uniform' if spec.is_uniform() else 'Puzzle per-block'}) "
            f"-> {out / 'hf'}. No GGUF: llama.cpp's deci architecture is Llama-only and its nemotron_h_moe takes one "
            "global expert count and width, so a hybrid with per-block experts cannot be written for it")
    model = ctx.model(spec, sd)
    torch.save({"arch_spec": spec.to_dict(), "megatron_state_dict": model.state_dict()}, out / "megatron_model.pt")


# -- validation candidates ---------------------------------------------------------------------------
def validation_candidates(parent: ArchSpec, caps: Any, n_random: int = 6, seed: int = 0,
                          ffn_points: int = 8) -> list[ArchSpec]:
    """The parent, the smallest servable child, a uniform middle and random children of the hybrid
    search space (per-block options drawn independently), for predicted-vs-measured validation."""
    import random

    from autocompress_nemo.search.space import apply_choices, build_space

    rng = random.Random(seed)
    decisions = build_space(parent, caps, ffn_points)
    out = [parent.replace(name="parent"),
           apply_choices(parent, decisions, [min(1, len(d.options) - 1) for d in decisions]).replace(name="smallest"),
           apply_choices(parent, decisions, [len(d.options) // 2 for d in decisions]).replace(name="middle")]
    for i in range(n_random):
        out.append(apply_choices(parent, decisions, [rng.randrange(len(d.options)) for d in decisions])
                   .replace(name=f"random{i}"))
    return out

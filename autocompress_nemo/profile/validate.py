"""Validation candidates and the predicted-vs-measured report (CSV, JSON, PNG scatter).

Dense candidates (none of them is a profiling model): the parent; uniform shrinks (ffn, KV
groups, query heads, a mix); a model with whole layers removed; random heterogeneous mixes
(per-layer attention options and ffn widths of the search's grid, some blocks removed), each checked
against the engine's capabilities (first layer keeps attention, last keeps ffn, no
attention without ffn on llama.cpp). Hybrid candidates come from the hybrid search space
(``hybrid_candidates``); there the parent is one of the table's profiling models,
so it is measured as the *reference* (``is_reference``: any candidate whose spec hash is among the
table's profiling models): left out of the errors, and used to measure how much the machine's speed
changed since profiling (``drift_scale``).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.config.engine import capabilities_of
from autocompress_nemo.costs.engines.base import capability_problems
from autocompress_nemo.costs.profile.grid import dense_options

METRICS = ("prefill_ms", "decode_ms", "response_latency_ms", "memory_bytes")


def _layered(parent: ArchSpec, layers: list[tuple[AttentionBlock, MlpBlock]], name: str) -> ArchSpec:
    return parent.replace(blocks=tuple(b for layer in layers for b in layer), name=name)


def candidates(parent: ArchSpec, caps: Any, n_random: int = 8, seed: int = 0, ffn_points: int = 8) -> list[ArchSpec]:
    """Parent, uniform shrinks, layer-removed and random heterogeneous models the engine serves.

    Attention options and ffn widths are the search's own (``costs.profile.grid.dense_options``:
    what the search can return, what the table was profiled at); ``caps`` are the capabilities the
    search runs under.
    """
    if not parent.is_dense_layered():  # MoE / Mamba hybrids: children drawn from the hybrid search space
        return hybrid_candidates(parent, caps, min(n_random, 6), seed, ffn_points)
    caps = capabilities_of(caps)
    rng = random.Random(seed)
    layers = parent.layers()
    a_p, m_p = layers[0]
    attn, ffns = dense_options(parent, caps, ffn_points)
    grid = [m.ffn for m in ffns]

    def w(frac: float) -> int:
        return min(grid, key=lambda g: abs(g - m_p.ffn * frac))

    out = [parent.replace(name="parent")]
    if caps.vary_ffn:
        out += [
            _layered(parent, [(a_p, MlpBlock(w(f), m_p.activation))] * len(layers), f"uniform_ffn{w(f)}")
            for f in (0.75, 0.5)
        ]
    smaller = [a for a in attn if a != a_p]
    if smaller:
        mid = smaller[len(smaller) // 2]
        out.append(_layered(parent, [(mid, m_p)] * len(layers), f"uniform_{mid.num_heads}h{mid.num_kv_groups}g"))
        out.append(
            _layered(
                parent,
                [(smaller[-1], MlpBlock(w(0.66), m_p.activation))] * len(layers),
                f"uniform_{smaller[-1].num_heads}h_ffn{w(0.66)}",
            )
        )
    if caps.remove_attention and caps.remove_mlp:
        drop = set(rng.sample(range(1, len(layers) - 1), k=max(1, len(layers) // 5)))
        empty = (AttentionBlock(0, 0, a_p.head_dim), MlpBlock(0, m_p.activation))
        out.append(
            _layered(parent, [empty if i in drop else (a_p, m_p) for i in range(len(layers))], f"drop{len(drop)}layers")
        )
    tries = 0
    while len(out) < 5 + n_random + 1 and tries < 1000:
        tries += 1
        mix = []
        for i in range(len(layers)):
            a = rng.choice(attn)
            if caps.remove_attention and rng.random() < 0.2:
                a = AttentionBlock(0, 0, a_p.head_dim)
            ffn = rng.choice(grid)
            if caps.remove_mlp and rng.random() < 0.12:
                ffn = 0
            if i == 0 and caps.first_block_full:
                a = a if not a.removed else a_p
            mix.append((a, MlpBlock(ffn, m_p.activation)))
        spec = _layered(parent, mix, f"mix{len(out)}")
        if not capability_problems(spec, caps, parent):
            out.append(spec)
    return out


def hybrid_candidates(
    parent: ArchSpec, caps: Any, n_random: int = 6, seed: int = 0, ffn_points: int = 8
) -> list[ArchSpec]:
    """The parent, the smallest servable child, a uniform middle and random children of the hybrid
    search space (per-block options drawn independently), for predicted-vs-measured validation."""
    from autocompress_nemo.search.space import apply_choices, build_space

    rng = random.Random(seed)
    decisions = build_space(parent, caps, ffn_points)
    out = [
        parent.replace(name="parent"),
        apply_choices(parent, decisions, [min(1, len(d.options) - 1) for d in decisions]).replace(name="smallest"),
        apply_choices(parent, decisions, [len(d.options) // 2 for d in decisions]).replace(name="middle"),
    ]
    for i in range(n_random):
        choice = [rng.randrange(len(d.options)) for d in decisions]
        out.append(apply_choices(parent, decisions, choice).replace(name=f"random{i}"))
    return out


def is_reference(spec: ArchSpec, table: Any) -> bool:
    """True when ``spec`` is a model the table was profiled from (``provenance.profile_model_hashes``;
    older hybrid tables: the parent, their base run). Such a model is left out of the errors."""
    from autocompress_nemo.costs.table import spec_hash

    h = spec_hash(spec)
    hashes = table.provenance.get("profile_model_hashes")
    if hashes is not None:
        return h in set(hashes)
    method = (table.provenance.get("profile") or {}).get("method")
    return method == "hybrid_append" and h == table.provenance.get("parent")


def profiled_time(spec: ArchSpec, table: Any) -> dict[str, float] | None:
    """The times the table's own run of ``spec`` measured at profiling (``None`` if it has none)."""
    from autocompress_nemo.costs.table import spec_hash

    h = spec_hash(spec)
    for r in table.runs:
        if r.get("spec_hash") == h or (
            r.get("spec_hash") is None and r.get("name") == "base" and h == table.provenance.get("parent")
        ):
            return {p: float(r[p]) for p in ("prefill_ms", "decode_ms")}
    return None


def errors(
    rows: list[dict[str, Any]], scale: dict[str, float] | None = None, measured: str = "meas"
) -> dict[str, dict[str, float]]:
    """Per metric: mean absolute % error, max absolute % error, mean signed % error, over the rows
    that are not a reference (``row['reference']``: a model the table was built from).

    ``scale``: per-metric factors applied to the predictions first (``drift_scale``), e.g. to
    separate the cost model's error from a change of the machine's speed since profiling.
    ``measured``: the column prefix of the measurement: ``meas`` (the ratio to the reference timed
    in the same rounds, in the table's reference times) or ``abs`` (the model's own absolute time)."""
    out: dict[str, dict[str, float]] = {}
    rows = [r for r in rows if not r.get("reference") and f"{measured}_decode_ms" in r]
    for m in METRICS:
        f = (scale or {}).get(m, 1.0)
        k = f"{measured}_{m}"
        errs = [100.0 * (f * r[f"pred_{m}"] - r[k]) / r[k] for r in rows if r[k]]
        if errs:
            out[m] = {
                "mape": sum(abs(e) for e in errs) / len(errs),
                "max_ape": max(abs(e) for e in errs),
                "bias": sum(errs) / len(errs),
                "n": len(errs),
            }
    return out


def drift_scale(reference: dict[str, Any] | None, output_len: int) -> dict[str, float]:
    """Machine-speed change since profiling, from a reference model timed in both sessions (a
    profiling model, typically the parent): ``s_p = T_now(ref) / T_table(ref)`` per phase ``p``, where
    ``T_table`` is the reference's time measured at profiling (``table_<p>``; the table's prediction
    when the row has none); response latency ``(s_pf * pf + O * s_dc * dc) / (pf + O * dc)`` of the
    reference; memory 1. Empty without a reference. Predictions x ``s`` = what the table would say had
    it been built at today's machine speed; the error left is the cost model's own."""
    if not reference:
        return {}
    then = {p: reference.get(f"table_{p}", reference[f"pred_{p}"]) for p in ("prefill_ms", "decode_ms")}
    s = {p: reference[f"meas_{p}"] / then[p] for p in ("prefill_ms", "decode_ms")}
    pf, dc = then["prefill_ms"], then["decode_ms"]
    s["response_latency_ms"] = (s["prefill_ms"] * pf + output_len * s["decode_ms"] * dc) / (pf + output_len * dc)
    s["memory_bytes"] = 1.0
    return s


def write_report(rows: list[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """``validation.csv``, ``validation.json`` and ``validation.png`` (predicted vs measured per metric)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "validation.csv", "json": out_dir / "validation.json", "png": out_dir / "validation.png"}
    keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
    with open(paths["csv"], "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        for r in rows:
            wr.writerow({k: r.get(k, "") for k in keys})
    paths["json"].write_text(json.dumps({"summary": summary, "rows": rows}, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 4))
    for ax, m in zip(axes, METRICS, strict=True):
        scale = 2**20 if m == "memory_bytes" else 1.0
        xs = [r[f"meas_{m}"] / scale for r in rows]
        ys = [r[f"pred_{m}"] / scale for r in rows]
        ax.scatter(xs, ys, s=18)
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        e = summary["errors"].get(m, {})
        unit = "MiB" if m == "memory_bytes" else "ms"
        ax.set_title(f"{m}: MAPE {e.get('mape', float('nan')):.2f}%", fontsize=9)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
    fig.suptitle(
        f"{summary['target']} / {summary['engine']}: predicted vs measured ({summary['label']}), "
        f"{summary.get('models', len(rows))} models not used for the table"
        + (f" (+ reference {summary['reference']})" if summary.get("reference") else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    return paths

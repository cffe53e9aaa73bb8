"""The cost table of a hybrid parent (MoE / Mamba / attention / MLP blocks in any order).

``engine.settings.profile_method`` picks the design:

- ``fit`` (default for measured engines, ``fit.py``): per-block costs and the constant per forward
  fitted by non-negative least squares to ``N`` children of the search space plus the parent, in
  one interleaved session.
- ``differences`` (default for estimated engines, exact there; ``differences.py``): one difference
  of two models per option.

Memory constants come from the parent's run in both. Provenance records the method, every
profiling model's spec hash (``profile_model_hashes``: validation leaves those models out) and,
for ``fit``, the fit's residuals (``fit``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import Engine, Workload
from autocompress_nemo.costs.memory import conv_extra_columns, weight_bytes
from autocompress_nemo.costs.profile.differences import hybrid_differences
from autocompress_nemo.costs.profile.fit import hybrid_fit
from autocompress_nemo.costs.profile.grid import profile_options
from autocompress_nemo.costs.profile.pairs import kv_tokens
from autocompress_nemo.costs.profile.provenance import reference_record, table_provenance
from autocompress_nemo.costs.table import PHASES, CostTable, spec_hash

METHODS = ("fit", "differences")


def build_hybrid_table(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    *,
    caps: Any,
    ffn_points: int,
    log: Callable[[str], None],
) -> CostTable:
    """Cost table of a hybrid parent over the search's options (``grid.profile_options``)."""
    method = engine.settings.profile_method or ("differences" if engine.estimated else "fit")
    if method not in METHODS:
        raise ValueError(f"engine.settings.profile_method={method!r}: use {' or '.join(METHODS)}")
    options = profile_options(parent, caps, ffn_points)
    t_start = time.time()
    if method == "fit":
        specs, results, blocks, intercept, runs, extra = hybrid_fit(
            engine, parent, workload, options, caps, ffn_points, log
        )
    else:
        specs, results, blocks, intercept, runs, extra = hybrid_differences(engine, parent, workload, options, log)
    base = results[0]  # the parent, in both designs
    dtype = str(engine.cfg.dtype)
    norm_dtype = engine.norm_dtype(dtype)
    comp = [m.memory.get("compute", 0.0) for m in results]
    memory = {
        "output_bytes": base.memory.get("output", 0.0),
        "compute_bytes": [],
        "compute_base_bytes": base.memory.get("compute", 0.0),
        "compute_range": [min(comp), max(comp)],
        "compute_median_bytes": float(np.median(comp)) if comp else 0.0,
        "weights_overhead_bytes": base.memory.get("weights", 0.0) - weight_bytes(parent, dtype, norm_dtype),
        # KV cells the engine allocates for B x C tokens (llama.cpp: a multiple of 256)
        "kv_tokens": kv_tokens(base, parent, workload, str(engine.cfg.kv_dtype), engine.kv_cell_align)
        if engine.kv_cell_align
        else workload.context_len * workload.batch,
        "norm_dtype": norm_dtype,
        # conv-state columns beyond K-1 that the engine keeps (transformers: K), from the base's state
        "conv_extra": conv_extra_columns(parent, workload.batch, "f32", base.memory.get("state", 0.0))
        if not base.estimated
        else 0,
    }
    settings = dataclasses.asdict(engine.settings)
    settings.update(
        {"percentile": float(engine.cfg.percentile), "method": f"hybrid_{method}", **extra.pop("settings", {})}
    )
    prov = table_provenance(
        engine,
        workload,
        parent,
        len(specs),
        t_start,
        settings,
        profile_model_hashes=sorted({spec_hash(s) for s in specs}),
        **reference_record(results, log),
        **extra,
    )
    log(
        f"[profile] hybrid table ({method}): {len(blocks)} block options; intercept prefill "
        f"{intercept['prefill_ms']:.3f} ms, decode {intercept['decode_ms']:.3f} ms; {time.time() - t_start:.0f} s"
    )
    return CostTable(
        provenance=prov,
        parent=parent,
        intercept=intercept,
        layer_overhead={p: 0.0 for p in PHASES},
        blocks=blocks,
        memory=memory,
        runs=runs,
    )

"""Build a cost table by profiling models inside the real engine (DESIGN.md section 3), one module per design.

- ``grid``: the options profiled — the search's own (``search/space.py``), so the table covers
  every option the search can return; the profiler imports the search, never the reverse;
- ``pairs``: uniform Llama-style parents, one slope of two ``[full, X * k, full]`` models per option;
- ``differences``: hybrid parents, one difference of two models per option (``k`` copies spread in);
- ``fit``: hybrid parents, per-block costs by least squares over balanced children of the search space;
- ``hybrid``: the hybrid table (picks ``differences`` or ``fit``, memory constants, provenance);
- ``provenance``: what a table records and what must match when it is loaded.

``build_table`` picks the design from the parent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.costs.engines.base import Engine, Workload
from autocompress_nemo.costs.table import CostTable


def build_table(
    engine: Engine,
    parent: ArchSpec,
    workload: Workload,
    *,
    ffn_points: int = 8,
    caps: Any = None,
    log: Callable[[str], None] | None = None,
) -> CostTable:
    """Profile every option of ``parent`` in ``engine`` under ``workload`` and return the table.

    ``caps``: the capabilities the search runs under (``config.resolve.search_capabilities``;
    default the engine's own); ``ffn_points``: ``search.ffn_options``. Both define the option grid."""
    from autocompress_nemo.costs.profile.hybrid import build_hybrid_table
    from autocompress_nemo.costs.profile.pairs import build_pairs_table

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    caps = engine.capabilities if caps is None else caps
    build = build_pairs_table if parent.is_dense_layered() else build_hybrid_table
    return build(engine, parent, workload, caps=caps, ffn_points=ffn_points, log=log)


__all__ = ["build_table"]

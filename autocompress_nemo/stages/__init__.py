"""The pipeline's stages: one module per stage, each declaring what it reads.

Every stage module defines ``STAGE`` (a :class:`Stage`: its name, the config keys it reads and
the stages whose artifacts it consumes) and a ``run(ctx, out, ...)`` that writes the artifact into
``out`` (file names: ``stages/layout.py``). The pipeline (``search/__main__.py``) derives each
stage's cache key from ``STAGE.reads`` and the checksums of its inputs, and hands the stage a
:class:`~autocompress_nemo.context.Context` whose config holds *only* the declared keys: a stage
that reads an undeclared key fails at once (``ConfigAttributeError``) instead of silently reusing
an artifact made with another value. Reads through the context count: the parent
(``ctx.parent``: ``model``, ``seed``), Megatron models (``ctx.model``: the parallel layout
``cluster.tp/pp/ep/backend/sequence_parallel`` and ``seed``) and token batches (``ctx.batch_at``,
``ctx.heldout_batches``: ``data``).

    profile -> validate -> rank -> search_<m> -> extract_<m> -> reconstruct_<m> -> distill_<m> -> export_<m>
        -> evaluate -> report          (autocompress --graph)
"""

from __future__ import annotations

from autocompress_nemo.stages.declare import ALWAYS, DATA, LAYOUT, PARENT, Stage, reads

__all__ = ["ALWAYS", "DATA", "LAYOUT", "PARENT", "Stage", "all_stages", "reads"]


def all_stages() -> list[Stage]:
    """Every stage's declaration, in pipeline order (``stages/graph.py``)."""
    from autocompress_nemo.stages.graph import stages

    return list(stages())

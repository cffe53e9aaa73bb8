"""The option grid a cost table is profiled at: the search's own options, never a grid of its own.

``search/space.py`` (``build_space``: each block kind's options, ``blocks/``) is the single
source of the options a block may take; profiling and validation read them from there, so the table holds an entry for every
option the search can return. The profiler imports the search space, never the reverse.
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MlpBlock
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.search.space import build_space


def profile_options(parent: ArchSpec, caps: Any, ffn_points: int) -> list[Block]:
    """Distinct block options to profile: every non-removed option of the search space
    (``build_space(parent, caps, ffn_points)``) and every parent block, MoE blocks as their parts
    (``Kind.parts``), in order of first appearance."""
    out: list[Block] = []
    for d in build_space(parent, caps, ffn_points):
        out += [o for o in d.options if not o.removed and o not in out]
    for b in parent.blocks:
        for p in kind_of(b).parts(b):
            if not p.removed and p not in out:
                out.append(p)
    return out


def dense_options(parent: ArchSpec, caps: Any, ffn_points: int) -> tuple[list[AttentionBlock], list[MlpBlock]]:
    """A uniform Llama-style parent's options (``profile_options``): attention options ordered by
    (query heads, KV groups) and mlp options by width, each ascending and holding the parent's."""
    opts = profile_options(parent, caps, ffn_points)
    attn = sorted((o for o in opts if isinstance(o, AttentionBlock)), key=lambda b: (b.num_heads, b.num_kv_groups))
    mlp = sorted((o for o in opts if isinstance(o, MlpBlock)), key=lambda b: b.ffn)
    return attn, mlp

"""The block-kind registry (``blocks/``): it covers every block kind ``ArchSpec`` knows, a kind
missing part of the interface cannot be built, and an unknown kind is named with the known ones."""

from __future__ import annotations

import pytest

from autocompress_nemo.arch.spec import _BLOCK_TYPES
from autocompress_nemo.blocks import BY_DECISION, KINDS, kind_of
from autocompress_nemo.blocks.base import Kind


def test_every_block_kind_of_the_spec_is_registered() -> None:
    assert set(KINDS) == set(_BLOCK_TYPES)
    for name, k in KINDS.items():
        assert k.block_type is _BLOCK_TYPES[name]
        assert all(BY_DECISION[dk] is k for dk in k.decision_kinds)


def test_a_kind_missing_a_method_cannot_be_built() -> None:
    class Half(Kind):
        name = "half"

        def decisions(self, spec, i, block, caps, grid):  # noqa: ANN001, ANN201
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown block kind 'conv'.*attention"):
        kind_of("conv")

"""Nemotron-H "Puzzle" (``model_type: nemotron_h_puzzle``) configuration, written by autocompress-nemo.

The global fields of ``NemotronHConfig`` plus ``block_configs``, one entry per layer with its
``block_type`` (``mamba | attention | mlp | moe``) and the fields that override the global ones
for that layer, read as attributes (``config.block_configs[i].block_type``,
``config.block_configs[i].n_routed_experts``); a key absent from ``config.json`` is absent as an
attribute too. ``get_nemotron_h_config_for_layer(i)`` gives a plain ``NemotronHConfig`` with
layer ``i``'s fields applied: vLLM's ``nemotron_h.py`` builds every attention, MLP and MoE layer
from it (Mamba layers read the global config).

This file imports only ``transformers``: it is loaded as remote code (``trust_remote_code=True``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from transformers import NemotronHConfig

_PATTERN = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def _namespace(d: Any) -> SimpleNamespace:
    return d if isinstance(d, SimpleNamespace) else SimpleNamespace(**dict(d))


class NemotronHPuzzleConfig(NemotronHConfig):
    model_type = "nemotron_h_puzzle"

    def __init__(
        self,
        block_configs: list[Any] | None = None,
        mtp_block_configs: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        blocks = [_namespace(b) for b in (block_configs or [])]
        if blocks and not kwargs.get("hybrid_override_pattern") and not kwargs.get("layers_block_type"):
            kwargs["hybrid_override_pattern"] = "".join(_PATTERN[b.block_type] for b in blocks)
        super().__init__(**kwargs)
        self.block_configs = blocks
        self.mtp_block_configs = [_namespace(b) for b in (mtp_block_configs or [])]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["block_configs"] = [dict(vars(b)) for b in getattr(self, "block_configs", [])]
        out["mtp_block_configs"] = [dict(vars(b)) for b in getattr(self, "mtp_block_configs", [])]
        return out

    def get_nemotron_h_config_for_layer(self, layer_idx: int) -> NemotronHConfig:
        """A ``NemotronHConfig`` of the global fields with layer ``layer_idx``'s fields applied."""
        d = self.to_dict()
        for key in ("block_configs", "mtp_block_configs", "auto_map", "architectures", "model_type"):
            d.pop(key, None)
        block = {k: v for k, v in vars(self.block_configs[layer_idx]).items() if k != "block_type"}
        unknown = {k: v for k, v in block.items() if k not in d}
        d.update({k: v for k, v in block.items() if k in d})
        cfg = NemotronHConfig.from_dict(d)
        for k, v in unknown.items():
            setattr(cfg, k, v)
        if getattr(self, "_attn_implementation", None) is not None:
            cfg._attn_implementation = self._attn_implementation
        return cfg

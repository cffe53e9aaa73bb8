"""Tiny hybrid / MoE specs shared by the hybrid tests."""

from __future__ import annotations

from pathlib import Path

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock

CONF = Path(__file__).resolve().parents[1] / "autocompress_nemo" / "conf" / "model"


def conf_spec(name: str) -> ArchSpec:
    """The ArchSpec of ``conf/model/<name>.yaml`` (tiny_hybrid: ``M*EME-``, tiny_moe: ``*E*E*E*E``)."""
    from omegaconf import OmegaConf

    from autocompress_nemo.arch.from_config import spec_from_model_config

    return spec_from_model_config(OmegaConf.load(CONF / f"{name}.yaml"))


def hetero_hybrid_spec() -> ArchSpec:
    """Per-block shapes everywhere: Mamba heads 4 / 2 / removed, experts 4 / 2, expert ffn 64 / 32,
    top-k 2 / 2 of 2, shared ffn 64 / 0, one MoE block with only its shared expert, a removed
    attention block and a removed MLP block. Expert counts are even (EP=2)."""
    A, M, E, F = AttentionBlock, MambaBlock, MoeBlock, MlpBlock
    blocks = (
        M(4, 16, 16, 2),
        A(4, 2, 16),
        E(4, 64, 2, 64, 0, "relu2"),
        M(2, 16, 16, 2),
        E(2, 32, 2, 0, 0, "relu2"),
        F(96, "relu2"),
        A(0, 0, 16),
        E(0, 0, 2, 48, 0, "relu2"),
        M(0, 16, 16, 2),
        F(0, "relu2"),
        A(2, 1, 16),
        E(4, 48, 2, 32, 0, "relu2"),
    )
    return ArchSpec(hidden=64, vocab=256, blocks=blocks, family="nemotron_h", name="tiny_hetero_hybrid")


# Every hybrid decision an engine could serve (top-k, block removal included), ffn aligned to 16.
ALL_CAPS = {
    "vary_query_heads": True,
    "vary_kv_groups": True,
    "vary_ffn": True,
    "remove_attention": True,
    "remove_mlp": True,
    "vary_experts": True,
    "vary_expert_ffn": True,
    "vary_shared_ffn": True,
    "vary_top_k": True,
    "vary_mamba_heads": True,
    "remove_mamba": True,
    "remove_moe": True,
    "ffn_align": 16,
}


def ids(spec: ArchSpec, T: int = 12, B: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (B, T), generator=torch.Generator().manual_seed(seed))


requires_mamba = __import__("pytest").mark.skipif(
    __import__("importlib.util").util.find_spec("mamba_ssm") is None,
    reason="Mamba blocks need mamba-ssm (install: autocompress_nemo/models/hybrid/builder.py MAMBA_INSTALL)",
)


def transformers_nemotron_h(spec: ArchSpec, sd: dict[str, torch.Tensor]):  # noqa: ANN201
    """An independent reference: transformers' ``NemotronHForCausalLM`` with per-block configs.

    The compacted spec's uniform config builds the model; each block whose Puzzle entry overrides
    a field is rebuilt as ``NemotronHBlock`` from a copy of the config with those fields (what
    vLLM's ``get_nemotron_h_config_for_layer`` does). Weights are converted to transformers'
    in-memory layout (``model.`` prefix, experts stacked into ``[E, out, in]``). Mamba ops are
    transformers' pure-PyTorch ones (the caller patches the module, see test_nemotron_h_parity).
    """
    import copy

    import transformers.models.nemotron_h.modeling_nemotron_h as mn

    from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec
    from autocompress_nemo.models.nemotron_h.hf_io import compact_state_dict

    cspec, csd = compact_state_dict(spec, sd)
    cfg = hf_config_from_spec(cspec)
    blocks = cfg.pop("block_configs", None) or [{} for _ in cspec.blocks]
    for k in ("architectures", "model_type", "mtp_block_configs", "num_nextn_predict_layers"):
        cfg.pop(k, None)
    config = mn.NemotronHConfig(**cfg)
    config._attn_implementation = "eager"
    model = mn.NemotronHForCausalLM(config)
    for i, over in enumerate(blocks):
        fields = {k: v for k, v in over.items() if k != "block_type"}
        if fields:
            lc = copy.deepcopy(config)
            for k, v in fields.items():
                setattr(lc, k, v)
            model.model.layers[i] = mn.NemotronHBlock(lc, i)
            if over.get("moe_shared_expert_intermediate_size") == 0:
                # transformers builds a shared expert of width `intermediate_size` when this is 0
                # (`intermediate_size or config.intermediate_size`); a block without one adds zero
                model.model.layers[i].mixer.shared_experts = _Zero()
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in csd.items():
        k = k.replace("backbone.", "model.", 1)
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            j = parts.index("experts")
            fused = ".".join(parts[: j + 1] + [parts[j + 2]])
            experts.setdefault(fused, {})[int(parts[j + 1])] = v
        else:
            state[k] = v
    state.update({k: torch.stack([d[e] for e in sorted(d)]) for k, d in experts.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("e_score_correction_bias") or m in state]
    empty = {n for n, p in model.named_parameters() if p.numel() == 0}
    assert not unexpected and set(missing) <= empty, (missing, unexpected)
    return model.eval()


class _Zero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

"""Megatron ``TransformerConfig``s of a hybrid / MoE ArchSpec: one for the model, one per block.

Megatron's ``HybridStack`` builds every layer from one config; per-block shapes (experts,
expert ffn, top-k, shared-expert width, latent size, dense ffn, query heads / KV groups,
Mamba heads) are obtained here by copying the model config with that block's fields
(``dataclasses.replace``, which re-runs Megatron's validation for every block).

Family conventions (``spec.family``; ``spec.extra`` may override):

- ``nemotron_h``: no position embedding; squared-ReLU (non-gated) MLP and experts; sigmoid
  router with a selection-only expert bias (``e_score_correction_bias``), top-k weights
  normalized (``norm_topk_prob``; Megatron normalizes for top-k > 1), scaled by
  ``routed_scaling_factor``; optional group-limited routing (``n_group`` / ``topk_group``).
- ``qwen3_moe``: RoPE, q/k RMSNorm, SwiGLU experts, softmax router (top-k of the logits then
  softmax over the k = normalized top-k probabilities; ``norm_topk_prob=False`` uses
  softmax-then-top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.models.megatron import activation, common_config


@dataclass(frozen=True)
class FamilyOptions:
    position_embedding: str  # "none" | "rope"
    qk_layernorm: bool
    router_score: str  # "sigmoid" | "softmax"
    expert_bias: bool
    pre_softmax: bool
    scaling_factor: float | None
    num_groups: int | None
    group_topk: int | None
    mamba_chunk_size: int


def family_options(spec: ArchSpec) -> FamilyOptions:
    x = spec.extra
    groups = int(x.get("n_group", 1) or 1)
    if spec.family == "nemotron_h":
        scale = float(x.get("routed_scaling_factor", 1.0))
        return FamilyOptions(
            position_embedding=str(x.get("position_embedding", "none")),
            qk_layernorm=False,
            router_score="sigmoid",
            expert_bias=True,
            pre_softmax=False,
            scaling_factor=None if scale == 1.0 else scale,
            num_groups=groups if groups > 1 else None,
            group_topk=int(x.get("topk_group", 1)) if groups > 1 else None,
            mamba_chunk_size=int(x.get("mamba_chunk_size", 128)),
        )
    if spec.family == "qwen3_moe":
        return FamilyOptions(
            position_embedding="rope",
            qk_layernorm=spec.qk_norm,
            router_score="softmax",
            expert_bias=False,
            pre_softmax=not bool(x.get("norm_topk_prob", True)),
            scaling_factor=None,
            num_groups=None,
            group_topk=None,
            mamba_chunk_size=128,
        )
    raise ValueError(
        f"ArchSpec {spec.name!r}: family {spec.family!r} is not a hybrid/MoE family (nemotron_h, qwen3_moe)"
    )


def _first(spec: ArchSpec, kind: str) -> Any:
    return next((b for b in spec.blocks if b.kind == kind and not b.removed), None)


def _parallel_sizes() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 1, 1, 1
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )


def check_shardable(spec: ArchSpec, tp: int, ep: int, etp: int) -> None:
    """Raise one ``ValueError`` naming every block that cannot be split at these sizes."""
    from autocompress_nemo.blocks import kind_of

    problems = [
        f"block {i}: {why}"
        for i, b in enumerate(spec.blocks)
        if not b.removed and (why := kind_of(b).shard_problem(b, tp, ep, etp))
    ]
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems) + " (choose sizes that divide them)")


def model_config(
    spec: ArchSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    use_te: bool = False,
    **overrides: Any,
) -> Any:
    """The model-level ``TransformerConfig`` (the shapes of the first block of each kind)."""
    from megatron.core.transformer import TransformerConfig

    fam = family_options(spec)
    tp, pp, ep, etp = _parallel_sizes()
    check_shardable(spec, tp, ep, etp)
    att: AttentionBlock | None = _first(spec, "attention")
    mlp: MlpBlock | None = _first(spec, "mlp")
    moe: MoeBlock | None = next(
        (b for b in spec.blocks if isinstance(b, MoeBlock) and b.num_experts and b.expert_ffn), None
    )
    mamba: MambaBlock | None = _first(spec, "mamba")
    act_name = (
        mlp.activation if mlp else moe.activation if moe else "relu2" if spec.family == "nemotron_h" else "swiglu"
    )
    act, gated = activation(act_name)
    head_dim = next((b.head_dim for b in spec.blocks if isinstance(b, AttentionBlock)), spec.hidden // 8 or 1)
    cfg: dict[str, Any] = dict(
        num_layers=len(spec.blocks),
        hidden_size=spec.hidden,
        num_attention_heads=att.num_heads if att else tp,
        num_query_groups=att.num_kv_groups if att else tp,
        kv_channels=head_dim,
        ffn_hidden_size=mlp.ffn if mlp else 4 * spec.hidden,
        activation_func=act,
        gated_linear_unit=gated,
        add_qkv_bias=False,
        qk_layernorm=fam.qk_layernorm,
        **common_config(spec, params_dtype, tp, pp, sequence_parallel),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # Mamba-2: the fused conv+scan+norm kernel has no CPU reference (compat_cpu patch 4)
        use_mamba_mem_eff_path=torch.cuda.is_available(),
    )
    if mamba is not None:
        cfg.update(
            mamba_num_heads=mamba.num_heads,
            mamba_head_dim=mamba.head_dim,
            mamba_state_dim=mamba.state_size,
            mamba_num_groups=mamba.num_groups,
        )
    if moe is not None:
        cfg.update(
            num_moe_experts=moe.num_experts,
            moe_ffn_hidden_size=moe.expert_ffn,
            moe_router_topk=moe.top_k,
            moe_shared_expert_intermediate_size=moe.shared_ffn or None,
            moe_latent_size=moe.latent or None,
            moe_router_score_function=fam.router_score,
            moe_router_enable_expert_bias=fam.expert_bias,
            moe_router_pre_softmax=fam.pre_softmax,
            moe_router_topk_scaling_factor=fam.scaling_factor,
            moe_router_num_groups=fam.num_groups,
            moe_router_group_topk=fam.group_topk,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=use_te,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            moe_shared_expert_overlap=False,
        )
    else:
        # no routed experts anywhere (e.g. a student whose MoE blocks were all removed): nothing to
        # shard over EP; the layout's EP ranks hold replicas like data-parallel ranks
        cfg["expert_model_parallel_size"] = 1
    cfg.update(overrides)
    return TransformerConfig(**cfg)

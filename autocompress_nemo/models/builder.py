"""Build a Megatron-core model from an ArchSpec, and run it to full-vocabulary logits.

Legend: B batch, T sequence length, V vocabulary, H hidden.

Dense Llama-style models (RMSNorm, SwiGLU, RoPE, GQA, no biases, tied or untied
embeddings) are Megatron ``GPTModel``s with **per-layer** shapes: every layer has its own
query heads, KV groups and ffn width, and its attention or mlp may be removed (a no-op
that adds nothing to the residual stream). Head dim and hidden size are global.

How per-layer shapes are built: Megatron's ``HeterogeneousTransformerConfig`` (the
DeciLM / Nemotron-NAS ``block_configs``) varies KV groups and ffn width per layer and
has no-op blocks, but not query heads. ``PerLayerTransformerConfig`` extends it: each
block config's attention entry may carry ``num_attention_heads`` (an extension field,
ignored by Megatron's own parser), applied in ``get_config_for_layer``, which
``TransformerBlock`` calls for every layer. The layer specs are built here, one per
layer, with ``IdentityOp`` for removed blocks — local (pure Megatron) modules on CPU,
Transformer Engine modules when TE is importable and CUDA is present (``impl`` switch).

Module names are Megatron's: ``embedding.word_embeddings``,
``decoder.layers[i].{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}``, ``decoder.final_layernorm``,
``output_layer``. (With TE the two layer norms are fused into ``linear_qkv`` /
``linear_fc1`` as ``layer_norm_weight``.)

MoE / hybrid Mamba: ``build_model`` dispatches on the block kinds; those families get
their own ``_build_*`` function (MoE as an mlp-slot spec, hybrids on ``HybridModel``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock
from autocompress_nemo.models import compat_cpu
from autocompress_nemo.models.megatron import (  # noqa: F401  (forward_logits, padded_vocab: this module's API)
    Impl,
    _megatron,
    _zero_padded_vocab_rows,
    common_config,
    forward_logits,
    padded_vocab,
    resolve_impl,
    te_available,
)


# ---------------------------------------------------------------------------------------------
# per-layer config
# ---------------------------------------------------------------------------------------------
def block_configs(spec: ArchSpec) -> list[dict[str, Any]]:
    """DeciLM-style ``block_configs`` of a Llama-style spec, in Megatron's explicit form.

    attention: ``{no_op, num_query_groups, num_attention_heads}``; mlp (key ``ffn``):
    ``{no_op, ffn_hidden_size}``. ``num_attention_heads`` is our extension (per-layer
    query heads); Megatron's parser ignores it.
    """
    out = []
    for att, mlp in spec.layers():
        out.append(
            {
                "attention": {"no_op": True, "replace_with_linear": False, "num_query_groups": None}
                if att.removed
                else {
                    "no_op": False,
                    "replace_with_linear": False,
                    "num_query_groups": att.num_kv_groups,
                    "num_attention_heads": att.num_heads,
                },
                "ffn": {"no_op": True, "replace_with_linear": False, "ffn_hidden_size": None}
                if mlp.removed
                else {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": mlp.ffn},
            }
        )
    return out


def _make_config_class() -> type:
    _, HeterogeneousTransformerConfig = _megatron()
    from megatron.core.transformer import TransformerConfig

    # Megatron's class, imported by _megatron() (after the CPU patches): a variable to mypy
    @dataclass
    class PerLayerTransformerConfig(HeterogeneousTransformerConfig):  # type: ignore[misc,valid-type]
        """Megatron's heterogeneous config plus per-layer query heads.

        ``per_layer_num_attention_heads[i]`` (0 = the global value) overrides
        ``num_attention_heads`` for layer ``i + 1``; it is read from the block configs'
        ``attention.num_attention_heads`` extension field.
        """

        per_layer_num_attention_heads: list[int] = field(init=False)

        def __post_init__(self) -> None:
            super().__post_init__()
            blocks = json.loads(self.heterogeneous_layers_config_encoded_json)["block_configs"]
            self.per_layer_num_attention_heads = [int(b["attention"].get("num_attention_heads") or 0) for b in blocks]

        def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
            cfg = super().get_config_for_layer(layer_number)
            heads = self.per_layer_num_attention_heads[layer_number - 1]
            if heads and heads != cfg.num_attention_heads:
                cfg = dataclasses.replace(cfg, num_attention_heads=heads)
            return cfg

    return PerLayerTransformerConfig


_CONFIG_CLASS: type | None = None


def per_layer_config_class() -> type:
    global _CONFIG_CLASS
    if _CONFIG_CLASS is None:
        _CONFIG_CLASS = _make_config_class()
    return _CONFIG_CLASS


def transformer_config(
    spec: ArchSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    qk_layernorm: bool = False,
    qkv_bias: bool = False,
    **overrides: Any,
) -> Any:
    """The ``PerLayerTransformerConfig`` of a Llama-style spec at the current TP/PP sizes."""
    parallel_state, _ = _megatron()
    layers = spec.layers()
    present = [a for a, _ in layers if not a.removed]
    head_dim = next((a.head_dim for a, _ in layers), spec.hidden // 8)
    if any(a.head_dim != head_dim for a, _ in layers):
        raise ValueError(f"ArchSpec {spec.name!r}: head_dim must be the same in every layer")
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    pp = (
        parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    )
    problems = []
    for i, (att, mlp) in enumerate(layers):
        if not att.removed and (att.num_heads % tp or att.num_kv_groups % tp):
            problems.append(
                f"layer {i}: {att.num_heads} heads / {att.num_kv_groups} KV groups not divisible by TP={tp}"
            )
        if not mlp.removed and mlp.ffn % tp:
            problems.append(f"layer {i}: ffn {mlp.ffn} not divisible by TP={tp}")
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems) + " (choose a TP size that divides them)")
    ref = present[0] if present else AttentionBlock(tp, tp, head_dim)
    ffn0 = next((m.ffn for _, m in layers if not m.removed), 4 * spec.hidden)
    cfg = dict(
        num_layers=len(layers),
        hidden_size=spec.hidden,
        num_attention_heads=ref.num_heads,
        num_query_groups=ref.num_kv_groups,
        kv_channels=head_dim,
        ffn_hidden_size=ffn0,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        **common_config(spec, params_dtype, tp, pp, sequence_parallel),
        heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": block_configs(spec)}),
    )
    cfg.update(overrides)
    return per_layer_config_class()(**cfg)


# ---------------------------------------------------------------------------------------------
# per-layer module specs
# ---------------------------------------------------------------------------------------------
def te_keys_map(attention_removed: bool, mlp_removed: bool) -> dict[str, str]:
    """Checkpoint keys of a local-spec layer renamed to the Transformer Engine spec's.

    With TE the layer norms are fused into the next linear (``TELayerNormColumnParallelLinear``:
    ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local spec has them
    as separate modules (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``). Megatron's own
    local GPT spec (``get_gpt_layer_local_submodules``) and heterogeneous spec
    (``_get_sharded_state_dict_keys_map``) map them the same way, so a checkpoint written on CPU
    loads into a TE-built model and back. Only ``sharded_state_dict`` (dist checkpoints) is
    renamed; ``state_dict()`` keeps the module names."""
    out = {}
    if not attention_removed:
        out["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if not mlp_removed:
        out["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return out


def layer_specs(spec: ArchSpec, config: Any, use_te: bool, vp_stage: int | None = None) -> Any:
    """``TransformerBlockSubmodules`` with one ``TransformerLayer`` spec per layer of this PP stage."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
        get_transformer_layer_offset,
    )

    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TEDotProductAttention,
            TELayerNormColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        norm, qk, col, row, core = (
            IdentityOp,
            TENorm,
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
            TEDotProductAttention,
        )
        final_norm: Any = TENorm
    else:
        norm, qk = compat_cpu.SequenceParallelTorchNorm, compat_cpu.qk_norm
        col, row, core = ColumnParallelLinear, RowParallelLinear, DotProductAttention
        final_norm = compat_cpu.SequenceParallelTorchNorm

    specs = []
    for att, mlp in spec.layers():
        self_attention = (
            ModuleSpec(module=IdentityOp)
            if att.removed
            else ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=col,
                    core_attention=core,
                    linear_proj=row,
                    q_layernorm=qk if config.qk_layernorm else IdentityOp,
                    k_layernorm=qk if config.qk_layernorm else IdentityOp,
                ),
            )
        )
        mlp_spec: Any = (
            IdentityOp
            if mlp.removed
            else functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=col, linear_fc2=row))
        )
        specs.append(
            ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=IdentityOp if att.removed else norm,
                    self_attention=self_attention,
                    self_attn_bda=IdentityFuncOp if att.removed else get_bias_dropout_add,
                    pre_mlp_layernorm=IdentityOp if mlp.removed else norm,
                    mlp=mlp_spec,
                    mlp_bda=IdentityFuncOp if mlp.removed else get_bias_dropout_add,
                    sharded_state_dict_keys_map={} if use_te else te_keys_map(att.removed, mlp.removed),
                ),
            )
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(specs[offset : offset + n], layer_norm=final_norm)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def build_model(
    spec: ArchSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    init_seed: int = 0,
    impl: Impl = "auto",
    qk_layernorm: bool | None = None,
    qkv_bias: bool | None = None,
) -> Any:
    """A Megatron ``GPTModel`` of ``spec`` on this rank, randomly initialized.

    Needs Megatron's parallel state (``autocompress_nemo.distributed.init_distributed``);
    TP/PP sizes come from it. ``init_seed`` makes the initialization reproducible (on CPU
    the full weight is drawn and sliced, so TP=1 and TP=2 get the same model). Family
    options (Qwen3 q/k norms, Qwen2 qkv bias) default from ``spec.family`` /
    ``spec.extra``. The model is in eval mode; the spec is attached as ``model.arch_spec``.
    """
    parallel_state, _ = _megatron()
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel state is not initialized: call "
            "autocompress_nemo.distributed.init_distributed(tp=..., pp=...) first"
        )
    kinds = spec.kinds()
    from autocompress_nemo.models.hybrid import build_hybrid_model, is_hybrid

    if is_hybrid(spec):  # MoE / Mamba blocks, or a nemotron_h / qwen3_moe family: HybridModel
        return build_hybrid_model(
            spec, params_dtype=params_dtype, sequence_parallel=sequence_parallel, init_seed=init_seed, impl=impl
        )
    if kinds <= {"attention", "mlp"} and spec.is_dense_layered():
        model = _build_dense_gpt(spec, params_dtype, sequence_parallel, init_seed, impl, qk_layernorm, qkv_bias)
    else:
        raise NotImplementedError(
            f"ArchSpec {spec.name!r} has blocks {sorted(kinds)} in pattern {spec.pattern!r}: only dense "
            "(attention, mlp) layers are built so far; MoE and hybrid Mamba builders come in a later issue"
        )
    model.arch_spec = spec
    model.blocks_per_layer = 2  # attention 2l and mlp 2l+1 in decoder layer l (models/megatron.block_layers)
    return model.eval()


def _family_flags(spec: ArchSpec, qk_layernorm: bool | None, qkv_bias: bool | None) -> tuple[bool, bool]:
    qk = spec.qk_norm if qk_layernorm is None else qk_layernorm
    bias = spec.qkv_bias if qkv_bias is None else qkv_bias
    return bool(qk), bool(bias)


def _build_dense_gpt(
    spec: ArchSpec,
    params_dtype: torch.dtype,
    sequence_parallel: bool,
    init_seed: int,
    impl: Impl,
    qk_layernorm: bool | None,
    qkv_bias: bool | None,
) -> Any:
    from megatron.core.models.gpt import GPTModel

    parallel_state, _ = _megatron()
    use_te = resolve_impl(impl)
    qk, bias = _family_flags(spec, qk_layernorm, qkv_bias)
    config = transformer_config(
        spec, params_dtype=params_dtype, sequence_parallel=sequence_parallel, qk_layernorm=qk, qkv_bias=bias
    )
    torch.manual_seed(init_seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(init_seed, force_reset_rng=True)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rope = spec.extra.get("rope_scaling") or {}
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_specs(spec, config, use_te),
        vocab_size=padded_vocab(spec.vocab, tp),
        max_sequence_length=spec.max_position,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=rope.get("rope_type") == "llama3",
        rope_scaling_factor=float(rope.get("factor", 8.0)),
    )
    if torch.cuda.is_available():
        model = model.cuda()
    if spec.vocab != padded_vocab(spec.vocab, tp):
        _zero_padded_vocab_rows(model, spec.vocab)
    return model

"""Qwen3-MoE Hugging Face configs and directories <-> ArchSpec + Qwen3-MoE-named state dict.

Only uniform models have a Qwen3-MoE config (every attention block alike, every MoE block
alike, dense layers listed in ``mlp_only_layers`` alike, nothing removed); a heterogeneous
student of a Qwen3-MoE parent has no standard Hugging Face format and is refused with that
reason (export it through the Megatron checkpoint instead).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MlpBlock, MoeBlock
from autocompress_nemo.models.hf_dir import read_hf_dir, write_hf_dir
from autocompress_nemo.models.hybrid.names import QWEN3_MOE
from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf


def hf_config_from_spec(spec: ArchSpec) -> dict[str, Any]:
    """The ``Qwen3MoeForCausalLM`` config.json dict of a uniform Qwen3-MoE spec."""
    atts = {b for b in spec.blocks[0::2]}
    ffns = spec.blocks[1::2]
    moes = {b for b in ffns if isinstance(b, MoeBlock)}
    mlps = {b for b in ffns if isinstance(b, MlpBlock)}
    problems = []
    if len(atts) != 1 or not all(isinstance(b, AttentionBlock) for b in atts):
        problems.append("attention blocks differ")
    if len(moes) != 1 or len(mlps) > 1:
        problems.append("MoE / dense blocks differ (or there is no MoE block)")
    if any(b.removed for b in spec.blocks):
        problems.append("some blocks are removed")
    moe = next(iter(moes)) if moes else None
    if moe is not None and (moe.shared_ffn or moe.latent or moe.activation != "swiglu"):
        problems.append("Qwen3-MoE experts are SwiGLU without shared expert or latent projection")
    if problems:
        raise ValueError(
            f"ArchSpec {spec.name!r} cannot be written as a Qwen3MoeForCausalLM config: "
            + "; ".join(problems)
            + " (a heterogeneous Qwen3-MoE has no standard HF format)"
        )
    att: AttentionBlock = next(iter(atts))  # type: ignore[assignment]
    assert moe is not None
    mlp_only = [i for i, b in enumerate(ffns) if isinstance(b, MlpBlock)]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": len(ffns),
        "num_attention_heads": att.num_heads,
        "num_key_value_heads": att.num_kv_groups,
        "head_dim": att.head_dim,
        "hidden_act": "silu",
        "intermediate_size": next(iter(mlps)).ffn if mlps else moe.expert_ffn,
        "moe_intermediate_size": moe.expert_ffn,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": bool(spec.extra.get("norm_topk_prob", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": mlp_only,
        "rms_norm_eps": spec.norm_eps,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tied_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta,
        "attention_bias": False,
        "use_sliding_window": False,
    }


def spec_from_hf_config(cfg: dict[str, Any], name: str = "") -> ArchSpec:
    """ArchSpec of a ``qwen3_moe`` config dict."""
    if cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"not a Qwen3-MoE config: model_type={cfg.get('model_type')!r}")
    if cfg.get("attention_bias") or cfg.get("use_sliding_window"):
        raise ValueError("Qwen3-MoE config: attention_bias / sliding window are not supported")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    att = AttentionBlock(heads, int(cfg["num_key_value_heads"]), int(cfg.get("head_dim") or hidden // heads))
    step, mlp_only = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    moe = MoeBlock(int(cfg["num_experts"]), int(cfg["moe_intermediate_size"]), int(cfg["num_experts_per_tok"]))
    blocks: list[Block] = []
    for layer in range(int(cfg["num_hidden_layers"])):
        sparse = layer not in mlp_only and moe.num_experts > 0 and (layer + 1) % step == 0
        blocks += [att, moe if sparse else MlpBlock(int(cfg["intermediate_size"]))]
    rope = cfg.get("rope_parameters") or {}
    return ArchSpec(
        hidden=hidden,
        vocab=int(cfg["vocab_size"]),
        blocks=tuple(blocks),
        family="qwen3_moe",
        name=name,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        extra={"norm_topk_prob": bool(cfg.get("norm_topk_prob", False))},
    )


def export_hf(
    spec: ArchSpec,
    model_or_sd: Any,
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path | None:
    """Write a uniform Qwen3-MoE ``spec`` to ``out_dir`` (Megatron model: collective, rank 0 writes)."""
    sd = dict(model_or_sd) if isinstance(model_or_sd, dict) else megatron_to_hf(spec, model_or_sd)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    cfg = hf_config_from_spec(spec)
    if spec.tied_embeddings:
        sd.pop(QWEN3_MOE.lm_head, None)
    return write_hf_dir(out_dir, cfg, sd, spec, tokenizer, dtype)


def load_hf(path: str | os.PathLike[str], tokenizer: bool = True) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
    """``(ArchSpec, float32 Qwen3-MoE-named state dict, tokenizer or None)`` of a directory."""
    cfg, sd, tok = read_hf_dir(path, tokenizer)
    return spec_from_hf_config(cfg, name=Path(path).name), sd, tok

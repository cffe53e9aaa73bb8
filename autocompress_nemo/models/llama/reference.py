"""An independent reference forward for (heterogeneous) Llama ArchSpecs, made of transformers' modules.

``transformers`` has no heterogeneous Llama in its own library (DeciLM is remote code),
so this chains its ``LlamaAttention`` / ``LlamaMLP`` / ``LlamaRMSNorm`` /
``LlamaRotaryEmbedding`` with one ``LlamaConfig`` per layer (that layer's query heads, KV
heads and ffn width), skipping removed blocks. It runs a HF Llama-named state dict
without any of our Megatron code, so it checks the builder and the state-dict adapter
from outside. For uniform models use ``transformers.LlamaForCausalLM`` itself.

Legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec


def _layer_config(spec: ArchSpec, heads: int, kv: int, ffn: int, head_dim: int) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=max(ffn, 1),
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=spec.norm_eps,
        # transformers 5 types LlamaConfig without the rope_theta keyword it still takes (4.x's spelling)
        rope_theta=spec.rope_theta,  # type: ignore[call-arg]
        max_position_embeddings=spec.max_position,
        attention_bias=False,
        mlp_bias=False,
    )
    # set after construction: LlamaConfig's validator wants hidden % heads == 0 even with an explicit head_dim
    cfg.num_attention_heads, cfg.num_key_value_heads = max(heads, 1), max(kv, 1)
    cfg._attn_implementation = "sdpa"
    return cfg


class ReferenceLlama(torch.nn.Module):
    """Heterogeneous Llama from transformers' building blocks; parameter names are HF's."""

    def __init__(self, spec: ArchSpec) -> None:
        from transformers.models.llama import modeling_llama as ml

        super().__init__()
        self.spec = spec
        layers = spec.layers()
        hd = layers[0][0].head_dim
        self.embed_tokens = torch.nn.Embedding(spec.vocab, spec.hidden)
        self.layers = torch.nn.ModuleList()
        for i, (att, mlp) in enumerate(layers):
            cfg = _layer_config(spec, att.num_heads, att.num_kv_groups, mlp.ffn, hd)
            layer = torch.nn.Module()
            if not att.removed:
                layer.input_layernorm = ml.LlamaRMSNorm(spec.hidden, eps=spec.norm_eps)
                layer.self_attn = ml.LlamaAttention(cfg, layer_idx=i)
            if not mlp.removed:
                layer.post_attention_layernorm = ml.LlamaRMSNorm(spec.hidden, eps=spec.norm_eps)
                layer.mlp = ml.LlamaMLP(cfg)
            self.layers.append(layer)
        self.norm = ml.LlamaRMSNorm(spec.hidden, eps=spec.norm_eps)
        self.lm_head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.rotary = ml.LlamaRotaryEmbedding(_layer_config(spec, 1, 1, 1, hd))

    def load_hf(self, hf_sd: dict[str, torch.Tensor]) -> None:
        sd = {k.removeprefix("model."): v for k, v in hf_sd.items()}
        if self.spec.tied_embeddings:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"reference load: missing {missing}, unexpected {unexpected}")

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        B, T = input_ids_BT.shape
        x = self.embed_tokens(input_ids_BT)
        pos = torch.arange(T).unsqueeze(0).expand(B, T)
        cos_sin = self.rotary(x, pos)
        for layer in self.layers:  # torch types a submodule attribute as Tensor | Module
            if hasattr(layer, "self_attn"):
                x = x + layer.self_attn(layer.input_layernorm(x), position_embeddings=cos_sin, attention_mask=None)[0]  # type: ignore[operator]
            if hasattr(layer, "mlp"):
                x = x + layer.mlp(layer.post_attention_layernorm(x))  # type: ignore[operator]
        return self.lm_head(self.norm(x)).float()


def reference_logits(spec: ArchSpec, hf_sd: dict[str, torch.Tensor], input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``spec`` with weights ``hf_sd``, computed by transformers' modules."""
    model = ReferenceLlama(spec).eval()
    model.load_hf(hf_sd)
    with torch.no_grad():
        return model(input_ids_BT)


def random_hf_state_dict(spec: ArchSpec, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random float32 HF Llama-named weights of ``spec`` (norm weights ``1 + 0.2 N(0,1)``, so a
    wrong norm mapping shows). For tests and tiny experiments."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=g)

    H = spec.hidden
    sd = {"model.embed_tokens.weight": rnd(spec.vocab, H), "model.norm.weight": norm(H)}
    if not spec.tied_embeddings:
        sd["lm_head.weight"] = rnd(spec.vocab, H)
    for i, (att, mlp) in enumerate(spec.layers()):
        p = f"model.layers.{i}."
        if not att.removed:
            d = att.head_dim
            sd[p + "input_layernorm.weight"] = norm(H)
            sd[p + "self_attn.q_proj.weight"] = rnd(att.num_heads * d, H)
            sd[p + "self_attn.k_proj.weight"] = rnd(att.num_kv_groups * d, H)
            sd[p + "self_attn.v_proj.weight"] = rnd(att.num_kv_groups * d, H)
            sd[p + "self_attn.o_proj.weight"] = rnd(H, att.num_heads * d)
            if spec.qkv_bias:
                for n, rows in (("q", att.num_heads * d), ("k", att.num_kv_groups * d), ("v", att.num_kv_groups * d)):
                    sd[p + f"self_attn.{n}_proj.bias"] = rnd(rows)
            if spec.qk_norm:
                sd[p + "self_attn.q_norm.weight"] = norm(d)
                sd[p + "self_attn.k_norm.weight"] = norm(d)
        if not mlp.removed:
            sd[p + "post_attention_layernorm.weight"] = norm(H)
            sd[p + "mlp.gate_proj.weight"] = rnd(mlp.ffn, H)
            sd[p + "mlp.up_proj.weight"] = rnd(mlp.ffn, H)
            sd[p + "mlp.down_proj.weight"] = rnd(H, mlp.ffn)
    return sd

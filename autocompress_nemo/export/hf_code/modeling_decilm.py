"""DeciLM (``model_type: nemotron-nas``) model, written by autocompress-nemo: a heterogeneous Llama.

Each layer is transformers' own ``LlamaAttention`` / ``LlamaMLP`` / ``LlamaRMSNorm`` built with that
layer's shape (``DeciLMConfig.layer_shape``: query heads, KV heads, ffn width); a no-op attention or
ffn has no module and no weights, and adds nothing to the residual. Weight names are Llama's
(``model.layers.{i}.self_attn.q_proj.weight`` ...). KV-cache slots are numbered over the layers that
keep attention, so a cache never has an empty first layer.

This file imports only ``torch`` and ``transformers``: it is loaded as remote code
(``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama import modeling_llama as llama

from .configuration_decilm import DeciLMConfig

# transformers renamed the cache argument (``past_key_values`` -> ``cache``, 5.2x): use what is installed
_ATTN_CACHE_KW = "cache" if "cache" in inspect.signature(llama.LlamaAttention.forward).parameters else "past_key_values"
_MASK_CACHE_KW = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
_OUT_CACHE_KW = (
    "cache" if "cache" in getattr(BaseModelOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
)


def _layer_config(config: DeciLMConfig, layer_idx: int) -> DeciLMConfig:
    shape = config.layer_shape(layer_idx)
    cfg = copy.copy(config)
    cfg.num_attention_heads = max(1, shape["num_attention_heads"])
    cfg.num_key_value_heads = max(1, shape["num_key_value_heads"])
    cfg.intermediate_size = max(1, shape["intermediate_size"])
    return cfg


class DeciLMDecoderLayer(nn.Module):
    def __init__(self, config: DeciLMConfig, layer_idx: int, cache_idx: int) -> None:
        super().__init__()
        shape = config.layer_shape(layer_idx)
        cfg = _layer_config(config, layer_idx)
        self.cache_idx = cache_idx
        self.has_attention = shape["num_attention_heads"] > 0
        self.has_ffn = shape["intermediate_size"] > 0
        if self.has_attention:
            self.input_layernorm = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attn = llama.LlamaAttention(cfg, layer_idx=cache_idx)
        if self.has_ffn:
            self.post_attention_layernorm = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = llama.LlamaMLP(cfg)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.has_attention:
            out = self.self_attn(
                self.input_layernorm(hidden_states),
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                **{_ATTN_CACHE_KW: cache},
                **kwargs,
            )[0]
            hidden_states = hidden_states + out
        if self.has_ffn:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMPreTrainedModel(PreTrainedModel):
    config_class = DeciLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeciLMDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    # _init_weights: PreTrainedModel's (it also fills the rotary inv_freq buffer on a meta-device load)


class DeciLMModel(DeciLMPreTrainedModel):
    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        layers, cache_idx = [], 0
        for i in range(config.num_hidden_layers):
            layers.append(DeciLMDecoderLayer(config, i, cache_idx))
            cache_idx += int(layers[-1].has_attention)
        self.layers = nn.ModuleList(layers)
        self.norm = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        rotary = copy.copy(config)
        rotary.num_attention_heads = rotary.num_key_value_heads = 1
        self.rotary_emb = llama.LlamaRotaryEmbedding(config=rotary)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    # transformers types the argument nn.Module; this model's embedding is an nn.Embedding
    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            # torch types arange(...) as Tensor, never LongTensor
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)  # type: ignore[assignment]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_MASK_CACHE_KW: cache},
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask, cache, position_ids=position_ids, **kwargs)
        # the cache field's name is the installed transformers' (_OUT_CACHE_KW), which mypy cannot match
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{_OUT_CACHE_KW: cache})  # type: ignore[arg-type]


class DeciLMForCausalLM(DeciLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = llama.LlamaForCausalLM._tied_weights_keys

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # transformers types the argument nn.Module; this model's embedding is an nn.Embedding
    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        h = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_OUT_CACHE_KW: getattr(out, _OUT_CACHE_KW)})

"""Hugging Face Llama-named state dicts <-> Megatron GPTModel parameters, with TP sharding.

The interchange format of the whole project is a Hugging Face Llama-named state dict
(float32 tensors): ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``{q,k,v}_proj.bias`` for Qwen2,
``self_attn.{q,k}_norm.weight`` for Qwen3), ``model.layers.{i}.post_attention_layernorm.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight``
(absent when embeddings are tied). A removed block has no keys (as in DeciLM checkpoints).

Megatron layouts (per TP rank ``r`` of ``tp``):

- ``linear_qkv.weight`` ``[(q + 2*g) * d / tp, H]``: grouped per KV group g as
  ``[q heads of group g; k_g; v_g]``; rank r holds groups ``r*g/tp .. (r+1)*g/tp - 1``,
  i.e. the r-th contiguous chunk of the fused matrix.
- ``linear_fc1.weight`` ``[2 * F / tp, H]``: ``[gate_r; up_r]`` (SwiGLU: ``silu(gate) * up``).
- ``linear_proj.weight`` / ``linear_fc2.weight``: split on the input dim (dim 1).
- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: split on vocab (dim 0),
  vocabulary padded to a multiple of TP with zero rows.
- norms: replicated. With Transformer Engine the pre-attention / pre-mlp norms live in
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``.
"""

from __future__ import annotations

from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _global_layer_index(model: Any) -> dict[int, int]:
    """Local decoder layer index -> global (0-based) layer index (differs under PP)."""
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(model.decoder.layers)}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's grouped QKV from HF q/k/v (weights ``[out, H]`` or biases ``[out]``)."""
    tail = q.shape[1:]
    qg = q.reshape(groups, -1, *tail)
    kg = k.reshape(groups, -1, *tail)
    vg = v.reshape(groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, groups: int, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of ``fuse_qkv`` on the full (gathered) fused tensor."""
    tail = qkv.shape[1:]
    per = heads // groups
    g = qkv.reshape(groups, (per + 2) * head_dim, *tail)
    q, k, v = torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def _layer_param_sources(
    spec: ArchSpec, i: int, name: str, hf: dict[str, torch.Tensor], tp: int, r: int
) -> torch.Tensor:
    """This rank's tensor for Megatron param ``name`` (relative to layer ``i``) from HF tensors."""
    att, _mlp = spec.layers()[i]
    p = f"model.layers.{i}."
    if name in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return hf[p + "input_layernorm.weight"]
    if name in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return hf[p + "post_attention_layernorm.weight"]
    if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = name.rsplit(".", 1)[1]
        a = p + "self_attn."
        fused = fuse_qkv(
            hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"], att.num_kv_groups
        )
        return fused.chunk(tp, dim=0)[r]
    if name == "self_attention.linear_proj.weight":
        return hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[r]
    if name == "self_attention.q_layernorm.weight":
        return hf[p + "self_attn.q_norm.weight"]
    if name == "self_attention.k_layernorm.weight":
        return hf[p + "self_attn.k_norm.weight"]
    if name == "mlp.linear_fc1.weight":
        g, u = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        return torch.cat([g.chunk(tp, dim=0)[r], u.chunk(tp, dim=0)[r]], dim=0)
    if name == "mlp.linear_fc2.weight":
        return hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[r]
    raise KeyError(f"no Hugging Face source for Megatron parameter decoder.layers.{i}.{name}")


def _hf_key_used(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> set[str]:
    """HF keys a load consumes (to report unused keys)."""
    used = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tied_embeddings:
        used.add("lm_head.weight")
    for i, (att, mlp) in enumerate(spec.layers()):
        p = f"model.layers.{i}."
        if not att.removed:
            used.add(p + "input_layernorm.weight")
            for n in ("q", "k", "v"):
                used |= {p + f"self_attn.{n}_proj.weight", p + f"self_attn.{n}_proj.bias"}
            used |= {p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        if not mlp.removed:
            used.add(p + "post_attention_layernorm.weight")
            used |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    return used & set(hf)


def hf_to_megatron(spec: ArchSpec, hf_sd: dict[str, torch.Tensor], model: Any) -> None:
    """Load a HF Llama-named state dict into this rank's Megatron model (in place).

    Every model parameter must be found, with the right shape, and every HF tensor must
    be used (the lm_head of a tied model may be present and equal the embedding);
    otherwise a ``ValueError`` lists the mismatches.
    """
    tp, r, _ = _tp()
    idx = _global_layer_index(model)
    problems: list[str] = []
    vocab_rows = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            try:
                if name == "embedding.word_embeddings.weight":
                    vocab_rows = param.shape[0] * tp
                    src = _pad_rows(hf_sd["model.embed_tokens.weight"], vocab_rows).chunk(tp, dim=0)[r]
                elif name == "output_layer.weight":
                    key = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
                    src = _pad_rows(hf_sd[key], param.shape[0] * tp).chunk(tp, dim=0)[r]
                elif name == "decoder.final_layernorm.weight":
                    src = hf_sd["model.norm.weight"]
                elif name.startswith("decoder.layers."):
                    _, _, li, rest = name.split(".", 3)
                    src = _layer_param_sources(spec, idx[int(li)], rest, hf_sd, tp, r)
                else:
                    raise KeyError(f"unknown Megatron parameter {name}")
            except KeyError as e:
                problems.append(f"{name}: missing {e}")
                continue
            if tuple(src.shape) != tuple(param.shape):
                problems.append(f"{name}: model shape {tuple(param.shape)} != checkpoint shape {tuple(src.shape)}")
                continue
            param.copy_(src.to(param.dtype))
    unused = set(hf_sd) - _hf_key_used(spec, hf_sd)
    if spec.tied_embeddings and "lm_head.weight" in unused:
        if torch.equal(hf_sd["lm_head.weight"], hf_sd["model.embed_tokens.weight"]):
            unused.discard("lm_head.weight")
    unused = {k for k in unused if not k.endswith("rotary_emb.inv_freq")}
    if unused and _full_model_on_rank(model):
        problems.append(
            f"checkpoint tensors not used by the model: {sorted(unused)[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    if problems:
        raise ValueError(f"checkpoint does not match ArchSpec {spec.name!r}:\n  " + "\n  ".join(problems))


def _full_model_on_rank(model: Any) -> bool:
    return bool(getattr(model, "pre_process", True) and getattr(model, "post_process", True))


def _gather(t: torch.Tensor, dim: int, tp: int, group: Any) -> torch.Tensor:
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def megatron_to_hf(spec: ArchSpec, model: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """The HF Llama-named state dict (float32, CPU) of a Megatron model.

    Collective over the TP group: every TP rank must call it; every rank gets the full
    tensors. Padding vocabulary rows are dropped. (Pipeline stages each return the
    layers they hold.) ``grads=True`` maps the parameters' ``.grad`` instead (zeros
    where a gradient is missing), e.g. to compare gradients across parallel layouts.
    """
    tp, _, group = _tp()
    idx = _global_layer_index(model)
    layers = spec.layers()
    out: dict[str, torch.Tensor] = {}
    for name, p_ in model.named_parameters():
        param = (p_.grad if p_.grad is not None else torch.zeros_like(p_)) if grads else p_
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = _gather(param, 0, tp, group)[: spec.vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = _gather(param, 0, tp, group)[: spec.vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = param.detach().clone()
        elif name.startswith("decoder.layers."):
            _, _, li, rest = name.split(".", 3)
            i = idx[int(li)]
            att, _mlp = layers[i]
            p = f"model.layers.{i}."
            if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
                out[p + "input_layernorm.weight"] = param.detach().clone()
            elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
                out[p + "post_attention_layernorm.weight"] = param.detach().clone()
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = split_qkv(_gather(param, 0, tp, group), att.num_kv_groups, att.num_heads, att.head_dim)
                for n, t in zip(("q", "k", "v"), (q, k, v), strict=True):
                    out[p + f"self_attn.{n}_proj.{kind}"] = t
            elif rest == "self_attention.linear_proj.weight":
                out[p + "self_attn.o_proj.weight"] = _gather(param, 1, tp, group)
            elif rest == "self_attention.q_layernorm.weight":
                out[p + "self_attn.q_norm.weight"] = param.detach().clone()
            elif rest == "self_attention.k_layernorm.weight":
                out[p + "self_attn.k_norm.weight"] = param.detach().clone()
            elif rest == "mlp.linear_fc1.weight":
                parts = [torch.empty_like(param) for _ in range(tp)] if tp > 1 else [param.detach()]
                if tp > 1:
                    torch.distributed.all_gather(parts, param.detach().contiguous(), group=group)
                gates, ups = zip(*(t.chunk(2, dim=0) for t in parts), strict=True)
                out[p + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0).clone()
                out[p + "mlp.up_proj.weight"] = torch.cat(ups, dim=0).clone()
            elif rest == "mlp.linear_fc2.weight":
                out[p + "mlp.down_proj.weight"] = _gather(param, 1, tp, group)
            else:
                raise KeyError(f"megatron_to_hf: no Hugging Face name for {name}")
        else:
            raise KeyError(f"megatron_to_hf: no Hugging Face name for {name}")
    return {k: v.float().cpu() for k, v in out.items()}

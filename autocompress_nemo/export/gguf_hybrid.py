"""Write a heterogeneous Nemotron-H hybrid as a ``nemotron_h`` / ``nemotron_h_moe`` GGUF for llama.cpp.

llama.cpp (llama-cpp-python 0.3.36, vendored llama.cpp 0c1e570) reads per layer, from arrays:
``<arch>.feed_forward_length`` (dense MLP width, or the routed-expert width on a MoE layer),
``<arch>.attention.head_count`` / ``head_count_kv``, ``<arch>.expert_feed_forward_length`` and
``<arch>.expert_used_count``. A layer's kind comes from those arrays: Mamba when its
``feed_forward_length`` and ``head_count_kv`` are 0, attention when only ``head_count_kv`` > 0,
otherwise feed-forward (MoE when the model's ``expert_count`` > 0, so a ``nemotron_h_moe`` model
has no dense MLP layer). The expert count, shared-expert width, LatentMoE size and every Mamba size
(inner size, heads = ``ssm.time_step_rank``, groups, state, conv kernel) are scalars: one per model.

Removed blocks are dropped (a no-op block computes the identity), as in the Hugging Face export
(``models/nemotron_h/config.py::export_spec``); a MoE block whose routed experts are removed would
become a dense layer of the shared-expert width.

Pitfalls measured with that llama.cpp, each refused here with a message before llama.cpp runs
(``gguf_problems``), because llama.cpp kills the process (abort, SIGFPE) on most of them:

- ``head_count`` 0 on a non-attention layer (a 0 at layer 0 sets the head size to 0): this writer
  writes the model's attention head count on every non-attention layer;
- no attention block or no Mamba block left (``GGML_ASSERT(buffer)``, zero-size cache);
- a dense MLP layer in a model with MoE layers (``nemotron_h_moe`` reads every feed-forward layer
  as MoE);
- ``expert_used_count`` outside ``1..expert_count`` (0: SIGFPE; above: abort);
- per-layer expert counts, shared-expert widths, Mamba heads / groups / state, head dims, LatentMoE
  sizes (scalars in the format); a MoE model without a shared expert (its tensors are required).

Tensor layout (numpy ``[out, in]``, as ``nn.Linear``; ggml lists dims reversed): Mamba ``ssm_in``
is ``in_proj`` (rows ``[z; x; B; C; dt]``), ``ssm_conv1d`` the conv weight squeezed to
``[channels, K]``, ``ssm_a = -exp(A_log)`` and ``ssm_d`` as ``[heads, 1]``, ``ssm_norm`` the gated
RMSNorm weight as ``[groups, d_inner / groups]``; routed experts are stacked ``[E, out, in]``.
Attention has no RoPE in Nemotron-H, so Q/K rows are written unpermuted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.models.hybrid.names import NEMOTRON_H

_FTYPE = {"f32": 0, "f16": 1}


def _compact(spec: ArchSpec) -> ArchSpec:
    from autocompress_nemo.models.nemotron_h.config import export_spec

    return export_spec(spec)[0]


def is_hybrid(spec: ArchSpec) -> bool:
    """A Nemotron-H hybrid, written as ``nemotron_h`` / ``nemotron_h_moe`` GGUF here; anything else is
    a Llama-family layer stack, written as ``llama`` / ``deci`` (``export/gguf.py``)."""
    return spec.family == "nemotron_h" or not spec.is_dense_layered()


def gguf_arch(spec: ArchSpec) -> str:
    """``nemotron_h_moe`` when ``spec`` keeps a MoE block with routed experts, else ``nemotron_h``."""
    return "nemotron_h_moe" if any(isinstance(b, MoeBlock) for b in _compact(spec).blocks) else "nemotron_h"


def gguf_problems(spec: ArchSpec) -> list[str]:
    """Why llama.cpp's ``nemotron_h`` / ``nemotron_h_moe`` cannot serve ``spec`` (empty: it can).

    Judged on the compacted spec (removed blocks dropped), the model llama.cpp would load."""
    c = _compact(spec)
    out: list[str] = []
    kinds = [b.kind for b in c.blocks]
    if "attention" not in kinds:
        out.append(
            "no attention block left: llama.cpp nemotron_h needs at least one attention and one Mamba block "
            "(with none it aborts on a zero-size KV cache, GGML_ASSERT(buffer))"
        )
    if "mamba" not in kinds:
        out.append(
            "no Mamba block left: llama.cpp nemotron_h needs at least one attention and one Mamba block "
            "(with none it aborts on a zero-size recurrent state, GGML_ASSERT(buffer))"
        )
    moes = [(i, b) for i, b in enumerate(c.blocks) if isinstance(b, MoeBlock)]
    mlps = [i for i, b in enumerate(c.blocks) if isinstance(b, MlpBlock)]
    if moes and mlps:
        out.append(
            f"dense MLP layer(s) {mlps} in a MoE model: llama.cpp nemotron_h_moe reads every feed-forward "
            "layer as MoE and refuses a dense '-' layer (a MoE block whose routed experts are removed is one)"
        )
    for name, vals in (
        ("routed-expert count", {b.num_experts for _, b in moes}),
        ("shared-expert width", {b.shared_ffn for _, b in moes}),
        ("LatentMoE size", {b.latent for _, b in moes}),
        (
            "Mamba shape (heads, head dim, state, groups, conv kernel)",
            {_mamba_key(b) for b in c.blocks if isinstance(b, MambaBlock)},
        ),
        ("attention head dim", {b.head_dim for b in c.blocks if isinstance(b, AttentionBlock)}),
    ):
        if len(vals) > 1:
            out.append(f"the {name} differs between blocks ({sorted(vals)}): llama.cpp nemotron_h takes one per model")
    for i, b in moes:
        if not 1 <= b.top_k <= b.num_experts:
            out.append(
                f"layer {i}: top-k {b.top_k} is outside 1..{b.num_experts} experts (llama.cpp dies: "
                "0 with SIGFPE, above the expert count with an abort)"
            )
        if b.shared_ffn == 0:
            out.append(f"layer {i}: a MoE block without a shared expert (llama.cpp nemotron_h_moe requires one)")
    acts = {b.activation for b in c.blocks if isinstance(b, (MlpBlock, MoeBlock))}
    if acts - {"relu2"}:
        out.append(f"llama.cpp nemotron_h runs relu2 MLPs / experts only, got {sorted(acts)}")
    return out


def _mamba_key(b: MambaBlock) -> tuple[int, ...]:
    return (b.num_heads, b.head_dim, b.state_size, b.num_groups, b.conv_kernel)


def layer_arrays(spec: ArchSpec) -> dict[str, list[int]]:
    """The per-layer GGUF arrays of the compacted ``spec``: ``feed_forward_length``, ``head_count``,
    ``head_count_kv``, ``expert_feed_forward_length``, ``expert_used_count``. Non-attention layers get
    the model's attention head count (never 0), non-MoE layers expert width / top-k 0."""
    c = _compact(spec)
    att = [b for b in c.blocks if isinstance(b, AttentionBlock)]
    if not att:
        raise ValueError("nemotron_h GGUF: " + gguf_problems(spec)[0])
    heads0 = att[0].num_heads
    ff, hc, hkv, eff, k = [], [], [], [], []
    for b in c.blocks:
        hc.append(b.num_heads if isinstance(b, AttentionBlock) else heads0)
        hkv.append(b.num_kv_groups if isinstance(b, AttentionBlock) else 0)
        if isinstance(b, MoeBlock):
            ff.append(b.expert_ffn)
            eff.append(b.expert_ffn)
            k.append(b.top_k)
        else:
            ff.append(b.ffn if isinstance(b, MlpBlock) else 0)
            eff.append(0)
            k.append(0)
    return {
        "feed_forward_length": ff,
        "attention.head_count": hc,
        "attention.head_count_kv": hkv,
        "expert_feed_forward_length": eff,
        "expert_used_count": k,
    }


def _add_hybrid_shape(w: Any, spec: ArchSpec, c: ArchSpec, dtype: str, context_length: int | None) -> None:
    """The header of the compacted hybrid ``c``: per-layer arrays (``layer_arrays``), the Mamba shape
    and, with MoE blocks, the experts'."""
    arrays, arch = layer_arrays(spec), gguf_arch(spec)
    att = next(b for b in c.blocks if isinstance(b, AttentionBlock))
    mam = next(b for b in c.blocks if isinstance(b, MambaBlock))
    moe = next((b for b in c.blocks if isinstance(b, MoeBlock)), None)
    w.add_name(spec.name or "autocompress-nemo hybrid")
    w.add_block_count(len(c.blocks))
    w.add_context_length(context_length or spec.max_position)
    w.add_embedding_length(spec.hidden)
    w.add_vocab_size(spec.vocab)
    w.add_layer_norm_eps(spec.norm_eps)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_key_length(att.head_dim)
    w.add_value_length(att.head_dim)
    w.add_file_type(_FTYPE[dtype])
    for key in ("feed_forward_length", "attention.head_count", "attention.head_count_kv"):
        w.add_array(f"{arch}.{key}", arrays[key])
    w.add_ssm_conv_kernel(mam.conv_kernel)
    w.add_ssm_inner_size(mam.d_inner)
    w.add_ssm_state_size(mam.state_size)
    w.add_ssm_time_step_rank(mam.num_heads)
    w.add_ssm_group_count(mam.num_groups)
    if moe is not None:
        w.add_expert_count(moe.num_experts)
        w.add_array(f"{arch}.expert_used_count", arrays["expert_used_count"])
        w.add_array(f"{arch}.expert_feed_forward_length", arrays["expert_feed_forward_length"])
        w.add_expert_shared_feed_forward_length(moe.shared_ffn)
        w.add_expert_shared_count(1)
        w.add_expert_weights_norm(bool(spec.extra.get("norm_topk_prob", True)))
        w.add_expert_weights_scale(float(spec.extra.get("routed_scaling_factor", 1.0)))
        if moe.latent:
            w.add_moe_latent_size(moe.latent)


def _put_block(put: Any, arr: Any, i: int, b: Any, csd: dict[str, Any]) -> None:
    """The tensors of block ``i`` under llama.cpp's ``blk.<i>.`` names."""
    n = NEMOTRON_H
    p = f"blk.{i}."
    put(p + "attn_norm.weight", arr(n.key(i, "norm")))
    if isinstance(b, MambaBlock):
        put(p + "ssm_in.weight", arr(n.key(i, "in_proj")))
        put(p + "ssm_conv1d.weight", arr(n.key(i, "conv_w")).reshape(-1, b.conv_kernel), f32=True)
        if n.key(i, "conv_b") in csd:
            put(p + "ssm_conv1d.bias", arr(n.key(i, "conv_b")))
        put(p + "ssm_dt.bias", arr(n.key(i, "dt_bias")))
        put(p + "ssm_a", -np.exp(arr(n.key(i, "A_log"))).reshape(-1, 1), f32=True)
        put(p + "ssm_d", arr(n.key(i, "D")).reshape(-1, 1), f32=True)
        put(p + "ssm_norm.weight", arr(n.key(i, "mnorm")).reshape(b.num_groups, -1), f32=True)
        put(p + "ssm_out.weight", arr(n.key(i, "out_proj")))
    elif isinstance(b, AttentionBlock):
        for role, gname in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            put(p + f"{gname}.weight", arr(n.key(i, role)))
    elif isinstance(b, MlpBlock):
        put(p + "ffn_up.weight", arr(n.key(i, "up")))
        put(p + "ffn_down.weight", arr(n.key(i, "down")))
    else:
        assert isinstance(b, MoeBlock)
        put(p + "ffn_gate_inp.weight", arr(n.key(i, "router")))
        bias = n.key(i, "router_bias")
        put(p + "exp_probs_b.bias", arr(bias) if bias in csd else np.zeros(b.num_experts, np.float32))
        for role, gname in (("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            put(p + f"{gname}.weight", np.stack([arr(n.key(i, f"expert_{role}", e)) for e in range(b.num_experts)]))
        put(p + "ffn_up_shexp.weight", arr(n.key(i, "shared_up")))
        put(p + "ffn_down_shexp.weight", arr(n.key(i, "shared_down")))
        if b.latent:
            put(p + "ffn_latent_down.weight", arr(n.key(i, "latent_down")))
            put(p + "ffn_latent_up.weight", arr(n.key(i, "latent_up")))


def write_hybrid_gguf(
    spec: ArchSpec,
    path: str | Path,
    weights: dict[str, Any] | None = None,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: str = "f32",
    context_length: int | None = None,
    seed: int = 0,
) -> Path:
    """Write the Nemotron-H ``spec`` to ``path`` as a ``nemotron_h`` / ``nemotron_h_moe`` GGUF.

    ``weights``: a Nemotron-H-named state dict of ``spec`` (``models/hybrid/names.py``, e.g.
    ``megatron_to_hf`` of the Megatron model); random weights (``random_hf_state_dict(seed)``) when
    None. ``dtype``: f32 or f16 matrices (norms, biases and every Mamba tensor but ``ssm_in`` /
    ``ssm_out`` stay F32: conv weight, A, D, gated norm). Raises ValueError
    naming every problem of ``gguf_problems`` before anything is written."""
    import gguf
    import torch

    from autocompress_nemo.export.gguf import _copy_tokenizer, finish_gguf, smollm2_gguf_path
    from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
    from autocompress_nemo.models.nemotron_h.hf_io import compact_state_dict

    problems = gguf_problems(spec)
    if problems:
        raise ValueError(
            f"llama.cpp cannot serve {spec.name or 'this hybrid'} as nemotron_h GGUF: " + "; ".join(problems)
        )
    if dtype not in _FTYPE:
        raise ValueError(f"write_hybrid_gguf: dtype {dtype!r} not supported; use one of {sorted(_FTYPE)}")
    sd = weights if weights is not None else random_hf_state_dict(spec, seed=seed)
    c, csd = compact_state_dict(spec, dict(sd))
    n = NEMOTRON_H

    def arr(name: str) -> np.ndarray:
        t = csd[name]
        return (t.detach().to(torch.float32).cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(
            np.float32
        )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), gguf_arch(spec))
    _add_hybrid_shape(w, spec, c, dtype, context_length)
    _copy_tokenizer(w, Path(tokenizer_from) if tokenizer_from else smollm2_gguf_path(), spec.vocab)

    def put(name: str, a: np.ndarray, f32: bool = False) -> None:
        """Matrices in ``dtype``; vectors and ``f32`` tensors in F32 (llama.cpp's ``ssm_conv`` asserts
        an F32 conv weight: an F16 one aborts, measured with llama-cpp-python 0.3.36)."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        w.add_tensor(name, a.astype(np.float16) if dtype == "f16" and a.ndim >= 2 and not f32 else a)

    put("token_embd.weight", arr(n.embed))
    put("output_norm.weight", arr(n.final_norm))
    if not spec.tied_embeddings:
        put("output.weight", arr(n.lm_head))
    for i, b in enumerate(c.blocks):
        _put_block(put, arr, i, b, csd)
    return finish_gguf(w, tmp, path)

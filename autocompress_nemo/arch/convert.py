"""ArchSpec <-> Hugging Face configs (Llama / Qwen2 / Qwen3 dense, DeciLM ``block_configs``).

A uniform model is written as its family's own config (``LlamaConfig``, ``Qwen2Config``,
``Qwen3Config``). A heterogeneous one is written DeciLM-style (``model_type:
nemotron-nas``, ``DeciLMForCausalLM``) with one ``block_configs`` entry per layer:

    {"attention": {"n_heads_in_group": q/kv, "no_op": false, "replace_with_linear": false,
                   "num_attention_heads": q},          # extension, see below
     "ffn": {"intermediate_size": f, "ffn_mult": 1.5*f/hidden, "no_op": false,
             "replace_with_linear": false}}

- ``n_heads_in_group`` is query heads per KV group in that layer (DeciLM's meaning).
- ``intermediate_size`` is the exact ffn width. ``ffn_mult`` is also written for readers
  that only know it (DeciLM / Megatron compute ``round_up(int(2*mult*hidden/3), 256)``,
  which equals the exact width only when it is a multiple of 256); readers should
  prefer ``intermediate_size``.
- Extension ``num_attention_heads`` (per layer, written only when query heads differ
  between layers, as llama.cpp's ``deci`` allows): that layer's query heads. Standard
  DeciLM derives KV heads as ``config.num_attention_heads / n_heads_in_group`` and
  cannot represent per-layer query heads; with the extension the layer has
  ``num_attention_heads`` query heads and ``num_attention_heads / n_heads_in_group`` KV
  heads. The top-level key ``acn_per_layer_query_heads: true`` marks such a config.
- A removed block is ``no_op: true`` (attention: ``n_heads_in_group: null``).

What a serving engine's loader reads decides what is written (``hf_config_from_spec(spec, engine)``):

- ``vllm`` (``model_executor/models/nemotron_nas.py``): ``ffn.ffn_mult`` *if the key is there*
  (rounded to 256), else ``ffn.intermediate_size`` (exact): only ``intermediate_size`` is written.
  KV heads are ``num_attention_heads // n_heads_in_group`` with the global query heads.
- ``trtllm``: only ``ffn_mult`` (rounded up to a multiple of 256): only ``ffn_mult`` is written,
  and a width off that grid is refused.
- Neither reads per-layer query heads: a spec whose query heads differ between layers is refused.
- Any other engine (``""``, ``llama_cpp``, ``pytorch``, ``roofline``): both keys and the extension.

A DeciLM config carries ``auto_map`` to the configuration / modeling code written next to it
(``export/hf_code/``), so ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` read it (transformers has no ``nemotron-nas`` class; nor does vLLM's
config registry, so vLLM needs ``trust_remote_code=True`` for these directories too).
"""

from __future__ import annotations

from typing import Any, TypedDict

from autocompress_nemo.arch.loaders import HfLoader, as_loader
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

_FAMILY_OF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
_ARCH_OF_FAMILY = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
DECI_MODEL_TYPE = "nemotron-nas"
DECI_AUTO_MAP = {
    "AutoConfig": "configuration_decilm.DeciLMConfig",
    "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
}


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden: int) -> int:
    """DeciLM's ffn width of ``ffn_mult`` (vLLM ``_ffn_mult_to_intermediate_size``, TensorRT-LLM):
    ``int(2 * ffn_mult * hidden / 3)`` rounded up to a multiple of 256."""
    n = int(2 * ffn_mult * hidden / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


def ffn_mult_of(ffn: int, hidden: int) -> float:
    """The ``ffn_mult`` DeciLM readers turn back into ``ffn`` (when ``ffn`` is a multiple of 256)."""
    return 1.5 * ffn / hidden


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        return dict(rs)
    return None


class _CommonFields(TypedDict):
    """The ArchSpec fields a config.json gives alike for every family (``spec_from_hf_config``)."""

    hidden: int
    vocab: int
    name: str
    tied_embeddings: bool
    norm_eps: float
    rope_theta: float
    max_position: int


def spec_from_hf_config(cfg: dict[str, Any]) -> ArchSpec:
    """ArchSpec of a Hugging Face ``config.json`` (llama, qwen2, qwen3, nemotron-nas/DeciLM)."""
    mt = cfg.get("model_type", "")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    extra: dict[str, Any] = {}
    rs = _rope_scaling(cfg)
    if rs:
        extra["rope_scaling"] = rs
    common: _CommonFields = dict(
        hidden=hidden,
        vocab=int(cfg["vocab_size"]),
        name=str(cfg.get("_name_or_path", "")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=_rope_theta(cfg),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
    )
    if mt == DECI_MODEL_TYPE or "block_configs" in cfg:
        blocks: list[Any] = []
        for i, b in enumerate(cfg["block_configs"]):
            a, f = b["attention"], b.get("ffn") or b.get("mlp") or {}
            if a.get("no_op"):
                blocks.append(AttentionBlock(0, 0, head_dim))
            elif a.get("replace_with_linear"):
                raise ValueError(f"block_configs[{i}].attention: replace_with_linear is not supported")
            else:
                q = int(a.get("num_attention_heads") or heads)
                g = int(a.get("n_heads_in_group") or 1)
                if q % g:
                    raise ValueError(f"block_configs[{i}]: {q} query heads not divisible by n_heads_in_group={g}")
                blocks.append(AttentionBlock(q, q // g, head_dim))
            if f.get("no_op"):
                blocks.append(MlpBlock(0))
            elif f.get("replace_with_linear"):
                raise ValueError(f"block_configs[{i}].ffn: replace_with_linear is not supported")
            elif f.get("intermediate_size"):
                blocks.append(MlpBlock(int(f["intermediate_size"])))
            else:
                blocks.append(MlpBlock(ffn_mult_to_intermediate_size(float(f["ffn_mult"]), hidden)))
        return ArchSpec(blocks=tuple(blocks), family="llama", extra=extra, **common)
    if mt not in _FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"config.json model_type {mt!r} is not a supported dense family; supported: "
            f"{sorted(_FAMILY_OF_MODEL_TYPE)} and {DECI_MODEL_TYPE!r} (DeciLM block_configs)"
        )
    family = _FAMILY_OF_MODEL_TYPE[mt]
    if family == "qwen2":
        extra["qkv_bias"] = True
    if family == "qwen3":
        extra["qk_layernorm"] = True
    if cfg.get("attention_bias") and family != "qwen2":
        raise ValueError(f"{mt} configs with attention_bias=true (q/k/v/o biases) are not supported")
    return ArchSpec.llama(
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_groups=int(cfg.get("num_key_value_heads") or heads),
        ffn=int(cfg["intermediate_size"]),
        head_dim=head_dim,
        family=family,
        extra=extra,
        **common,
    )


def _base_config(spec: ArchSpec, head_dim: int, heads: int, kv: int, ffn: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "hidden_size": spec.hidden,
        "vocab_size": spec.vocab,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": ffn,
        "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if spec.extra.get("rope_scaling"):
        cfg["rope_scaling"] = dict(spec.extra["rope_scaling"])
    return cfg


def engine_problems(spec: ArchSpec, engine: HfLoader | str) -> list[str]:
    """Why ``engine``'s DeciLM loader (``arch/loaders.py``; a name: that engine's) would not read
    heterogeneous dense ``spec`` the way it is meant (empty: it would); see the module doc."""
    loader = as_loader(engine)
    if not loader.deci_global_query_heads:
        return []
    out: list[str] = []
    layers = spec.layers()
    present = [a for a, _ in layers if not a.removed]
    if len({a.num_heads for a in present}) > 1:
        out.append(
            f"query heads differ between layers ({sorted({a.num_heads for a in present})}): {loader.name}'s DeciLM "
            "loader reads one global num_attention_heads (KV heads = num_attention_heads // n_heads_in_group)"
        )
    for i, (a, _) in enumerate(layers):
        if not a.removed and a.num_heads % a.num_kv_groups:
            out.append(f"layer {i}: {a.num_heads} query heads are not a multiple of {a.num_kv_groups} KV groups")
    if loader.deci_ffn_grid:
        for i, (_, m) in enumerate(layers):
            if not m.removed and ffn_mult_to_intermediate_size(ffn_mult_of(m.ffn, spec.hidden), spec.hidden) != m.ffn:
                out.append(
                    f"layer {i}: ffn width {m.ffn} is not a multiple of {loader.deci_ffn_grid}: {loader.name}'s DeciLM "
                    f"loader reads only ffn_mult and rounds int(2 * ffn_mult * hidden / 3) up to a multiple of "
                    f"{loader.deci_ffn_grid} (capabilities.ffn_align: {loader.deci_ffn_grid})"
                )
    if loader.deci_first_block_full:
        # nemotron_nas.DeciModel.forward: a layer with a no-op attention and an ffn, before any layer
        # has run, calls post_attention_layernorm(hidden, residual=None), which returns one tensor
        # where two are unpacked
        first = next(((a, m) for a, m in layers if not (a.removed and m.removed)), None)
        if first is not None and first[0].removed:
            out.append(
                "the first layer that computes anything has no attention: vLLM's DeciLM forward then "
                "unpacks post_attention_layernorm(x, residual=None) (one tensor) and fails "
                "(capabilities.first_block_full: true)"
            )
    return out


def hf_config_from_spec(spec: ArchSpec, engine: HfLoader | str = "") -> dict[str, Any]:
    """``config.json`` contents for ``spec``: family config if uniform, DeciLM otherwise, written the
    way ``engine``'s loader reads it (``vllm``: ``intermediate_size``; ``trtllm``: ``ffn_mult``;
    other engines / ``""``: both, plus per-layer query heads when they differ). Raises naming the
    engine when its loader cannot read ``spec`` (``engine_problems``)."""
    layers = spec.layers()
    head_dim = layers[0][0].head_dim
    if spec.is_uniform():
        att, mlp = layers[0]
        cfg = _base_config(spec, head_dim, att.num_heads, att.num_kv_groups, mlp.ffn)
        mt, arch = _ARCH_OF_FAMILY.get(spec.family, _ARCH_OF_FAMILY["llama"])
        cfg.update(model_type=mt, architectures=[arch])
        if spec.family == "qwen2":
            cfg["attention_bias"] = True  # Qwen2Config has no such key; its q/k/v always carry a bias
        return cfg
    if spec.extra.get("qk_layernorm") or spec.extra.get("qkv_bias"):
        raise ValueError("a heterogeneous Qwen2/Qwen3 model (qkv bias / q-k norms) has no DeciLM config to export to")
    loader = as_loader(engine)
    problems = engine_problems(spec, loader)
    if problems:
        raise ValueError(
            f"ArchSpec {spec.name!r} cannot be written as a DeciLM config that {loader.name} reads the same way: "
            + "; ".join(problems)
        )
    present = [a for a, _ in layers if not a.removed]
    heads = max((a.num_heads for a in present), default=1)
    varies_q = len({a.num_heads for a in present}) > 1
    ffn0 = max((m.ffn for _, m in layers), default=0)
    cfg = _base_config(spec, head_dim, heads, present[0].num_kv_groups if present else 1, ffn0)
    blocks = []
    for att, mlp in layers:
        a: dict[str, Any] = {
            "no_op": att.removed,
            "replace_with_linear": False,
            "n_heads_in_group": None if att.removed else att.heads_per_group,
        }
        if varies_q and not att.removed:
            a["num_attention_heads"] = att.num_heads
        # ffn_hidden_size: megatron-core's HeterogeneousTransformerConfig (Megatron-Bridge's llama_nemotron
        # provider) takes it exactly; from ffn_mult alone it rounds up to a multiple of 256
        f: dict[str, Any] = {
            "no_op": mlp.removed,
            "replace_with_linear": False,
            "ffn_hidden_size": None if mlp.removed else mlp.ffn,
        }
        if not mlp.removed:
            if "intermediate_size" in loader.deci_ffn_keys:
                f["intermediate_size"] = mlp.ffn
            if "ffn_mult" in loader.deci_ffn_keys:  # vLLM takes ffn_mult whenever the key is there
                f["ffn_mult"] = ffn_mult_of(mlp.ffn, spec.hidden)
        blocks.append({"attention": a, "ffn": f})
    cfg.update(
        model_type=DECI_MODEL_TYPE,
        architectures=["DeciLMForCausalLM"],
        block_configs=blocks,
        auto_map=dict(DECI_AUTO_MAP),
    )
    if varies_q:
        cfg["acn_per_layer_query_heads"] = True
    return cfg

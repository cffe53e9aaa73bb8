"""Nemotron-H Hugging Face configs <-> ArchSpec: ``NemotronHForCausalLM`` and the Puzzle format.

A uniform model (every block of a kind has the same shape) is written as the published
``NemotronHForCausalLM`` config (``model_type: nemotron_h``): ``hybrid_override_pattern``,
``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim``, ``intermediate_size`` +
``mlp_hidden_act: relu2``, ``mamba_num_heads`` / ``mamba_head_dim`` / ``ssm_state_size`` /
``n_groups`` / ``conv_kernel``, ``n_routed_experts`` / ``num_experts_per_tok`` /
``moe_intermediate_size`` / ``moe_shared_expert_intermediate_size`` / ``moe_latent_size``.

A heterogeneous one is written in the Nemotron-H "Puzzle" format that vLLM and TensorRT-LLM
read (``architectures: [NemotronHPuzzleForCausalLM]``, ``model_type: nemotron_h_puzzle``): the
same global fields plus ``block_configs``, one dict per block, ``block_type`` in
``mamba | attention | mlp | moe``, overriding global fields for that block — ``moe``:
``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``moe_shared_expert_intermediate_size``, ``moe_latent_size``; ``mlp``: ``intermediate_size``.
Per-block ``mamba_num_heads`` (mamba) and ``num_attention_heads`` / ``num_key_value_heads``
(attention) are written only where they differ from the global value: they are read by
readers that apply every block field to the layer config (vLLM's
``get_nemotron_h_config_for_layer``), not by the published remote-code dataclasses, which
have no such fields.

The Puzzle format has no no-op block: a removed block is dropped (it computes the identity,
so the function is unchanged), and a MoE block whose routed experts are all removed becomes
an ``mlp`` block of the shared expert's width. ``export_spec(spec)`` gives that compacted spec
and the old -> new block index map.

A MoE block without a shared expert is written with ``moe_shared_expert_intermediate_size: 0`` and
``n_shared_experts: 0``; transformers' ``NemotronHMoE`` cannot represent it (it falls back to
``intermediate_size`` for a width of 0), published checkpoints always have one.

A Puzzle config carries ``auto_map`` to ``configuration_nemotron_h_puzzle.NemotronHPuzzleConfig``
(``export/hf_code/``, written next to it): transformers has no ``nemotron_h_puzzle`` class, and
vLLM reads every per-block field only through that class's ``get_nemotron_h_config_for_layer``.
What each engine's loader reads (``hf_config_from_spec(spec, engine)`` refuses the rest):

- ``vllm`` (``model_executor/models/nemotron_h.py``): attention (query / KV heads), MLP
  (``intermediate_size``) and MoE (experts, expert / shared width, top-k, ``n_shared_experts``,
  latent) per block, through ``get_nemotron_h_config_for_layer``; Mamba blocks read the global
  config only (``mamba_num_heads``, ``ssm_state_size``, ``n_groups``).
- ``trtllm`` (``_torch/models/modeling_nemotron_h.py``): MoE fields per block
  (``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``moe_shared_expert_intermediate_size``, ``moe_latent_size``); attention heads, the MLP width,
  ``n_shared_experts`` and every Mamba field are global.
"""

from __future__ import annotations

from typing import Any

from autocompress_nemo.arch.loaders import HfLoader, as_loader
from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, Block, MambaBlock, MlpBlock, MoeBlock

BLOCK_TYPE = {"mamba": "mamba", "attention": "attention", "mlp": "mlp", "moe": "moe"}
_PATTERN_TYPE = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_EXTRA_KEYS = ("routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
PUZZLE_AUTO_MAP = {"AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig"}


def export_spec(spec: ArchSpec) -> tuple[ArchSpec, list[int | None]]:
    """``(spec without removed blocks, old block index -> new index or None)``."""
    blocks: list[Block] = []
    index: list[int | None] = []
    for b in spec.blocks:
        if b.removed:
            index.append(None)
            continue
        if isinstance(b, MoeBlock) and not (b.num_experts and b.expert_ffn):
            b = MlpBlock(b.shared_ffn, b.activation)
        index.append(len(blocks))
        blocks.append(b)
    return spec.replace(blocks=tuple(blocks)), index


def _first(spec: ArchSpec, cls: type) -> Any:
    return next((b for b in spec.blocks if isinstance(b, cls)), None)


def is_uniform(spec: ArchSpec) -> bool:
    seen: dict[str, Block] = {}
    return all(not b.removed and seen.setdefault(b.kind, b) == b for b in spec.blocks)


def engine_problems(spec: ArchSpec, engine: HfLoader | str) -> list[str]:
    """Why ``engine``'s Nemotron-H Puzzle loader (``arch/loaders.py``; a name: that engine's) would not
    read heterogeneous ``spec`` (removed blocks dropped) the way it is meant; empty: it would (or the
    loader reads every block's own shape)."""
    loader = as_loader(engine)
    if not loader.hybrid_global or is_uniform(spec):
        return []
    out: list[str] = []

    def differ(cls: type, fields: tuple[str, ...], why: str) -> None:
        shapes = {tuple(getattr(b, f) for f in fields) for b in spec.blocks if isinstance(b, cls)}
        if len(shapes) > 1:
            out.append(f"{cls.__name__} {'/'.join(fields)} differ between blocks ({sorted(shapes)}): {why}")

    who, glob = loader.name, set(loader.hybrid_global)
    if "mamba" in glob:
        why = f"{who}'s Nemotron-H Mamba layer reads the global mamba_num_heads / ssm_state_size / n_groups"
        differ(MambaBlock, ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel"), why)
    if "attention" in glob:
        differ(AttentionBlock, ("num_heads", "num_kv_groups"), f"{who}'s Nemotron-H attention reads global heads")
    if "mlp" in glob:
        differ(MlpBlock, ("ffn",), f"{who}'s Nemotron-H MLP layer reads the global intermediate_size")
    shared = {bool(b.shared_ffn) for b in spec.blocks if isinstance(b, MoeBlock)}
    if "shared_expert" in glob and len(shared) > 1:
        out.append(f"some MoE blocks have a shared expert and some not: {who} reads n_shared_experts globally")
    return out


def hf_config_from_spec(spec: ArchSpec, engine: HfLoader | str = "") -> dict[str, Any]:
    """The config.json dict of ``spec`` (uniform: NemotronHForCausalLM; else Puzzle, with ``auto_map``).
    Removed blocks must have been dropped first (``export_spec``). Raises naming ``engine`` when its
    loader cannot read a heterogeneous ``spec`` (``engine_problems``)."""
    if any(b.removed for b in spec.blocks):
        raise ValueError("hf_config_from_spec: drop removed blocks first (nemotron_h.config.export_spec)")
    att, mlp, moe, mam = (_first(spec, c) for c in (AttentionBlock, MlpBlock, MoeBlock, MambaBlock))
    acts = {b.activation for b in spec.blocks if isinstance(b, (MlpBlock, MoeBlock))}
    if acts - {"relu2"}:
        raise ValueError(f"Nemotron-H MLPs and experts are relu2; ArchSpec {spec.name!r} has {sorted(acts)}")
    cfg: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "hybrid_override_pattern": spec.pattern,
        "num_hidden_layers": len(spec.blocks),
        "tie_word_embeddings": spec.tied_embeddings,
        "layer_norm_epsilon": spec.norm_eps,
        "max_position_embeddings": spec.max_position,
        "mlp_hidden_act": "relu2",
        "use_bias": False,
        "mlp_bias": False,
        "attention_bias": False,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "chunk_size": int(spec.extra.get("mamba_chunk_size", 128)),
        "residual_in_fp32": False,
        "num_attention_heads": att.num_heads if att else 1,
        "num_key_value_heads": att.num_kv_groups if att else 1,
        "head_dim": att.head_dim if att else spec.hidden,
        "intermediate_size": mlp.ffn if mlp else 0,
    }
    if mam is not None:
        cfg.update(
            mamba_num_heads=mam.num_heads,
            mamba_head_dim=mam.head_dim,
            ssm_state_size=mam.state_size,
            n_groups=mam.num_groups,
            conv_kernel=mam.conv_kernel,
        )
    if moe is not None:
        cfg.update(
            n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert_ffn,
            moe_shared_expert_intermediate_size=moe.shared_ffn,
            n_shared_experts=1 if moe.shared_ffn else 0,
            moe_latent_size=moe.latent or None,
        )
    cfg.update({"routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True})
    cfg.update({k: spec.extra[k] for k in _EXTRA_KEYS if k in spec.extra})
    if is_uniform(spec):
        return cfg
    problems = engine_problems(spec, engine)
    if problems:
        raise ValueError(
            f"ArchSpec {spec.name!r} cannot be written as a Nemotron-H Puzzle config that {as_loader(engine).name} reads "
            "the same way: " + "; ".join(problems)
        )
    cfg.update(
        auto_map=dict(PUZZLE_AUTO_MAP),
        architectures=["NemotronHPuzzleForCausalLM"],
        model_type="nemotron_h_puzzle",
        mtp_block_configs=[],
        num_nextn_predict_layers=0,
    )
    cfg["block_configs"] = [_block_config(b, cfg) for b in spec.blocks]
    return cfg


def _block_config(b: Block, cfg: dict[str, Any]) -> dict[str, Any]:
    if isinstance(b, MoeBlock):
        d: dict[str, Any] = {
            "block_type": "moe",
            "n_routed_experts": b.num_experts,
            "num_experts_per_tok": b.top_k,
            "moe_intermediate_size": b.expert_ffn,
            "moe_shared_expert_intermediate_size": b.shared_ffn,
            "moe_latent_size": b.latent or None,
        }
        if bool(b.shared_ffn) != bool(cfg.get("n_shared_experts")):
            # vLLM builds a shared expert from the layer's n_shared_experts (global unless given here)
            d["n_shared_experts"] = 1 if b.shared_ffn else 0
        return d
    if isinstance(b, MlpBlock):
        return {"block_type": "mlp", "intermediate_size": b.ffn}
    if isinstance(b, MambaBlock):
        d = {"block_type": "mamba"}
        for key, v in (("mamba_num_heads", b.num_heads), ("ssm_state_size", b.state_size), ("n_groups", b.num_groups)):
            if v != cfg.get(key):
                d[key] = v
        return d
    assert isinstance(b, AttentionBlock)
    d = {"block_type": "attention"}
    for key, v in (("num_attention_heads", b.num_heads), ("num_key_value_heads", b.num_kv_groups)):
        if v != cfg.get(key):
            d[key] = v
    return d


def spec_from_hf_config(cfg: dict[str, Any], name: str = "") -> ArchSpec:
    """ArchSpec of a ``nemotron_h`` or ``nemotron_h_puzzle`` config dict."""
    mt = cfg.get("model_type")
    if mt not in ("nemotron_h", "nemotron_h_puzzle"):
        raise ValueError(f"not a Nemotron-H config: model_type={mt!r} (expected nemotron_h or nemotron_h_puzzle)")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"Nemotron-H config: mlp_hidden_act={cfg['mlp_hidden_act']!r} is not supported (relu2)")
    if cfg.get("block_configs"):
        entries = [dict(c) for c in cfg["block_configs"]]
    else:
        pattern = cfg.get("hybrid_override_pattern") or "".join(
            {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}[t]
            for t in cfg["layers_block_type"]
        )
        entries = [{"block_type": _PATTERN_TYPE[c]} for c in pattern]
    blocks: list[Block] = []
    for e in entries:
        c = {**cfg, **e}
        t = e["block_type"]
        if t == "mamba":
            blocks.append(
                MambaBlock(
                    int(c["mamba_num_heads"]),
                    int(c["mamba_head_dim"]),
                    int(c["ssm_state_size"]),
                    int(c["n_groups"]),
                    int(c.get("conv_kernel", 4)),
                )
            )
        elif t == "attention":
            blocks.append(
                AttentionBlock(
                    int(c["num_attention_heads"]),
                    int(c["num_key_value_heads"]),
                    int(c.get("head_dim") or cfg["hidden_size"] // c["num_attention_heads"]),
                )
            )
        elif t == "mlp":
            blocks.append(MlpBlock(int(c["intermediate_size"]), "relu2"))
        elif t == "moe":
            shared = int(c.get("moe_shared_expert_intermediate_size") or 0) if c.get("n_shared_experts", 1) else 0
            blocks.append(
                MoeBlock(
                    int(c["n_routed_experts"]),
                    int(c["moe_intermediate_size"]),
                    int(c["num_experts_per_tok"]),
                    shared,
                    int(c.get("moe_latent_size") or 0),
                    "relu2",
                )
            )
        else:
            raise ValueError(f"Nemotron-H block_type {t!r} is not supported (mamba, attention, mlp, moe)")
    extra = {k: cfg[k] for k in _EXTRA_KEYS if k in cfg}
    extra["mamba_chunk_size"] = int(cfg.get("chunk_size", 128))
    return ArchSpec(
        hidden=int(cfg["hidden_size"]),
        vocab=int(cfg["vocab_size"]),
        blocks=tuple(blocks),
        family="nemotron_h",
        name=name,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        extra=extra,
    )

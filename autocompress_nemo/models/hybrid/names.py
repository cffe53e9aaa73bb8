"""Hugging Face tensor names of hybrid / MoE models, by role, per checkpoint family.

A *role* names what a tensor does in a block, independent of the checkpoint family:

- every block: ``norm`` (the pre-norm of the block);
- attention: ``q``, ``k``, ``v``, ``o`` (``[out, in]`` projections), ``q_norm``, ``k_norm``;
- mlp: ``up``, ``down`` (+ ``gate`` when gated / SwiGLU);
- moe: ``router`` ``[E, h]``, ``router_bias`` ``[E]`` (selection-only bias, Nemotron-H
  ``e_score_correction_bias``), per routed expert ``expert_up`` / ``expert_down`` (+ ``expert_gate``),
  shared expert ``shared_up`` / ``shared_down`` (+ ``shared_gate``), LatentMoE ``latent_down``
  ``[latent, h]`` / ``latent_up`` ``[h, latent]``;
- mamba: ``in_proj`` ``[2*d_inner + 2*G*N + nheads, h]`` (rows ``[z; x; B; C; dt]``), ``conv_w``
  ``[d_inner + 2*G*N, 1, K]``, ``conv_b``, ``dt_bias`` / ``A_log`` / ``D`` ``[nheads]``, ``mnorm``
  ``[d_inner]`` (gated group RMSNorm), ``out_proj`` ``[h, d_inner]``.

``HfNames.key(i, role, expert)`` gives the name of block ``i``'s tensor. Nemotron-H names
are those of the published checkpoints (``backbone.`` prefix, one tensor per expert), which
transformers, vLLM and TensorRT-LLM read; Qwen3-MoE names pair blocks into decoder layers
(attention block ``2l`` and its feed-forward block ``2l+1`` share ``model.layers.{l}``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autocompress_nemo.arch.spec import ArchSpec

_NEMOTRON_MIXER = {
    "q": "q_proj.weight",
    "k": "k_proj.weight",
    "v": "v_proj.weight",
    "o": "o_proj.weight",
    "up": "up_proj.weight",
    "down": "down_proj.weight",
    "gate": "gate_proj.weight",
    "router": "gate.weight",
    "router_bias": "gate.e_score_correction_bias",
    "shared_up": "shared_experts.up_proj.weight",
    "shared_down": "shared_experts.down_proj.weight",
    "shared_gate": "shared_experts.gate_proj.weight",
    "latent_down": "fc1_latent_proj.weight",
    "latent_up": "fc2_latent_proj.weight",
    "in_proj": "in_proj.weight",
    "conv_w": "conv1d.weight",
    "conv_b": "conv1d.bias",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "D": "D",
    "mnorm": "norm.weight",
    "out_proj": "out_proj.weight",
}
_QWEN_ATTN = {  # also Llama / Qwen2 / Qwen3 dense (same decoder-layer names)
    "norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
_QWEN_FFN = {
    "norm": "post_attention_layernorm.weight",
    "router": "mlp.gate.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    "shared_gate": "mlp.shared_expert.gate_proj.weight",
}


@dataclass(frozen=True)
class HfNames:
    """Tensor names of one checkpoint family (``llama``, ``nemotron_h`` or ``qwen3_moe``)."""

    family: str
    embed: str
    final_norm: str
    lm_head: str = "lm_head.weight"

    def key(self, i: int, role: str, expert: int | None = None) -> str:
        if self.family == "nemotron_h":
            p = f"backbone.layers.{i}."
            if role == "norm":
                return p + "norm.weight"
            if role.startswith("expert_"):
                return p + f"mixer.experts.{expert}.{role.removeprefix('expert_')}_proj.weight"
            return p + "mixer." + _NEMOTRON_MIXER[role]
        p = f"model.layers.{i // 2}."
        if i % 2 == 0:
            return p + _QWEN_ATTN[role]
        if role.startswith("expert_"):
            return p + f"mlp.experts.{expert}.{role.removeprefix('expert_')}_proj.weight"
        return p + _QWEN_FFN[role]


NEMOTRON_H = HfNames("nemotron_h", embed="backbone.embeddings.weight", final_norm="backbone.norm_f.weight")
QWEN3_MOE = HfNames("qwen3_moe", embed="model.embed_tokens.weight", final_norm="model.norm.weight")
LLAMA = HfNames("llama", embed="model.embed_tokens.weight", final_norm="model.norm.weight")
PAIRED = {"qwen3_moe": QWEN3_MOE, "llama": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA}
"""Families whose decoder layer holds two blocks: attention ``2l`` and its feed-forward ``2l+1``."""


def hf_names(spec: ArchSpec) -> HfNames:
    """The naming of ``spec.family``; Llama / Qwen3-MoE specs must alternate (attention, mlp|moe)."""
    if spec.family in PAIRED:
        bad = [i for i, b in enumerate(spec.blocks) if (b.kind == "attention") != (i % 2 == 0)]
        if bad or len(spec.blocks) % 2:
            raise ValueError(
                f"ArchSpec {spec.name!r} (family {spec.family}) must alternate attention and mlp/moe blocks, "
                f"got pattern {spec.pattern!r}"
            )
        return PAIRED[spec.family]
    if spec.family == "nemotron_h":
        return NEMOTRON_H
    raise ValueError(
        f"ArchSpec {spec.name!r}: family {spec.family!r} has no checkpoint names (known: {sorted([*PAIRED, 'nemotron_h'])})"
    )

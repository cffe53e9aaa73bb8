"""Hugging Face-named state dicts (``names.py``) <-> Megatron models of every family (``GPTModel``:
a layer holds an attention and an mlp block; ``HybridModel``: one block per layer), with TP and EP.

Every Megatron tensor is described by ``(block, role, expert, layout)``; ``layout`` says how the
full Hugging Face tensor(s) become this rank's shard:

- ``rep``: replicated (norms, router, expert bias, LatentMoE projections);
- ``row`` / ``col``: split on dim 0 / dim 1 over the tensor-parallel group (the expert-TP group
  for routed experts);
- ``vocab``: embedding / LM head, rows padded to a multiple of TP, then split;
- ``qkv``: Megatron's grouped ``[q heads of group g; k_g; v_g]`` fused matrix, split on dim 0;
- ``fc1``: ``[gate_r; up_r]`` when gated (SwiGLU), ``up_r`` otherwise;
- ``mamba_in``: ``in_proj`` rows ``[z; x; B; C; dt]``, each component split over TP and the
  rank's pieces concatenated; ``mamba_conv``: the same for the conv ``[x; B; C]``.

Routed expert ``j`` of EP rank ``e`` (``n`` local experts) is global expert ``e*n + j``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MoeBlock
from autocompress_nemo.blocks import kind_of
from autocompress_nemo.blocks.moe import has_routed_experts
from autocompress_nemo.models.hybrid.names import HfNames, hf_names


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


@dataclass(frozen=True)
class Slot:
    block: int  # -1 for embedding / final norm / LM head
    role: str  # names.py role, or "embed" / "final_norm" / "lm_head"
    expert: int | None
    layout: str
    expert_tp: bool = False


def _groups() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tp=(1, 0, None), etp=(1, 0, None), ep=(1, 0, None))
    return dict(
        tp=(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group(),
        ),
        etp=(
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        ),
        ep=(
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_group(),
        ),
    )


_MAMBA = {
    "norm.weight": ("norm", "rep"),
    "mixer.in_proj.layer_norm_weight": ("norm", "rep"),
    "mixer.in_proj.weight": ("in_proj", "mamba_in"),
    "mixer.conv1d_weight": ("conv_w", "mamba_conv"),
    "mixer.conv1d_bias": ("conv_b", "mamba_conv"),
    "mixer.dt_bias": ("dt_bias", "row"),
    "mixer.A_log": ("A_log", "row"),
    "mixer.D": ("D", "row"),
    "mixer.norm.weight": ("mnorm", "row"),
    "mixer.out_proj.weight": ("out_proj", "col"),
}
_ATTN = {
    "input_layernorm.weight": ("norm", "rep"),
    "self_attention.linear_qkv.layer_norm_weight": ("norm", "rep"),
    "self_attention.linear_qkv.weight": ("qkv", "qkv"),
    "self_attention.linear_qkv.bias": ("qkv_bias", "qkv"),
    "self_attention.linear_proj.weight": ("o", "col"),
    "self_attention.q_layernorm.weight": ("q_norm", "rep"),
    "self_attention.k_layernorm.weight": ("k_norm", "rep"),
}
_DENSE = {
    "pre_mlp_layernorm.weight": ("norm", "rep"),
    "mlp.linear_fc1.layer_norm_weight": ("norm", "rep"),
    "mlp.linear_fc1.weight": ("fc1", "fc1"),
    "mlp.linear_fc2.weight": ("down", "col"),
}
_MOE = {
    "pre_mlp_layernorm.weight": ("norm", "rep"),
    "mlp.router.weight": ("router", "rep"),
    "mlp.router.expert_bias": ("router_bias", "rep"),
    "mlp.fc1_latent_proj.weight": ("latent_down", "rep"),
    "mlp.fc2_latent_proj.weight": ("latent_up", "rep"),
    "mlp.shared_experts.linear_fc1.weight": ("shared_fc1", "fc1"),
    "mlp.shared_experts.linear_fc2.weight": ("shared_down", "col"),
}
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc(1|2)\.weight|linear_fc(1|2)\.weight(\d+))$")


def slot_of(spec: ArchSpec, model: Any, name: str, ep: tuple[int, int, Any]) -> Slot:
    """Where Megatron tensor ``name`` comes from (``KeyError`` if it has no Hugging Face source)."""
    if name == "embedding.word_embeddings.weight":
        return Slot(-1, "embed", None, "vocab")
    if name == "output_layer.weight":
        return Slot(-1, "lm_head", None, "vocab")
    if name in ("decoder.final_norm.weight", "decoder.final_layernorm.weight"):
        return Slot(-1, "final_norm", None, "rep")
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if not m:
        raise KeyError(name)
    layer = model.decoder.layers[int(m.group(1))]
    g, rest = int(layer.layer_number) - 1, m.group(2)
    if getattr(model, "blocks_per_layer", 1) == 2:  # a GPTModel layer: attention block 2l, mlp block 2l+1
        g = 2 * g + int(rest.startswith(("pre_mlp_layernorm.", "mlp.")))
    b = spec.blocks[g]
    table = (
        _MAMBA
        if isinstance(b, MambaBlock)
        else _ATTN
        if isinstance(b, AttentionBlock)
        else _MOE
        if has_routed_experts(b)
        else _DENSE
    )
    if rest in table:
        role, layout = table[rest]
        if isinstance(b, MoeBlock) and not has_routed_experts(b) and role in ("fc1", "down"):
            role = "shared_" + role  # routed experts removed: the shared expert runs as a dense MLP
        return Slot(g, role, None, layout)
    e = _EXPERT.match(rest) if has_routed_experts(b) else None
    if e:
        local = int(e.group(1) if e.group(1) is not None else e.group(4))
        fc = e.group(2) or e.group(3)
        n_local = b.num_experts // ep[0]  # type: ignore[union-attr]
        return Slot(
            g,
            "expert_fc1" if fc == "1" else "expert_down",
            ep[1] * n_local + local,
            "fc1" if fc == "1" else "col",
            expert_tp=True,
        )
    raise KeyError(name)


def _mamba_sizes(b: MambaBlock, conv: bool) -> list[int]:
    gn = b.num_groups * b.state_size
    return [b.d_inner, gn, gn] if conv else [b.d_inner, b.d_inner, gn, gn, b.num_heads]


def shard(
    spec: ArchSpec, names: HfNames, s: Slot, hf: dict[str, torch.Tensor], n: int, r: int, rows: int | None = None
) -> torch.Tensor:
    """This rank's Megatron tensor for slot ``s`` from full Hugging Face tensors."""
    if s.block < 0:
        key = {
            "embed": names.embed,
            "final_norm": names.final_norm,
            "lm_head": names.embed if spec.tied_embeddings else names.lm_head,
        }[s.role]
        t = hf[key]
        if s.layout == "vocab":
            t = torch.cat([t, t.new_zeros(rows * n - t.shape[0], *t.shape[1:])]) if rows * n > t.shape[0] else t  # type: ignore[operator]
            return t.chunk(n, 0)[r]
        return t
    b = spec.blocks[s.block]

    def k(role: str) -> torch.Tensor:
        return hf[names.key(s.block, role, s.expert)]

    if s.layout == "qkv":  # weights, or the biases (Qwen2) for role ``qkv_bias``
        sfx = s.role.removeprefix("qkv")
        return fuse_qkv(k("q" + sfx), k("k" + sfx), k("v" + sfx), b.num_kv_groups).chunk(n, 0)[r]  # type: ignore[union-attr]
    if s.layout == "fc1":
        pre = s.role.removesuffix("fc1")
        up = k(pre + "up").chunk(n, 0)[r]
        return torch.cat([k(pre + "gate").chunk(n, 0)[r], up]) if b.gated else up  # type: ignore[union-attr]
    if s.layout in ("mamba_in", "mamba_conv"):
        parts = k(s.role).split(_mamba_sizes(b, s.layout == "mamba_conv"), dim=0)  # type: ignore[arg-type]
        return torch.cat([p.chunk(n, 0)[r] for p in parts])
    t = k(s.role)
    return t.chunk(n, 0)[r] if s.layout == "row" else t.chunk(n, 1)[r] if s.layout == "col" else t


def _all_gather(t: torch.Tensor, n: int, group: Any) -> list[torch.Tensor]:
    if n == 1:
        return [t.detach()]
    parts = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def unshard(spec: ArchSpec, names: HfNames, s: Slot, t: torch.Tensor, n: int, group: Any) -> dict[str, torch.Tensor]:
    """Full Hugging Face tensor(s) of slot ``s`` from this rank's shard (collective over ``group``)."""
    if s.block < 0:
        name = {"embed": names.embed, "final_norm": names.final_norm, "lm_head": names.lm_head}[s.role]
        full = torch.cat(_all_gather(t, n, group)) if s.layout == "vocab" else t.detach()
        return {name: full[: spec.vocab] if s.layout == "vocab" else full}
    b = spec.blocks[s.block]

    def key(role: str) -> str:
        return names.key(s.block, role, s.expert)

    if s.layout == "rep":
        return {key(s.role): t.detach()}
    parts = _all_gather(t, n, group)
    if s.layout == "row":
        return {key(s.role): torch.cat(parts)}
    if s.layout == "col":
        return {key(s.role): torch.cat(parts, dim=1)}
    if s.layout == "qkv":
        sfx = s.role.removeprefix("qkv")
        q, k_, v = split_qkv(torch.cat(parts), b.num_kv_groups, b.num_heads, b.head_dim)  # type: ignore[union-attr]
        return {key("q" + sfx): q, key("k" + sfx): k_, key("v" + sfx): v}
    if s.layout == "fc1":
        pre = s.role.removesuffix("fc1")
        if not b.gated:  # type: ignore[union-attr]
            return {key(pre + "up"): torch.cat(parts)}
        gates, ups = zip(*(p.chunk(2) for p in parts), strict=True)
        return {key(pre + "gate"): torch.cat(gates), key(pre + "up"): torch.cat(ups)}
    sizes = [x // n for x in _mamba_sizes(b, s.layout == "mamba_conv")]  # type: ignore[arg-type]
    split = [p.split(sizes) for p in parts]
    return {key(s.role): torch.cat([torch.cat([sp[c] for sp in split]) for c in range(len(sizes))])}


def _tensors(model: Any) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)``: parameters plus the routers' expert-bias buffers."""
    out = [(n, p, True) for n, p in model.named_parameters()]
    out += [(n, b, False) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    return out


def hf_to_megatron(spec: ArchSpec, hf_sd: dict[str, torch.Tensor], model: Any) -> None:
    """Load a Hugging Face-named state dict (full tensors) into this rank's model, in place.

    Every model tensor must be found with the right shape and every checkpoint tensor used;
    otherwise one ``ValueError`` lists all mismatches.
    """
    names, g = hf_names(spec), _groups()
    problems: list[str] = []
    with torch.no_grad():
        for name, t, _ in _tensors(model):
            try:
                s = slot_of(spec, model, name, g["ep"])
                n, r, _grp = g["etp"] if s.expert_tp else g["tp"]
                src = shard(spec, names, s, hf_sd, n, r, rows=t.shape[0])
            except KeyError as e:
                problems.append(f"{name}: no checkpoint tensor {e}")
                continue
            if tuple(src.shape) != tuple(t.shape):
                problems.append(f"{name}: model shape {tuple(t.shape)} != checkpoint shape {tuple(src.shape)}")
                continue
            t.copy_(src.to(t.dtype))
    full_model = bool(getattr(model, "pre_process", True) and getattr(model, "post_process", True))
    unused = {k for k in set(hf_sd) - set(hf_shapes(spec)) if not k.endswith("rotary_emb.inv_freq")}
    if spec.tied_embeddings and names.lm_head in unused and torch.equal(hf_sd[names.lm_head], hf_sd[names.embed]):
        unused.discard(names.lm_head)
    if unused and full_model:
        problems.append(
            f"checkpoint tensors not used by the model: {sorted(unused)[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    if problems:
        raise ValueError(f"checkpoint does not match ArchSpec {spec.name!r}:\n  " + "\n  ".join(problems))


def megatron_to_hf(spec: ArchSpec, model: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face-named state dict (float32, CPU, full tensors) of a Megatron model.

    Collective over the TP and EP groups (call on every rank; every rank gets everything).
    ``grads=True`` maps the parameters' ``.grad`` instead (zeros where missing; buffers skipped).
    """
    names, g = hf_names(spec), _groups()
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, t, is_param in _tensors(model):
        if grads and not is_param:
            continue
        if grads:
            t = t.grad if t.grad is not None else torch.zeros_like(t)
        s = slot_of(spec, model, name, g["ep"])
        n, _r, grp = g["etp"] if s.expert_tp else g["tp"]
        (experts if s.expert is not None else out).update(unshard(spec, names, s, t, n, grp))
    ep_n, _, ep_group = g["ep"]
    if ep_n > 1:
        gathered: list[Any] = [None] * ep_n
        torch.distributed.all_gather_object(gathered, {k: v.cpu() for k, v in experts.items()}, group=ep_group)
        experts = {k: v for d in gathered for k, v in d.items()}
    out.update(experts)
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def block_roles(spec: ArchSpec, b: Any) -> list[tuple[str, int | None, tuple[int, ...]]]:
    """``(role, expert, shape)`` of every Hugging Face tensor of one block (none if removed): its
    ``norm``, then its kind's (``blocks/<kind>.roles``)."""
    return [] if b.removed else [("norm", None, (spec.hidden,)), *kind_of(b).roles(spec, b)]


def hf_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of ``spec`` and its shape (removed blocks have none)."""
    names, h = hf_names(spec), spec.hidden
    out: dict[str, tuple[int, ...]] = {names.embed: (spec.vocab, h), names.final_norm: (h,)}
    if not spec.tied_embeddings:
        out[names.lm_head] = (spec.vocab, h)
    for i, b in enumerate(spec.blocks):
        for role, e, shape in block_roles(spec, b):
            out[names.key(i, role, e)] = shape
    return out


def random_hf_state_dict(spec: ArchSpec, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random float32 weights with every tensor of ``spec`` (tests): normal(0, std) matrices,
    norms near 1, Mamba ``A_log = log(1..H)``, ``D`` near 1, ``dt_bias`` so that
    softplus(dt_bias) lies in [0.01, 0.1]."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in hf_shapes(spec).items():
        leaf = k.rsplit(".", 1)[-1] if not k.endswith(".weight") else k.rsplit(".", 2)[-2] + ".weight"
        if k.endswith("A_log"):
            t = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
        elif k.endswith(".D"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif k.endswith("dt_bias"):
            dt = 0.01 + 0.09 * torch.rand(shape, generator=gen)
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif len(shape) == 1 and ("norm" in leaf or k.endswith("norm_f.weight")):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif k.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        sd[k] = t.float()
    return sd

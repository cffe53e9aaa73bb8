"""Importance and reordering of hybrid / MoE models: routed experts, expert ffn neurons, shared-expert
neurons, Mamba heads, attention heads / KV groups, dense-MLP neurons and hidden channels. Reordering
(by the scores, and by arbitrary valid permutations that move whole Mamba groups / KV groups) leaves
the model's logits unchanged; the reordered scores are descending; a unit that writes (or, for a
hidden channel, carries) nothing scores zero.

Tolerance 1e-5 on logits: float32 sums in another order; measured ~1e-7.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_utils import conf_spec, ids, requires_mamba

from autocompress_nemo.arch.spec import AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.names import hf_names
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.rank.importance import collect_importance
from autocompress_nemo.rank.reorder import (
    Permutations,
    apply_permutations,
    permutations_from_scores,
    sorted_importance,
)

TOL = 1e-5


def _logits(spec, sd, x):
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model, forward_logits(model, x)


def _score(spec, sd):
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    batches = [ids(spec, T=16, B=2, seed=s) for s in (10, 11)]
    return collect_importance(model, spec, batches, forward_logits)


def _descending(v: torch.Tensor) -> bool:
    return bool((v[:-1] >= v[1:]).all())


@requires_mamba
def test_sorted_reorder_keeps_logits_nemotron_h(megatron_tp1):
    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=3)
    x = ids(spec)
    _, before = _logits(spec, sd, x)
    imp = _score(spec, sd)
    assert imp.tokens == 64
    perms = permutations_from_scores(spec, imp)
    moe, mamba, attn, mlp = (
        [g for g, b in enumerate(spec.blocks) if isinstance(b, t)]
        for t in (MoeBlock, MambaBlock, AttentionBlock, MlpBlock)
    )
    has = lambda n: {g for g, b in enumerate(perms.blocks) if n in b}  # noqa: E731
    assert has("experts") == has("shared_ffn") == set(moe) and has("mamba_heads") == set(mamba)
    assert has("heads") == has("groups") == set(attn) and has("ffn") == set(mlp) and attn and mlp
    for kind in ("experts", "shared_ffn", "mamba_heads", "heads", "ffn"):
        assert any(not torch.equal(b[kind], torch.arange(len(b[kind]))) for b in perms.blocks if kind in b), (
            f"every {kind} permutation is the identity: the invariance check would be vacuous"
        )
    assert perms.hidden is not None and not torch.equal(perms.hidden, torch.arange(spec.hidden))
    _, after = _logits(spec, apply_permutations(spec, sd, perms), x)
    err = (after - before).abs().max().item()
    print(f"score-sorted reorder: max |dlogits| = {err:.2e}")
    assert err < TOL
    s = sorted_importance(spec, imp, perms)
    for g in moe:
        assert _descending(s.blocks[g]["experts"]) and _descending(s.blocks[g]["shared_ffn"])
        assert all(_descending(row) for row in s.blocks[g]["expert_ffn"])
    for g, field, n_groups in [(g, "mamba_heads", spec.blocks[g].num_groups) for g in mamba] + [
        (g, "heads", spec.blocks[g].num_kv_groups) for g in attn
    ]:
        per_group = s.blocks[g][field].view(n_groups, -1)
        assert _descending(per_group.sum(1)) and all(_descending(row) for row in per_group)
    assert all(_descending(s.blocks[g]["ffn"]) for g in mlp) and _descending(s.hidden)


@requires_mamba
def test_arbitrary_valid_permutations_keep_logits(megatron_tp1):
    """Random expert / neuron / hidden orders, Mamba group and KV group swaps (not just what the scores gave)."""
    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=4)
    x = ids(spec)
    _, before = _logits(spec, sd, x)
    gen = torch.Generator().manual_seed(0)
    p = Permutations(blocks=[{} for _ in spec.blocks])
    for g, b in enumerate(spec.blocks):
        o = p.blocks[g]
        if isinstance(b, MoeBlock):
            o["experts"] = torch.randperm(b.num_experts, generator=gen)
            o["expert_ffn"] = torch.stack([torch.randperm(b.expert_ffn, generator=gen) for _ in range(b.num_experts)])
            o["shared_ffn"] = torch.randperm(b.shared_ffn, generator=gen)
        if isinstance(b, MambaBlock):
            hpg = b.num_heads // b.num_groups
            groups = torch.arange(b.num_groups).flip(0)
            o["mamba_groups"] = groups
            o["mamba_heads"] = torch.cat([gi * hpg + torch.randperm(hpg, generator=gen) for gi in groups.tolist()])
        if isinstance(b, AttentionBlock):
            hpg = b.heads_per_group
            o["groups"] = torch.arange(b.num_kv_groups).flip(0)
            o["heads"] = torch.cat([gi * hpg + torch.randperm(hpg, generator=gen) for gi in o["groups"].tolist()])
        if isinstance(b, MlpBlock):
            o["ffn"] = torch.randperm(b.ffn, generator=gen)
    p.hidden = torch.randperm(spec.hidden, generator=gen)
    _, after = _logits(spec, apply_permutations(spec, sd, p), x)
    assert (after - before).abs().max().item() < TOL


@requires_mamba
def test_silent_expert_and_head_score_zero(megatron_tp1):
    spec = conf_spec("tiny_hybrid")
    names = hf_names(spec)
    sd = random_hf_state_dict(spec, seed=5)
    g_moe = next(g for g, b in enumerate(spec.blocks) if isinstance(b, MoeBlock))
    g_mamba = next(g for g, b in enumerate(spec.blocks) if isinstance(b, MambaBlock))
    g_attn = next(g for g, b in enumerate(spec.blocks) if isinstance(b, AttentionBlock))
    g_mlp = next(g for g, b in enumerate(spec.blocks) if isinstance(b, MlpBlock))
    p_dim, d = spec.blocks[g_mamba].head_dim, spec.blocks[g_attn].head_dim
    sd[names.key(g_moe, "expert_down", 1)] = torch.zeros_like(sd[names.key(g_moe, "expert_down", 1)])
    sd[names.key(g_mamba, "out_proj")][:, 2 * p_dim : 3 * p_dim] = 0.0
    sd[names.key(g_attn, "o")][:, 1 * d : 2 * d] = 0.0  # query head 1 writes nothing
    sd[names.key(g_mlp, "down")][:, 5] = 0.0  # MLP neuron 5 writes nothing
    for g in range(len(spec.blocks)):  # hidden channel 7 is zeroed by every block's norm
        sd[names.key(g, "norm")][7] = 0.0
    imp = _score(spec, sd)
    experts, heads = imp.blocks[g_moe]["experts"], imp.blocks[g_mamba]["mamba_heads"]
    assert experts[1] == 0 and (experts[[0, 2, 3]] > 0).all()
    assert heads[2] == 0 and (heads[[0, 1, 3]] > 0).all()
    attn, ffn, hidden = imp.blocks[g_attn]["heads"], imp.blocks[g_mlp]["ffn"], imp.hidden
    assert attn[1] == 0 and (attn[[0, 2, 3]] > 0).all()
    assert ffn[5] == 0 and (ffn > 0).sum() == len(ffn) - 1
    assert hidden[7] == 0 and (hidden > 0).sum() == spec.hidden - 1
    perms = permutations_from_scores(spec, imp)
    pb = perms.blocks
    assert pb[g_moe]["experts"][-1] == 1 and pb[g_mlp]["ffn"][-1] == 5 and perms.hidden[-1] == 7
    assert pb[g_attn]["groups"][-1] == 0 and pb[g_attn]["heads"][-1] == 1  # head 1 last in KV group 0


@pytest.mark.parametrize("tied", [False, True])
def test_reorder_keeps_logits_qwen3_moe(megatron_tp1, tied):
    """Experts, attention heads (RoPE, per-head q / k norms) and hidden channels (tied embeddings too)."""
    spec = conf_spec("tiny_moe").replace(tied_embeddings=tied)
    sd = random_hf_state_dict(spec, seed=6)
    x = ids(spec)
    _, before = _logits(spec, sd, x)
    perms = permutations_from_scores(spec, _score(spec, sd))
    has = lambda n: sum(n in b for b in perms.blocks)  # noqa: E731
    assert has("experts") == has("heads") == 4 and not has("shared_ffn") and not has("mamba_heads")
    assert perms.hidden is not None and not torch.equal(perms.hidden, torch.arange(spec.hidden))
    assert any(not torch.equal(b["heads"], torch.arange(len(b["heads"]))) for b in perms.blocks if "heads" in b)
    _, after = _logits(spec, apply_permutations(spec, sd, perms), x)
    assert (after - before).abs().max().item() < TOL

"""Importance and reordering for routed experts, expert ffn neurons, shared-expert neurons and Mamba
heads: reordering (by the scores, and by arbitrary valid permutations that move whole Mamba groups)
leaves the model's logits unchanged; the reordered scores are descending; an expert / a head that
writes nothing scores zero.

Tolerance 1e-5 on logits: float32 sums in another order; measured ~1e-7.
"""

from __future__ import annotations

import torch
from hybrid_utils import conf_spec, ids, requires_mamba

from autocompress_nemo.arch.spec import MambaBlock, MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.names import hf_names
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.rank.moe_mamba import (
    MoeMambaPermutations,
    apply_moe_mamba_permutations,
    collect_moe_mamba_importance,
    permutations_from_scores,
    sorted_scores,
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
    return collect_moe_mamba_importance(model, spec, batches, forward_logits)


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
    moe = [g for g, b in enumerate(spec.blocks) if isinstance(b, MoeBlock)]
    mamba = [g for g, b in enumerate(spec.blocks) if isinstance(b, MambaBlock)]
    assert set(perms.experts) == set(perms.shared_ffn) == set(moe) and set(perms.mamba_heads) == set(mamba)
    moved = [not torch.equal(t, torch.arange(len(t))) for t in (*perms.experts.values(), *perms.shared_ffn.values(),
                                                                *perms.mamba_heads.values())]
    assert any(moved), "every permutation is the identity: the invariance check would be vacuous"
    _, after = _logits(spec, apply_moe_mamba_permutations(spec, sd, perms), x)
    err = (after - before).abs().max().item()
    print(f"score-sorted reorder: max |dlogits| = {err:.2e}")
    assert err < TOL
    s = sorted_scores(imp, perms)
    for g in moe:
        assert _descending(s.blocks[g].experts) and _descending(s.blocks[g].shared_ffn)
        assert all(_descending(row) for row in s.blocks[g].expert_ffn)
    for g in mamba:
        b = spec.blocks[g]
        per_group = s.blocks[g].mamba_heads.view(b.num_groups, -1)
        assert _descending(per_group.sum(1)) and all(_descending(row) for row in per_group)


@requires_mamba
def test_arbitrary_valid_permutations_keep_logits(megatron_tp1):
    """Random expert / neuron orders and Mamba group swaps (not just what the scores gave)."""
    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=4)
    x = ids(spec)
    _, before = _logits(spec, sd, x)
    gen = torch.Generator().manual_seed(0)
    p = MoeMambaPermutations()
    for g, b in enumerate(spec.blocks):
        if isinstance(b, MoeBlock):
            p.experts[g] = torch.randperm(b.num_experts, generator=gen)
            p.expert_ffn[g] = torch.stack([torch.randperm(b.expert_ffn, generator=gen) for _ in range(b.num_experts)])
            p.shared_ffn[g] = torch.randperm(b.shared_ffn, generator=gen)
        if isinstance(b, MambaBlock):
            hpg = b.num_heads // b.num_groups
            groups = torch.arange(b.num_groups).flip(0)
            p.mamba_groups[g] = groups
            p.mamba_heads[g] = torch.cat([gi * hpg + torch.randperm(hpg, generator=gen) for gi in groups.tolist()])
    _, after = _logits(spec, apply_moe_mamba_permutations(spec, sd, p), x)
    assert (after - before).abs().max().item() < TOL


@requires_mamba
def test_silent_expert_and_head_score_zero(megatron_tp1):
    spec = conf_spec("tiny_hybrid")
    names = hf_names(spec)
    sd = random_hf_state_dict(spec, seed=5)
    g_moe = next(g for g, b in enumerate(spec.blocks) if isinstance(b, MoeBlock))
    g_mamba = next(g for g, b in enumerate(spec.blocks) if isinstance(b, MambaBlock))
    p_dim = spec.blocks[g_mamba].head_dim
    sd[names.key(g_moe, "expert_down", 1)] = torch.zeros_like(sd[names.key(g_moe, "expert_down", 1)])
    sd[names.key(g_mamba, "out_proj")][:, 2 * p_dim : 3 * p_dim] = 0.0
    imp = _score(spec, sd)
    experts, heads = imp.blocks[g_moe].experts, imp.blocks[g_mamba].mamba_heads
    assert experts[1] == 0 and (experts[[0, 2, 3]] > 0).all()
    assert heads[2] == 0 and (heads[[0, 1, 3]] > 0).all()
    assert permutations_from_scores(spec, imp).experts[g_moe][-1] == 1


def test_expert_reorder_keeps_logits_qwen3_moe(megatron_tp1):
    spec = conf_spec("tiny_moe")
    sd = random_hf_state_dict(spec, seed=6)
    x = ids(spec)
    _, before = _logits(spec, sd, x)
    perms = permutations_from_scores(spec, _score(spec, sd))
    assert len(perms.experts) == 4 and not perms.shared_ffn and not perms.mamba_heads
    _, after = _logits(spec, apply_moe_mamba_permutations(spec, sd, perms), x)
    assert (after - before).abs().max().item() < TOL

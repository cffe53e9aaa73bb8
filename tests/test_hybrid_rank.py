"""Rank stage of hybrid / MoE parents beyond experts and Mamba heads: attention heads / KV groups,
dense-MLP neurons and hidden channels.

- Reordering by the measured scores leaves transformers' own ``NemotronHForCausalLM`` unchanged
  (an implementation independent of the Megatron builder the scores come from), on the tiny
  hybrid and on a heterogeneous one (removed blocks, a shared-expert-only MoE block); LatentMoE
  (experts in a latent space, hidden reordered around them) leaves Megatron's logits unchanged.
- The scores survive the JSON round trip; a file of an older layout is refused by name.
- ``extract.repair.option_importance`` gives every option the summed sorted scores it keeps
  (attention and MLP options included) and refuses a rank artifact without them.
- TP=2 and EP=2 (2 gloo processes) give the same global scores as one process; the dense scorer
  with sequence parallelism (TP=2) gives the dense scores of TP=1.

Tolerances: logits 1e-5 (float32 sums in another order, measured ~1e-7); scores across parallel
layouts rtol 1e-5 (float32 activations reduced in another order, accumulated in float64).
"""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_utils import ALL_CAPS, conf_spec, hetero_hybrid_spec, ids, requires_mamba, transformers_nemotron_h

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock, MoeBlock
from autocompress_nemo.models.builder import build_model, forward_logits
from autocompress_nemo.models.hybrid import hf_to_megatron
from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict
from autocompress_nemo.rank.importance import Importance, collect_importance
from autocompress_nemo.rank.reorder import (
    Permutations,
    apply_permutations,
    permutations_from_scores,
    sorted_importance,
)

TOL = 1e-5


def _model(spec: ArchSpec, sd: dict) -> torch.nn.Module:
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return model


def _score(spec: ArchSpec, sd: dict) -> Importance:
    batches = [ids(spec, T=16, B=2, seed=s) for s in (10, 11)]
    return collect_importance(_model(spec, sd), spec, batches, forward_logits)


@pytest.fixture
def hf_torch_mamba(monkeypatch):
    """transformers' NemotronH with its pure-PyTorch Mamba ops (mamba-ssm's Triton kernels need CUDA)."""
    mn = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    for f in ("mamba2_chunk_scan", "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined"):
        monkeypatch.setattr(mn, f, getattr(mn, f).__wrapped__)


@requires_mamba
@pytest.mark.parametrize("name", ["tiny_hybrid", "hetero"])
def test_sorted_reorder_keeps_transformers_nemotron_h(megatron_tp1, hf_torch_mamba, name):
    spec = conf_spec("tiny_hybrid") if name == "tiny_hybrid" else hetero_hybrid_spec()
    sd = random_hf_state_dict(spec, seed=7)
    perms = permutations_from_scores(spec, _score(spec, sd))
    moved = {
        k: [g for g, b in enumerate(perms.blocks) if k in b and not torch.equal(b[k], torch.arange(len(b[k])))]
        for k in ("heads", "groups", "ffn", "shared_ffn", "mamba_heads", "experts")
    }
    assert moved["heads"] and moved["ffn"] and not torch.equal(perms.hidden, torch.arange(spec.hidden)), moved
    x = ids(spec, T=10, B=2, seed=4)
    with torch.no_grad():
        before = transformers_nemotron_h(spec, sd)(x).logits
        after = transformers_nemotron_h(spec, apply_permutations(spec, sd, perms))(x).logits
    err = (after - before).abs().max().item()
    print(f"{spec.name}: transformers NemotronH logits before vs after the sorted reorder: {err:.2e}")
    assert before.abs().max() > 0.5 and err < TOL


@requires_mamba
def test_latent_moe_hidden_reorder_keeps_logits(megatron_tp1):
    """LatentMoE: router and latent projections move with the hidden channels, the experts do not."""
    base = conf_spec("tiny_hybrid")
    spec = base.replace(
        blocks=tuple(MoeBlock(4, 48, 2, 64, 32, "relu2") if isinstance(b, MoeBlock) else b for b in base.blocks),
        name="tiny_latent",
    )
    sd = random_hf_state_dict(spec, seed=8)
    x = ids(spec)
    before = forward_logits(_model(spec, sd), x)
    perms = permutations_from_scores(spec, _score(spec, sd))
    after = forward_logits(_model(spec, apply_permutations(spec, sd, perms)), x)
    assert (after - before).abs().max().item() < TOL


@requires_mamba
def test_scores_json_round_trip_and_option_importance(megatron_tp1):
    from autocompress_nemo.extract.repair import option_importance
    from autocompress_nemo.search.space import build_space

    spec = conf_spec("tiny_hybrid")
    imp = _score(spec, random_hf_state_dict(spec, seed=9))
    perms = permutations_from_scores(spec, imp)
    back = Importance.from_dict(json.loads(json.dumps(imp.to_dict())))
    assert back.tokens == imp.tokens and torch.equal(back.hidden, imp.hidden)
    for a, b in zip(imp.blocks, back.blocks, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert {"heads", "ffn", "mamba_heads", "experts", "expert_ffn", "shared_ffn"} == {n for b in imp.blocks for n in b}
    p_back = Permutations.from_dict(json.loads(json.dumps(perms.to_dict())))
    assert torch.equal(p_back.hidden, perms.hidden)
    for a, b in zip(perms.blocks, p_back.blocks, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    old = {"tokens": 3, "hidden": [1.0], "layers": [{"heads": [1.0], "ffn": [2.0], "attn_block": 1, "mlp_block": 1}]}
    with pytest.raises(ValueError, match="older build"):
        Importance.from_dict(old)

    caps = {**ALL_CAPS, "vary_top_k": False, "remove_moe": False}
    decisions = build_space(spec, caps)
    s = sorted_importance(spec, imp, perms)
    rows = option_importance(decisions, s)
    kinds = {d.kind for d in decisions}
    assert {"attention", "mlp", "mamba", "moe_routed", "moe_shared"} <= kinds
    for d, row in zip(decisions, rows, strict=True):
        b, sb = spec.blocks[d.block_index], s.blocks[d.block_index]
        name = {"attention": "heads", "mlp": "ffn", "mamba": "mamba_heads", "moe_routed": "expert_ffn"}.get(
            d.kind, "shared_ffn"
        )
        full = sb[name].sum().item()
        assert row[-1] == pytest.approx(full)  # the parent option keeps every unit
        for o, v in zip(d.options, row, strict=True):
            if o.removed:
                assert v == 0.0
            elif isinstance(o, AttentionBlock):  # first H'/G' heads of each of the first G' groups, by hand
                kept = sb["heads"].view(b.num_kv_groups, -1)[: o.num_kv_groups, : o.heads_per_group].sum().item()
                assert v == pytest.approx(kept)
            elif isinstance(o, MlpBlock):
                assert v == pytest.approx(sb["ffn"][: o.ffn].sum().item())
        if d.kind == "mlp":  # wider keeps more (sorted scores are non-negative)
            assert row == sorted(row) and row[1] < row[-1]
    g_attn = next(d.block_index for d in decisions if d.kind == "attention")
    del s.blocks[g_attn]["heads"]
    with pytest.raises(ValueError, match="no 'heads' scores"):
        option_importance(decisions, s)


# -- parallel layouts -------------------------------------------------------------------------------
def _scores_on_rank(rank: int, world: int, hybrid_json: str, hybrid_sd: dict, x_BT: torch.Tensor) -> dict:
    """TP=world (hybrid, then dense with sequence parallelism), then EP=world (hybrid, one share of
    the batch per rank); at world 1 the references of both."""
    import warnings

    warnings.filterwarnings("ignore")
    from autocompress_nemo.distributed import init_distributed
    from tests.method_utils import tiny_parent

    spec = ArchSpec.from_json(hybrid_json)
    init_distributed(tp=world, ep=1)
    out = {"tp": collect_importance(_model(spec, hybrid_sd), spec, [x_BT], forward_logits).to_dict()}
    dspec, dsd = tiny_parent()
    dmodel = build_model(dspec, sequence_parallel=world > 1)
    hf_to_megatron(dspec, dsd, dmodel)
    out["dense_sp"] = collect_importance(dmodel, dspec, [x_BT % dspec.vocab], forward_logits).to_dict()
    init_distributed(tp=1, ep=world)
    share = x_BT.shape[0] // world
    out["ep"] = collect_importance(
        _model(spec, hybrid_sd), spec, [x_BT[rank * share : (rank + 1) * share]], forward_logits
    ).to_dict()
    init_distributed(tp=1, ep=1) if world == 1 else None
    return out


def _close(a: object, b: object, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")  # type: ignore[index]
    elif isinstance(a, list) and a and isinstance(a[0], dict):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):  # type: ignore[call-overload]
            _close(u, v, f"{where}[{i}]")
    elif a is None or isinstance(a, int) or (isinstance(a, list) and not a):
        assert a == b, where
    else:
        ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert ta.shape == tb.shape and torch.allclose(ta, tb, rtol=1e-5, atol=1e-7), (where, (ta - tb).abs().max())


@requires_mamba
@pytest.mark.distributed
def test_tp2_and_ep2_scores_equal_one_process(megatron_tp1):
    from autocompress_nemo.distributed.spawn import spawn

    spec = conf_spec("tiny_hybrid")
    sd = random_hf_state_dict(spec, seed=11)
    x = ids(spec, T=16, B=2, seed=12)
    ref = _scores_on_rank(0, 1, spec.to_json(), sd, x)
    for r, got in enumerate(spawn(_scores_on_rank, 2, spec.to_json(), sd, x)):
        for layout in ("tp", "dense_sp", "ep"):
            _close(ref[layout], got[layout], f"rank {r} {layout}")
    blocks = ref["tp"]["blocks"]
    assert ref["tp"]["hidden"] is not None and all(
        ("heads" in blocks[g]) == isinstance(b, AttentionBlock) for g, b in enumerate(spec.blocks)
    )

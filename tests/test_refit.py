"""The least-squares re-fit of a narrower child's output projections (``extract/compensate.py``):
the closed form equals a least-squares solve on the captured activations, it lowers every
re-fit block's output error, a kept-whole child is left alone, and the Gram matrices are the
same at TP=2 (inputs gathered over the row-parallel shards) as at TP=1."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_hetero_spec

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.extract.compensate import collect_grams, refit_blocks, refit_state_dict
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.models.builder import forward_logits
from autocompress_nemo.models.llama.reference import random_hf_state_dict
from autocompress_nemo.models.megatron import block_layers
from tests.method_utils import megatron_from_hf


@pytest.fixture(autouse=True)
def _dist(megatron_tp1):
    from autocompress_nemo.distributed import init_distributed

    init_distributed(tp=1)
    yield


def _batches(vocab: int, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 24), generator=g) for _ in range(n)]


def _narrow(spec: ArchSpec) -> ArchSpec:
    """Half of every MLP's neurons; attention 4 heads / 2 groups -> 2 heads / 2 groups, 6/2 -> 4/2."""
    blocks = []
    for b in spec.blocks:
        if b.kind == "mlp" and b.ffn:
            b = dataclasses.replace(b, ffn=b.ffn // 2)
        elif b.kind == "attention" and b.num_heads > 2:
            b = dataclasses.replace(b, num_heads=b.num_heads - 2)
        blocks.append(b)
    return dataclasses.replace(spec, blocks=tuple(blocks), name="narrow")


def test_refit_is_the_least_squares_solution_and_lowers_every_output_error() -> None:
    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=1, std=0.2)
    child = _narrow(spec)
    blocks = refit_blocks(spec, child)
    assert sorted(blocks) == [0, 1, 5, 6, 7], blocks  # narrowed attention 0, 6; mlp 1, 5, 7 (2: kept; 3, 4: removed)
    model = megatron_from_hf(spec, sd)
    batches = _batches(spec.vocab)

    captured: dict[int, list[torch.Tensor]] = {i: [] for i in blocks}
    layers = block_layers(model)
    from autocompress_nemo.blocks import kind_of

    handles = [
        kind_of(spec.blocks[i])
        .refit_site(layers[i])
        .register_forward_pre_hook(lambda m, a, i=i: captured[i].append(a[0].reshape(-1, a[0].shape[-1]).double()))
        for i in blocks
    ]
    grams, tokens = collect_grams(model, spec, blocks, batches, forward_logits)
    for h in handles:
        h.remove()
    assert tokens == sum(b.numel() for b in batches)

    child_sd = slice_state_dict(spec, sd, child)
    new_sd, records = refit_state_dict(spec, sd, child, child_sd, grams, ridge=0.0)
    from autocompress_nemo.models.hybrid.names import hf_names

    names = hf_names(spec)
    assert [r["block"] for r in records] == sorted(blocks)
    for r in records:
        i, (role, kept) = r["block"], blocks[r["block"]]
        x = torch.cat(captured[i])
        w = sd[names.key(i, role, None)].double()
        ref = torch.linalg.lstsq(x[:, kept], x @ w.T).solution.T  # min ||X_K V^T - X W^T||
        got = new_sd[names.key(i, role, None)].double()
        assert torch.allclose(got, ref.float().double(), atol=2e-4, rtol=1e-3), (i, (got - ref).abs().max())
        assert 0 < r["refit_error"] < r["sliced_error"] < 1, r
        assert "kept_slice" not in r
        # every other tensor is the slice's
    untouched = set(child_sd) - {names.key(r["block"], blocks[r["block"]][0], None) for r in records}
    assert untouched and all(new_sd[k] is child_sd[k] for k in untouched)

    # the student built from the re-fit weights is closer to the parent than the plain slice
    def kd(weights: dict) -> float:
        from autocompress_nemo.distill.kd import kd_loss

        s = megatron_from_hf(child, weights)
        with torch.no_grad():
            return sum(float(kd_loss(forward_logits(s, b), forward_logits(model, b), 1.0)) for b in batches)

    assert kd(new_sd) < kd(child_sd)


def test_the_ridge_pulls_toward_the_slice() -> None:
    """A huge ridge gives back the plain slice (not zero weights); a moderate one lands in between."""
    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=3, std=0.2)
    child = _narrow(spec)
    blocks = refit_blocks(spec, child)
    grams, _ = collect_grams(megatron_from_hf(spec, sd), spec, blocks, _batches(spec.vocab), forward_logits)
    child_sd = slice_state_dict(spec, sd, child)
    far, _ = refit_state_dict(spec, sd, child, child_sd, grams, ridge=1e6)
    free, _ = refit_state_dict(spec, sd, child, child_sd, grams, ridge=0.0)
    mid, recs = refit_state_dict(spec, sd, child, child_sd, grams, ridge=0.03)
    from autocompress_nemo.models.hybrid.names import hf_names

    names = hf_names(spec)
    for r in recs:
        k = names.key(r["block"], blocks[r["block"]][0], None)
        assert torch.allclose(far[k], child_sd[k], atol=1e-4)
        assert 0 < (mid[k] - child_sd[k]).norm() < (free[k] - child_sd[k]).norm()
        assert r["refit_error"] < r["sliced_error"]


def test_a_child_kept_whole_has_nothing_to_refit_and_a_negative_ridge_is_refused() -> None:
    spec = tiny_hetero_spec()
    assert refit_blocks(spec, spec) == {}
    sd = random_hf_state_dict(spec, seed=1, std=0.2)
    with pytest.raises(ValueError, match="extract.ridge=-1.0"):
        refit_state_dict(spec, sd, spec, sd, {}, ridge=-1.0)


def _grams_at(rank: int, world: int, spec_json: str, hf_sd: dict, ids: list) -> dict:
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.llama import hf_to_megatron

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=world, seed=0)
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    grams, _ = collect_grams(model, spec, refit_blocks(spec, _narrow(spec)), ids, forward_logits)
    return grams


@pytest.mark.distributed
def test_grams_at_tp2_equal_tp1() -> None:
    from autocompress_nemo.distributed.spawn import spawn

    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=2, std=0.2)
    ids = _batches(spec.vocab, 2)
    ref = _grams_at(0, 1, spec.to_json(), sd, ids)
    for grams in spawn(_grams_at, 2, spec.to_json(), sd, ids):
        assert set(grams) == set(ref)
        for i in ref:
            assert torch.allclose(grams[i], ref[i], rtol=1e-5, atol=1e-6 * float(ref[i].abs().max())), i


def test_sequential_refit_solves_each_block_on_the_students_own_inputs() -> None:
    """``extract.refit=sequential``: every re-fit block's projection is the least-squares map from
    the inputs the re-fit student itself feeds that block (its earlier blocks already re-fit) to what
    the parent's block wrote on the parent's inputs; the first block equals the parallel re-fit (its
    inputs are the parent's), the removed blocks 3 and 4 are passed through, and the student is
    closer to the parent than the plain slice."""
    from autocompress_nemo.blocks import kind_of
    from autocompress_nemo.distill.kd import kd_loss
    from autocompress_nemo.extract.compensate import sequential_refit
    from autocompress_nemo.models.hybrid.names import hf_names

    spec = tiny_hetero_spec()
    sd = random_hf_state_dict(spec, seed=1, std=0.2)
    child = _narrow(spec)
    blocks = refit_blocks(spec, child)
    parent_m = megatron_from_hf(spec, sd)
    batches = _batches(spec.vocab)
    child_sd = slice_state_dict(spec, sd, child)
    live = megatron_from_hf(child, child_sd)
    seq_sd, recs, tokens = sequential_refit(parent_m, live, spec, sd, child, child_sd, batches, forward_logits, 0.0)
    assert tokens == sum(b.numel() for b in batches)
    assert [r["block"] for r in recs] == sorted(blocks) and not any(r.get("kept_slice") for r in recs)
    grams, _ = collect_grams(parent_m, spec, blocks, batches, forward_logits)
    par_sd, _ = refit_state_dict(spec, sd, child, child_sd, grams, ridge=0.0)
    names = hf_names(spec)
    first = names.key(0, blocks[0][0], None)
    assert torch.allclose(seq_sd[first], par_sd[first], atol=1e-4)

    student = megatron_from_hf(child, seq_sd)  # the final student: block i's inputs are what the re-fit saw
    cap: dict[str, list[torch.Tensor]] = {}

    def hook(tag: str):  # noqa: ANN202
        return lambda m, a: cap.setdefault(tag, []).append(a[0].reshape(-1, a[0].shape[-1]).double())

    hs = [
        kind_of(spec.blocks[i]).refit_site(block_layers(parent_m)[i]).register_forward_pre_hook(hook(f"p{i}"))
        for i in blocks
    ]
    hs += [
        kind_of(child.blocks[i]).refit_site(block_layers(student)[i]).register_forward_pre_hook(hook(f"s{i}"))
        for i in blocks
    ]
    with torch.no_grad():
        for b in batches:
            forward_logits(parent_m, b)
            forward_logits(student, b)
    for h in hs:
        h.remove()
    for i, (role, _kept) in blocks.items():
        w = sd[names.key(i, role, None)].double()
        xs, xp = torch.cat(cap[f"s{i}"]), torch.cat(cap[f"p{i}"])
        ref = torch.linalg.lstsq(xs, xp @ w.T).solution.T
        got = seq_sd[names.key(i, role, None)].double()
        assert torch.allclose(got, ref, atol=2e-4, rtol=1e-3), (i, (got - ref).abs().max())
    for r in recs:
        assert 0 < r["refit_error"] < r["sliced_error"], r

    def kd(weights: dict) -> float:
        s = megatron_from_hf(child, weights)
        with torch.no_grad():
            return sum(float(kd_loss(forward_logits(s, b), forward_logits(parent_m, b), 1.0)) for b in batches)

    assert kd(seq_sd) < kd(child_sd)

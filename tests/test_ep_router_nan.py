"""Regression: NaN router logits in the hybrid router search (EP=2, ``search=quick``).

Cause: the CPU Mamba-2 scan. mamba-ssm's reference ``ssd_chunk_scan_combined_ref`` (the CPU
stand-in for the Triton kernel) builds the decay matrices ``exp(cs_l - cs_s)`` over *all*
``(l, s)`` and masks the acausal half (``s > l``) afterwards. Those entries are
``+sum(dt * |A|)`` over up to a chunk (or over whole chunks, across chunks) and overflow float32
``exp`` above ~88.7: the forward is still finite (masked to 0), but the backward multiplies the
zero gradient of the masked entries by ``exp = inf``: ``0 * inf = NaN`` into ``dt``, ``B``,
``C`` and from there into every earlier layer and every router logit. The KD loss and the
expected costs stay finite; the router's logits become NaN after the Adam step. The first Mamba
block is harmless (nothing upstream of it needs a gradient); the second one's ``dt`` depends on
the residual stream, i.e. on the searched masks, so a search that drives blocks to their smallest
options can push one of its heads over the limit (on the tiny hybrid the largest chunk sum of
that block goes from ~45 with the parent to ~82 with Mamba 0 removed). Under EP=2 each DP rank
scans its own row; the rank that overflows turns the all-reduced router gradient NaN on both.

Fix (``models.compat_cpu._ssd_scan_reference``): the same chunked decomposition with the decay
matrices masked to ``-inf`` *before* ``exp``; the forward is unchanged.

Here the second Mamba block's ``dt_bias`` is raised by 1 so that its chunk sum exceeds the
limit on the search batches (checked), and the router search must take every step (no step
skipped by the non-finite-gradient guard), finite, at EP=2 as at EP=1.
"""

from __future__ import annotations

import math

import pytest
import torch
from hybrid_utils import requires_mamba

pytestmark = [requires_mamba]

EXP_LIMIT = math.log(torch.finfo(torch.float32).max)  # ~88.72
OVERRIDES = ["model=tiny_hybrid", "+target=tiny_hybrid_eager_cpu", "search=quick"]
SEARCH = dict(
    steps=3,
    router_lr=0.3,
    weight_lr=3e-3,
    tau_start=1.0,
    tau_end=0.5,
    kd_temperature=1.0,
    penalty_over=20.0,
    penalty_under=1.0,
    slack=0.05,
    train_weights=False,
    checkpoint_every=0,
)
DT_SHIFT = 1.0


def _scan_inputs(L: int, dt_bias: float, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    b, h, p, groups, n = 2, 4, 8, 2, 16
    leaf = [
        torch.randn(s, generator=g).requires_grad_()
        for s in ((b, L, h, p), (b, L, h), (b, L, groups, n), (b, L, groups, n), (b, L, h, p))
    ]
    x, dt, B, C, z = leaf
    return x, dt, -torch.arange(1.0, h + 1), B, C, torch.randn(h, generator=g), z, torch.full((h,), dt_bias)


def _scan(fn, args: tuple, chunk: int, pad_here: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
    x, dt, A, B, C, D, z, bias = args
    L = x.shape[1]
    pad = (-L) % chunk if pad_here else 0

    def p(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t

    y = fn(p(x), p(dt), A, p(B), p(C), chunk, D=D, z=p(z), dt_bias=bias, dt_softplus=True)[:, :L]
    w = torch.linspace(-1.0, 1.0, y.numel()).view_as(y)
    return y.detach(), list(torch.autograd.grad((y * w).sum(), [x, dt, B, C, z]))


def test_cpu_ssd_scan_backward_finite_past_exp_overflow() -> None:
    """The CPU scan equals mamba-ssm's reference forward bitwise and its gradients where those are
    finite; where a chunk's decay sum passes ``exp``'s range the reference's backward is NaN and
    ours stays finite."""
    from autocompress_nemo.models import compat_cpu

    compat_cpu.apply()
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref

    kinds = set()
    # chunk sums of dt*|A|: 27, 37 (in range), 91 (just past ~88.7), 891 (far past)
    for L, chunk, bias in ((37, 16, -2.0), (128, 128, -3.0), (128, 128, -2.0), (100, 32, 2.0)):
        args = _scan_inputs(L, bias)
        dt = torch.nn.functional.softplus(args[1].detach() + bias) * torch.arange(1.0, 5.0)
        overflow = float(dt.sum(dim=1).max()) > EXP_LIMIT  # acausal entries of the reference's decay
        y, grads = _scan(compat_cpu._ssd_scan_reference, args, chunk, pad_here=False)
        y_ref, grads_ref = _scan(ssd_chunk_scan_combined_ref, args, chunk, pad_here=True)
        assert torch.equal(y, y_ref), f"L={L} chunk={chunk}: forward differs from mamba-ssm's reference"
        assert all(bool(torch.isfinite(gr).all()) for gr in grads), (
            f"L={L} chunk={chunk} dt_bias={bias}: NaN/inf gradient"
        )
        ref_finite = all(bool(torch.isfinite(gr).all()) for gr in grads_ref)
        assert ref_finite != overflow, f"L={L} chunk={chunk}: the case does not test what it says"
        kinds.add(overflow)
        if ref_finite:
            for a, r in zip(grads, grads_ref, strict=True):
                torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    assert kinds == {False, True}


def _search(rank: int, world: int, out_dir: str) -> dict:
    """The router search on the tiny hybrid at EP=``world`` with the second Mamba block's
    ``dt_bias`` raised by ``DT_SHIFT``: trajectory, probabilities and the largest chunk sum seen."""
    import warnings

    warnings.filterwarnings("ignore")
    from autocompress_nemo.arch.counts import param_count
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.context import Context
    from autocompress_nemo.models.builder import forward_logits
    from autocompress_nemo.search.autocompress import run_router_search
    from autocompress_nemo.search.space import build_space
    from autocompress_nemo.stages import common as stages
    from tests.cfg_utils import search_cfg
    from tests.method_utils import ParamCost

    cfg = compose([*OVERRIDES, f"run_dir={out_dir}/run", f"cluster.ep={world}", f"cluster.processes_per_node={world}"])
    ctx = Context(cfg, say=lambda s: None)
    spec, sd, _ = ctx.parent
    model = ctx.model(spec, sd)
    from megatron.core.ssm import mamba_mixer  # after the model: compat_cpu patches it first

    mixers = [layer.mixer for layer in model.decoder.layers if hasattr(layer, "mixer")]
    assert len(mixers) == 2, "tiny_hybrid has two Mamba blocks"
    with torch.no_grad():
        mixers[1].dt_bias += DT_SHIFT  # the second block: its input depends on the searched masks
    sums: list[float] = []
    scan = mamba_mixer.mamba_chunk_scan_combined

    def recording_scan(x, dt, A, B, C, chunk_size, **kw):  # noqa: ANN001, ANN202, N803
        d = torch.nn.functional.softplus(dt.detach().float() + kw["dt_bias"].detach().float())
        sums.append(float((d * -A.detach().float())[:, :chunk_size].sum(dim=1).max()))
        return scan(x, dt, A, B, C, chunk_size, **kw)

    mamba_mixer.mamba_chunk_scan_combined = recording_scan
    try:
        # the EP=2 layout's space (routed-expert counts 2 or 4 of 4) in both runs, so that they compare
        caps = stages.search_capabilities(compose([*OVERRIDES, "cluster.ep=2", "cluster.processes_per_node=2"]))
        decisions = build_space(spec, caps, int(cfg.search.ffn_options))
        o = run_router_search(
            model,
            spec,
            decisions,
            ParamCost(),
            {"params": 0.5 * param_count(spec)},
            lambda s: ctx.batch_at("train", s, 2, 128, seed_offset=17),
            forward_logits,
            search_cfg(**SEARCH),
            seed=0,
            log=lambda s: None,
        )
    finally:
        mamba_mixer.mamba_chunk_scan_combined = scan
    return {
        "skipped": [r["skipped"] for r in o.trajectory],
        "entropy": [r["entropy"] for r in o.trajectory],
        "probs": o.probs,
        "max_chunk_sum": max(sums[1::2]),
    }  # per forward: block 0, then block 3


@pytest.mark.distributed
def test_ep2_router_search_finite_when_mamba_decay_overflows(megatron_tp1, tmp_path) -> None:
    from autocompress_nemo.distributed.spawn import spawn

    ref = _search(0, 1, str(tmp_path / "ep1"))
    two = spawn(_search, 2, str(tmp_path / "ep2"))
    print(
        f"largest chunk sum of dt*|A| in the second Mamba block: EP=1 {ref['max_chunk_sum']:.1f}, EP=2 ranks "
        f"{[round(r['max_chunk_sum'], 1) for r in two]} (exp overflows above {EXP_LIMIT:.2f})"
    )
    assert ref["max_chunk_sum"] > EXP_LIMIT, "the case no longer reaches the exp overflow: raise DT_SHIFT"
    assert max(r["max_chunk_sum"] for r in two) > EXP_LIMIT
    for out in (ref, *two):
        assert not any(out["skipped"]), f"steps skipped for a non-finite router gradient: {out['skipped']}"
        assert all(math.isfinite(h) for h in out["entropy"])
        assert all(math.isfinite(p) for ps in out["probs"] for p in ps)
    for out in two:
        worst = max(
            abs(a - b) for pa, pb in zip(out["probs"], ref["probs"], strict=True) for a, b in zip(pa, pb, strict=True)
        )
        print(f"EP=2 vs EP=1 max |dprob| = {worst:.2e}")
        assert worst < 1e-5

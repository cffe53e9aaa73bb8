"""Expert parallelism through the stages: EP=2 on 2 gloo processes (world 2 = DP 2 x EP 2) gives
the same rank scores and permutations, router-search choices and distilled weights as EP=1.

One spawned EP=2 run (``_stages``) and the same function at EP=1 in this process go through the
stages of a run composed like the pipeline's (``model=tiny_hybrid +target=tiny_hybrid_eager_cpu
cluster.ep=2``: ``M*EME-``, 4 routed experts top-2, shared expert; the stdlib token data), through
``pipeline.Run.stage`` (rank 0 writes each artifact) and ``Context``:

- rank: the stage (``stages/rank.py``; every rank calibrates on the same batches): scores and
  permutations of routed experts, expert / shared neurons and Mamba heads;
- search: ``run_router_search`` on the sorted parent with the search stage's batches (the stage
  itself needs a profiled cost table; the cost here is the exact parameter count), each DP rank on
  its half of the global batch — shared weights frozen (the default) and trained, and a kill at
  step 5 + resume of the trained one (one weight shard per EP rank);
- extract: the stage, for a fixed heterogeneous child with 4 and 2 routed experts;
- distill: the stage (``stages/distill.py``, each DP rank on half the batch, hidden-state loss on,
  clipping at norm 1 active): loss and gradient-norm history, final weights (experts gathered
  from both EP ranks), one checkpoint shard per EP rank, and a kill at step 3 + resume.

Tolerances (float32 sums in another order: EP all-gather, DP all-reduce of half-batch gradients,
1 thread vs 2): 1e-5 on scores (relative), KD trajectories and router probabilities with frozen
weights, distill losses and gradient norms (relative); 5e-5 on distilled weights and 2e-4 on the
search with trained shared weights, because Adam divides by ``sqrt(v) + eps``: a gradient entry
near ``eps`` (an embedding row of a token seen once) turns float-order noise into ``~1e-3 * lr``
updates. That part is the data split, not EP: DP=2 at EP=1 gives the same 3.2e-5 KD / 5.8e-5
probability differences on the trained search. Choices and permutations must be equal, and the
two ranks' routers bitwise equal. Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_utils import requires_mamba

pytestmark = [pytest.mark.distributed, requires_mamba]

OVERRIDES = [
    "model=tiny_hybrid",
    "+target=tiny_hybrid_eager_cpu",
    "search=quick",
    "search.calib_sequences=4",
    "search.batch_size=2",
    "search.seq_len=16",
    "distill.tokens=384",
    "distill.batch_size=4",
    "distill.seq_len=16",
    "distill.lr=3e-3",
    "distill.min_lr=3e-4",
    "distill.warmup_steps=2",
    "distill.intermediate_weight=0.5",
    "distill.checkpoint_every=2",
]
SEARCH = dict(
    steps=10,
    router_lr=0.2,
    weight_lr=3e-3,
    tau_start=1.0,
    tau_end=0.2,
    kd_temperature=1.0,
    penalty_over=20.0,
    penalty_under=1.0,
    slack=0.05,
)
# the student: per-block shapes, every routed-expert count even (EP=2): (kind, block) -> option fields
CHILD = {
    ("mamba", 0): dict(num_heads=2),
    ("attention", 1): dict(num_heads=2, num_kv_groups=2),
    ("moe_routed", 2): dict(num_experts=4, expert_ffn=32, top_k=2),
    ("moe_shared", 2): dict(shared_ffn=32),
    ("mamba", 3): dict(num_heads=4),
    ("moe_routed", 4): dict(num_experts=2, expert_ffn=48, top_k=2),
    ("moe_shared", 4): dict(shared_ffn=64),
    ("mlp", 5): dict(ffn=64),
}
TOL, TOL_W, TOL_TRAINED = 1e-5, 5e-5, 2e-4


class Killed(RuntimeError):
    """Raised from a batch function to kill a run at a given step (every rank at the same step)."""


def _choose(decisions: list, fields: dict) -> list[int]:
    out = []
    for d in decisions:
        want = fields[(d.kind, d.block_index)]
        out.append(next(k for k, o in enumerate(d.options) if all(getattr(o, f) == v for f, v in want.items())))
    return out


def _stages(rank: int, world: int, out_dir: str) -> dict:
    """Rank, search, extract and distill at EP=``world`` (TP=1); what each stage produced."""
    import warnings

    warnings.filterwarnings("ignore")
    from autocompress_nemo.arch.counts import param_count
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.config.validate import validate
    from autocompress_nemo.context import Context, load_weights, read_json
    from autocompress_nemo.models.builder import forward_logits
    from autocompress_nemo.pipeline import Run
    from autocompress_nemo.search.autocompress import run_router_search
    from autocompress_nemo.search.space import apply_choices, build_space
    from autocompress_nemo.stages import distill as distill_stage
    from autocompress_nemo.stages import extract as extract_stage
    from autocompress_nemo.stages import rank as rank_stage
    from autocompress_nemo.stages.layout import ExtractDir, RankDir, SearchDir
    from autocompress_nemo.utils.artifacts import write_json_atomic
    from tests.cfg_utils import search_cfg
    from tests.method_utils import ParamCost

    cfg = compose([*OVERRIDES, f"run_dir={out_dir}/run", f"cluster.ep={world}", f"cluster.processes_per_node={world}"])
    validate(cfg)
    run, ctx = Run(cfg, say=lambda s: None), Context(cfg, say=lambda s: None)
    spec, sd, _ = ctx.parent
    n_local = {
        len(layer.mlp.experts.local_experts)
        for layer in ctx.model(spec, sd).decoder.layers
        if hasattr(getattr(layer, "mlp", None), "experts")
    }
    res: dict = {"n_local": n_local}

    # -- rank: the stage (every rank calibrates on the same batches; rank 0 writes the artifact) ---
    rank_dir = run.stage("rank", lambda o: rank_stage.run(ctx, o), ("model", "search"))
    scores = read_json(rank_dir / "scores.json")
    res["tokens"] = scores["tokens"]
    res["scores"] = {
        (g, f): torch.tensor(b[f], dtype=torch.float64)
        for g, b in enumerate(scores["blocks"])
        for f in b
        if b[f] is not None
    }
    res["perms"] = read_json(rank_dir / "permutations.json")

    # -- search: the router on the sorted parent, with the search stage's batches ---------------
    pspec, psd = load_weights(rank_dir)
    decisions = build_space(pspec, cfg.target.engine.capabilities, int(cfg.search.ffn_options))
    budget = {"params": 0.8 * param_count(pspec)}

    def search(train_weights: bool, ckpt: str | None = None, kill_at: int | None = None) -> dict:
        def batch_at(s: int) -> torch.Tensor:
            if s == kill_at:
                raise Killed(f"killed at step {s}")
            return ctx.batch_at("train", s, 2, 16, seed_offset=17)  # as stages.search_core

        c = search_cfg(**SEARCH, train_weights=train_weights, checkpoint_every=2 if ckpt else 0)
        o = run_router_search(
            ctx.model(pspec, psd),
            pspec,
            decisions,
            ParamCost(),
            budget,
            batch_at,
            forward_logits,
            c,
            seed=3,
            checkpoint=ckpt,
            log=lambda s: None,
            router_init="parent",
        )
        return {"choices": o.choices, "probs": o.probs, "kd": [r["kd"] for r in o.trajectory], "tokens": o.tokens}

    res["search"] = search(False)  # the configured default: shared weights frozen
    res["search_trained"] = search(True)
    ckpt = str(run.ckpt_dir("search"))
    with pytest.raises(Killed):  # the search is killed at step 5
        search(True, ckpt, kill_at=5)
    res["search_resumed"] = search(True, ckpt)
    res["search_files"] = sorted(str(p.relative_to(ckpt)) for p in Path(ckpt, "checkpoints").glob("step_*/*"))

    # -- extract: the stage, for a fixed heterogeneous child (4 and 2 routed experts) -------------
    child = apply_choices(pspec, decisions, _choose(decisions, CHILD))
    search_dir = run.stage(
        "search_fixed", lambda o: write_json_atomic(o / "arch.json", {"child": child.to_dict()}), ("model",), [rank_dir]
    )
    extract_dir = run.stage(
        "extract",
        lambda o: extract_stage.run(ctx, o, RankDir(rank_dir), SearchDir(search_dir)),
        ("model",),
        [rank_dir, search_dir],
    )

    # -- distill: the stage (each DP rank on B/dp rows), uninterrupted and killed + resumed ------
    def distill(name: str, kill_at: int | None = None) -> dict:
        plain = ctx.batch_at

        def batch_at(split: str, step: int, *a, **kw) -> torch.Tensor:
            if step == kill_at and kw.get("seed_offset") == 29:  # the distill stage's training batches
                raise Killed(f"killed at step {step}")
            return plain(split, step, *a, **kw)

        ctx.batch_at = batch_at  # type: ignore[method-assign]
        try:
            d = run.stage(
                name,
                lambda o: distill_stage.run(ctx, o, RankDir(rank_dir), ExtractDir(extract_dir), run.ckpt_dir(name)),
                ("distill",),
                [rank_dir, extract_dir],
            )
        finally:
            del ctx.batch_at
        r = read_json(d / "distill.json")
        # the export stage's Megatron-LM checkpoint of it (written collectively under this layout: every
        # rank's shards in rank 0's directory), read back
        from autocompress_nemo.models.builder import build_model
        from autocompress_nemo.models.dist_checkpoint import load_checkpoint, read_spec
        from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf
        from autocompress_nemo.stages.export import _steps, write_megatron
        from autocompress_nemo.stages.layout import DistillDir, ExportDir

        ex = ExportDir(Path(out_dir) / "run" / f"export_{name}")
        write_megatron(ctx, *load_weights(d), ex, _steps(DistillDir(d)))
        cspec = read_spec(ex.megatron)
        fresh = build_model(cspec, init_seed=99)
        it = load_checkpoint(fresh, ex.megatron)
        return {
            "megatron": (it, megatron_to_hf(cspec, fresh)),
            "loss": [h["loss"] for h in r["history"]],
            "grad_norm": [h["grad_norm"] for h in r["history"]],
            "weights": load_weights(d)[1],
            "world": r["world"],
            "resumed_from": r["resumed_from_step"],
        }

    res["distill"] = distill("distill_a")
    with pytest.raises(Killed):  # distillation is killed at step 3
        distill("distill_b", kill_at=3)
    res["distill_resumed"] = distill("distill_b")
    ckpt = Path(out_dir) / "run" / "distill_b.ckpt" / "checkpoints"
    res["shards"] = sorted(p.name for p in (ckpt / "iter_0000006").glob("*.distcp"))  # a Megatron-LM dist checkpoint
    res["tracker"] = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    return res


@pytest.fixture(scope="module")
def runs(megatron_tp1, tmp_path_factory) -> tuple[dict, list[dict]]:
    from autocompress_nemo.distributed.spawn import spawn

    ref = _stages(0, 1, str(tmp_path_factory.mktemp("ep1")))
    two = spawn(_stages, 2, str(tmp_path_factory.mktemp("ep2")))
    return ref, two


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_ep2_rank_equals_ep1(runs) -> None:
    ref, two = runs
    for r, out in enumerate(two):
        assert out["n_local"] == {n // 2 for n in ref["n_local"]}, "each EP rank must hold half of the experts"
        assert out["tokens"] == 2 * ref["tokens"]  # both ranks calibrated on the same batches
        worst = _worst(out["scores"], ref["scores"])
        print(f"rank {r}: EP=2 vs EP=1 max |dscore| = {worst:.2e}")
        assert worst < TOL * max(v.abs().max().item() for v in ref["scores"].values())
        assert out["perms"] == ref["perms"], "permutations differ"


def _diff(a: dict, b: dict) -> tuple[float, float]:
    dp = max(abs(x - y) for pa, pb in zip(a["probs"], b["probs"], strict=True) for x, y in zip(pa, pb, strict=True))
    return dp, max(abs(x - y) for x, y in zip(a["kd"], b["kd"], strict=True))


def test_ep2_router_search_equals_ep1(runs) -> None:
    ref, two = runs
    for key in ("search", "search_trained"):
        assert two[0][key] == two[1][key], f"{key}: the ranks' routers diverged"
    # EP=1 kill + resume (the router and the shared weights in the trainer's one shard)
    assert ref["search_resumed"]["kd"] == pytest.approx(ref["search_trained"]["kd"], abs=1e-6)
    assert ref["search_resumed"]["choices"] == ref["search_trained"]["choices"]
    assert ref["search_files"] == ["checkpoints/step_000010/mp_tp00_pp000.pt"]
    for r, out in enumerate(two):
        o, t = out["search"], out["search_trained"]
        dp, dkd = _diff(o, ref["search"])
        tp, tkd = _diff(t, ref["search_trained"])
        print(
            f"rank {r}: EP=2 vs EP=1 search max |dprob| = {dp:.2e}, max |dkd| = {dkd:.2e}, choices {o['choices']}; "
            f"training the shared weights: max |dprob| = {tp:.2e}, max |dkd| = {tkd:.2e}"
        )
        assert o["choices"] == ref["search"]["choices"] and o["tokens"] == ref["search"]["tokens"]
        assert dp < TOL and dkd < TOL
        assert t["choices"] == ref["search_trained"]["choices"]
        assert tp < TOL_TRAINED and tkd < TOL_TRAINED
        again = out["search_resumed"]  # killed at step 5, resumed from the step-4 checkpoint
        assert again["choices"] == t["choices"] and again["tokens"] == t["tokens"]
        assert again["kd"] == pytest.approx(t["kd"], abs=1e-6)
        assert sum(again["probs"], []) == pytest.approx(sum(t["probs"], []), abs=1e-6)
        # one shard per EP rank (the router and that rank's experts) of the last checkpoint (step 10)
        assert out["search_files"] == [
            "checkpoints/step_000010/mp_tp00_ep00_pp000.pt",
            "checkpoints/step_000010/mp_tp00_ep01_pp000.pt",
        ]


def test_ep2_distill_equals_ep1_and_resumes(runs) -> None:
    ref, two = runs
    d = ref["distill"]
    assert d["loss"][-1] < d["loss"][0] and min(d["grad_norm"]) > 0
    print(
        f"EP=1 distill: loss {d['loss'][0]:.4f} -> {d['loss'][-1]:.4f}, gradient norms {d['grad_norm']} "
        "(clipped above 1.0)"
    )
    assert ref["distill_resumed"]["resumed_from"] == 2 and ref["shards"] == ["__0_0.distcp"] and ref["tracker"] == "6"
    for out in [ref, *two]:  # the distilled student's Megatron-LM checkpoint holds the stage's weights
        it, megatron_weights = out["distill"]["megatron"]
        assert it == len(d["loss"]) and _worst(megatron_weights, out["distill"]["weights"]) == 0.0
    assert _worst(ref["distill_resumed"]["weights"], d["weights"]) == 0.0  # one process: bitwise
    for r, out in enumerate(two):
        o = out["distill"]
        dl = max(abs(x - y) for x, y in zip(o["loss"], d["loss"], strict=True))
        dn = max(abs(x - y) / y for x, y in zip(o["grad_norm"], d["grad_norm"], strict=True))
        dw = _worst(o["weights"], d["weights"])
        print(
            f"rank {r}: EP=2 vs EP=1 distill max |dloss| = {dl:.2e}, max rel |dgrad_norm| = {dn:.2e}, "
            f"max |dweight| = {dw:.2e}"
        )
        assert dl < TOL and dn < TOL and dw < TOL_W
        assert o["world"] == {"dp": 2, "tp": 1, "pp": 1, "ep": 2}
        res = out["distill_resumed"]
        assert res["resumed_from"] == 2
        assert res["loss"] == pytest.approx(o["loss"], abs=1e-6)
        dres = _worst(res["weights"], o["weights"])
        print(f"rank {r}: EP=2 kill at step 3 + resume vs uninterrupted max |dweight| = {dres:.2e}")
        assert dres < 1e-6
    assert two[0]["shards"] == two[1]["shards"] == ["__0_0.distcp", "__1_0.distcp"]  # each EP rank its experts


def test_search_space_under_ep_keeps_multiples_of_ep_experts() -> None:
    """A run laid out at EP=2 searches only students it can shard: every kept routed-expert count
    is a multiple of 2 (the engine's own alignment allows 3 of 4)."""
    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.search.space import build_space
    from autocompress_nemo.stages import common as stages

    def counts(extra: list[str]) -> set[int]:
        cfg = compose(["model=tiny_hybrid", "+target=tiny_hybrid_eager_cpu", *extra])
        spec = spec_from_model_config(cfg.model)
        return {
            o.num_experts
            for d in build_space(spec, stages.search_capabilities(cfg))
            if d.kind == "moe_routed"
            for o in d.options
            if not o.removed
        }

    assert 3 in counts([])
    assert counts(["cluster.ep=2"]) and all(n % 2 == 0 for n in counts(["cluster.ep=2"]))


def _no_expert_student(rank: int, world: int, hf_sd: dict, spec_json: str) -> torch.Tensor:
    from autocompress_nemo.arch.spec import ArchSpec
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.hybrid import hf_to_megatron

    spec = ArchSpec.from_json(spec_json)
    init_distributed(tp=1, ep=world, seed=0)
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    with torch.no_grad():
        return forward_logits(model, torch.arange(12).view(1, 12) % spec.vocab)


def test_student_without_routed_experts_builds_under_ep2(megatron_tp1) -> None:
    """Minitron++ may remove every MoE block; at EP=2 that student still builds (its EP ranks hold
    replicas) and computes what it computes at EP=1."""
    import dataclasses

    from hybrid_utils import conf_spec

    from autocompress_nemo.arch.spec import MoeBlock
    from autocompress_nemo.distributed.spawn import spawn
    from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict

    parent = conf_spec("tiny_hybrid")
    spec = parent.replace(
        blocks=tuple(
            dataclasses.replace(b, num_experts=0, expert_ffn=0, top_k=0, shared_ffn=0) if isinstance(b, MoeBlock) else b
            for b in parent.blocks
        )
    )
    hf_sd = random_hf_state_dict(spec, seed=2)
    ref = _no_expert_student(0, 1, hf_sd, spec.to_json())
    for logits in spawn(_no_expert_student, 2, hf_sd, spec.to_json()):
        assert torch.allclose(logits, ref, atol=1e-6)

"""One option grid: the cost table is profiled at, and validated on, exactly the options the search
returns (``search/space.py`` is the single source; ``costs/profile/grid.py`` reads it), and the
profiler imports the search, never the reverse. Also: typed engine settings and capabilities —
a misspelt key fails at composition, naming it."""

from __future__ import annotations

import pytest

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.arch.spec import ArchSpec, MoeBlock
from autocompress_nemo.blocks.moe import moe_parts
from autocompress_nemo.config.engine import EngineCapabilities, capabilities_of, settings_of
from autocompress_nemo.config.entry import compose
from autocompress_nemo.config.resolve import search_capabilities
from autocompress_nemo.config.validate import ConfigError, collect_problems
from autocompress_nemo.costs.profile.grid import profile_options
from autocompress_nemo.costs.profile.pairs import make_plan
from autocompress_nemo.profile.validate import candidates
from autocompress_nemo.search.space import build_space


def search_options(parent: ArchSpec, caps: object, ffn_options: int) -> set:
    """Every non-removed option the search can return for ``parent``, and the parent's own blocks
    (MoE blocks as their parts, the table's entries)."""
    out = {o for d in build_space(parent, caps, ffn_options) for o in d.options if not o.removed}
    for b in parent.blocks:
        out |= {p for p in (moe_parts(b) if isinstance(b, MoeBlock) else (b,)) if not p.removed}
    return out


@pytest.mark.parametrize("target", ["cpu_chat", "h100x8_serving", "rtx5080_coding"])
def test_dense_profiled_and_validated_options_are_the_searchs(target: str) -> None:
    """SmolLM2-135M under llama.cpp (every attention shape), vLLM and TensorRT-LLM (global query
    heads: attention kept whole, ffn in multiples of 256): the pair design profiles exactly the
    search's options, and every validation candidate is built from them."""
    cfg = compose([f"+target={target}", "model=smollm2_135m", "dry_run=true"])
    parent, caps, n = spec_from_model_config(cfg.model), search_capabilities(cfg), int(cfg.search.ffn_options)
    plan = make_plan(parent, caps, n)
    want = search_options(parent, caps, n)
    assert set(plan.attention_options) | set(plan.ffn_options) == want
    assert plan.ffn_options == sorted(plan.ffn_options, key=lambda b: b.ffn)
    if not caps.vary_query_heads:  # the search keeps attention whole there, so the profiler does too
        assert plan.attention_options == [parent.blocks[0]]
    for spec in candidates(parent, caps, n_random=6, seed=0, ffn_points=n):
        assert all(b.removed or b in want for b in spec.blocks), spec.name


def test_hybrid_profiled_options_are_the_searchs_under_the_runs_layout(tmp_path) -> None:
    """The tiny hybrid (Mamba, attention, MoE, MLP blocks): the profile stage profiles exactly the
    search's options under the run's layout — at EP=2 the routed-expert counts are multiples of 2,
    and the table has an exact entry for every one of them (none left to interpolate)."""
    from autocompress_nemo.costs.table import CostTable, _block_key
    from autocompress_nemo.profile.stage import run_profile

    over = ["model=tiny_hybrid", "+target=tiny_hybrid_eager_cpu", "engine@target.engine=roofline"]
    over += ["hardware@target.hardware=b200", f"run_dir={tmp_path}"]
    for ep in (1, 2):
        cfg = compose([*over, f"cluster.ep={ep}"])
        parent, caps, n = spec_from_model_config(cfg.model), search_capabilities(cfg), int(cfg.search.ffn_options)
        want = search_options(parent, caps, n)
        assert set(profile_options(parent, caps, n)) == want
        experts = {o.num_experts for o in want if isinstance(o, MoeBlock) and o.num_experts}
        assert (3 in experts) == (ep == 1) and all(e % ep == 0 for e in experts)
        table = CostTable.load(run_profile(cfg, tmp_path / f"ep{ep}"))
        assert {_block_key(o) for o in want} == {
            _block_key(b) for k in ("attention", "mlp", "moe", "mamba") for b, _ in table._entries(k)
        }
        for spec in candidates(parent, caps, n_random=4, seed=0, ffn_points=n):
            assert all(
                b.removed or all(p.removed or p in want for p in moe_parts(b))
                if isinstance(b, MoeBlock)
                else b.removed or b in want
                for b in spec.blocks
            ), spec.name


def test_the_profiler_imports_the_search_never_the_reverse() -> None:
    import grimp

    g = grimp.build_graph("autocompress_nemo")
    for search in ("autocompress_nemo.search.space", "autocompress_nemo.blocks"):
        for mod in g.find_descendants("autocompress_nemo.costs.profile") | {"autocompress_nemo.costs.profile"}:
            assert g.find_shortest_chain(search, mod) is None, (search, mod)
    assert g.find_shortest_chain("autocompress_nemo.costs.profile.grid", "autocompress_nemo.search.space")


# -- typed engine settings and capabilities ---------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("target.engine.settings.not_a_key=1", "not_a_key"),
        ("target.engine.capabilities.not_a_cap=true", "not_a_cap"),
    ],
)
def test_misspelt_engine_key_fails_at_composition(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        compose(["model=tiny_llama", override])


def test_settings_and_capabilities_read_as_typed_attributes() -> None:
    cfg = compose(["model=tiny_llama", "target.engine.settings.rounds=3", "target.engine.capabilities.ffn_align=8"])
    s, c = settings_of(cfg.target.engine.settings), capabilities_of(cfg.target.engine.capabilities)
    assert s.rounds == 3 and s.validate_random == 9 and c.ffn_align == 8 and c.expert_align == 1
    with pytest.raises(AttributeError):
        _ = c.vary_fnn  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'vary_fnn'"):
        capabilities_of({"vary_fnn": True})
    with pytest.raises(ValueError, match="'roundz'"):
        settings_of({"roundz": 1})
    assert capabilities_of(None) == EngineCapabilities()


def test_a_key_added_with_plus_is_a_validation_problem() -> None:
    """Hydra's ``+key=`` adds keys even to a typed node; validation names it, and an engine refuses it."""
    from autocompress_nemo.costs.engines import get_engine

    cfg = compose(["model=tiny_llama", "+target.engine.settings.decode_stpes=8"])
    assert "target.engine.settings.decode_stpes: no such engine setting" in "\n".join(collect_problems(cfg))
    with pytest.raises(ValueError, match="'decode_stpes'"):
        get_engine(cfg.target)


def test_profile_settings_are_checked_against_the_engine_settings() -> None:
    cfg = compose(["model=tiny_llama", "search=quick", "+search.profile_settings.decode_stpes=8"])
    problems = "\n".join(collect_problems(cfg))
    assert "search.profile_settings.decode_stpes: no such engine setting" in problems
    cfg = compose(["model=tiny_llama", "search=quick", "search.profile_settings.rounds=two"])
    assert "search.profile_settings.rounds='two' must be a int" in "\n".join(collect_problems(cfg))
    assert collect_problems(compose(["model=tiny_llama", "search=quick"])) == []


def test_search_capabilities_align_experts_to_ep() -> None:
    base = ["model=tiny_hybrid", "+target=tiny_hybrid_eager_cpu"]
    assert search_capabilities(compose(base)).expert_align == 1
    assert search_capabilities(compose([*base, "cluster.ep=2"])).expert_align == 2

"""llama.cpp as the engine of Nemotron-H hybrids (``conf/engine/llama_cpp_hybrid_cpu.yaml``).

- The limits, as measurements: llama-cpp-python 0.3.36 (vendored llama.cpp 0c1e570) refuses a
  per-layer routed-expert count, shared-expert width and Mamba head / group count ("wrong type
  arr"), even when every layer's value is the same; the same file with the scalar loads.
- The capability set: the search space on a llama.cpp hybrid parent varies only what llama.cpp
  reads per layer, never removes the last attention or Mamba block nor a MoE block, and every
  child it can return passes the writer's checks.
- Each pitfall is refused by the project with a message before llama.cpp is reached.
- The engine measures a hybrid: decode steps that move forward (the Mamba state cannot be rolled
  back), the recurrent state in memory, a crashing file reported as an error naming the signal.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from pathlib import Path

import pytest
from hybrid_utils import conf_spec

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.config.engine import capabilities_of
from autocompress_nemo.config.entry import compose

ENGINE_YAML = Path(__file__).resolve().parents[1] / "conf" / "engine" / "llama_cpp_hybrid_cpu.yaml"
llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")


def caps():
    from omegaconf import OmegaConf

    return capabilities_of(OmegaConf.load(ENGINE_YAML).capabilities)


def _copy(src: Path, out: Path, *, array: tuple[str, list[int]] | None = None, f16: str = "") -> Path:
    """``src`` copied with the scalar metadata ``array[0]`` (without the architecture prefix) written as
    the per-layer array ``array[1]``, and the tensors whose names end with ``f16`` stored F16."""
    import gguf
    import numpy as np

    from autocompress_nemo.export.parity import _field_value

    r = gguf.GGUFReader(str(src))
    arch = str(_field_value(r.fields["general.architecture"])[0])
    w = gguf.GGUFWriter(str(out), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        val, vtype, sub = _field_value(f)
        if array is not None and k == f"{arch}.{array[0]}":
            w.add_array(k, array[1])
        elif sub is not None:
            w.add_key_value(k, val, vtype, sub_type=sub)
        else:
            w.add_key_value(k, val, vtype)
    for t in r.tensors:
        data = np.asarray(t.data).copy()
        w.add_tensor(t.name, data.astype(np.float16) if f16 and t.name.endswith(f16) else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@llama_cpp
@pytest.mark.engine
@pytest.mark.parametrize(
    "key", ["expert_count", "expert_shared_feed_forward_length", "ssm.time_step_rank", "ssm.group_count"]
)
def test_llama_cpp_refuses_these_per_layer(tmp_path, key) -> None:
    """What the llama.cpp hybrid search space leaves out, measured: the same value on every layer,
    given as an array instead of a scalar, is refused at load ("wrong type arr")."""
    import llama_cpp as lc

    from autocompress_nemo.costs.engines.llamacpp_child import probe_load
    from autocompress_nemo.export.gguf_hybrid import write_hybrid_gguf

    spec = conf_spec("tiny_hybrid_moe")
    good = write_hybrid_gguf(spec, tmp_path / "good.gguf", dtype="f32")
    probe_load(good)  # the scalar form loads
    m, moe = spec.blocks[0], spec.blocks[2]
    value = {
        "expert_count": moe.num_experts,
        "expert_shared_feed_forward_length": moe.shared_ffn,
        "ssm.time_step_rank": m.num_heads,
        "ssm.group_count": m.num_groups,
    }[key]
    bad = _copy(good, tmp_path / "bad.gguf", array=(key, [value] * len(spec.blocks)))
    with pytest.raises(RuntimeError, match="wrong type arr") as e:
        probe_load(bad)
    print(f"llama-cpp-python {lc.__version__}: per-layer {key} refused: {str(e.value).splitlines()[0]}")


def test_search_space_is_what_llama_cpp_reads() -> None:
    """Only what llama.cpp reads per layer varies; the first attention and Mamba blocks and every
    MoE block stay; every child the space can return passes the writer's checks."""
    from autocompress_nemo.export.gguf_hybrid import gguf_problems
    from autocompress_nemo.search.space import apply_choices, build_space

    c = caps()
    for name in ("tiny_hybrid_moe", "small_hybrid"):
        parent = conf_spec(name)
        decisions = build_space(parent, c)
        assert decisions, name
        first = {k: next(i for i, b in enumerate(parent.blocks) if b.kind == k) for k in ("attention", "mamba")}
        for d in decisions:
            pb = parent.blocks[d.block_index]
            for o in d.options:
                if isinstance(pb, MoeBlock):
                    assert d.kind == "moe_routed", d.kind  # no shared-expert decision
                    assert o.num_experts == pb.num_experts and 1 <= o.top_k <= pb.num_experts
                elif isinstance(pb, MambaBlock):
                    assert o.num_heads in (0, pb.num_heads) and o.num_groups == pb.num_groups
                if d.block_index in first.values():
                    assert not o.removed, (name, d.block_index)
        kinds = {d.kind for d in decisions}
        assert {"attention", "mamba", "moe_routed"} <= kinds, kinds
        rng = random.Random(0)
        for _ in range(200):
            child = apply_choices(parent, decisions, [rng.randrange(len(d.options)) for d in decisions])
            assert gguf_problems(child) == [], child.pattern
        smallest = apply_choices(parent, decisions, [0] * len(decisions))
        assert gguf_problems(smallest) == [] and {"attention", "mamba"} <= smallest.kinds()


def _hybrid(*blocks) -> ArchSpec:
    return ArchSpec(hidden=64, vocab=512, blocks=tuple(blocks), family="nemotron_h", name="case")


M, A = MambaBlock(4, 16, 16, 2), AttentionBlock(4, 2, 16)
E = MoeBlock(4, 64, 2, 64, 0, "relu2")


@pytest.mark.parametrize(
    "spec, message",
    [
        (_hybrid(M, dataclasses.replace(A, num_heads=0, num_kv_groups=0), E), "no attention block left"),
        (_hybrid(dataclasses.replace(M, num_heads=0), A, E), "no Mamba block left"),
        (_hybrid(M, A, E, MlpBlock(128, "relu2")), "dense MLP layer(s) [3] in a MoE model"),
        (_hybrid(M, A, E, dataclasses.replace(E, num_experts=2, top_k=2)), "routed-expert count differs"),
        (_hybrid(M, A, E, dataclasses.replace(E, shared_ffn=32)), "shared-expert width differs"),
        (_hybrid(M, A, E, MambaBlock(2, 16, 16, 1)), "Mamba shape"),
    ],
    ids=["no-attention", "no-mamba", "mlp-in-moe", "experts", "shared", "mamba-heads"],
)
def test_pitfalls_are_refused_before_llama_cpp(tmp_path, spec, message) -> None:
    """The engine and the writer refuse each pitfall with a message, and no file is written."""
    from omegaconf import OmegaConf

    from autocompress_nemo.costs.engines.llamacpp import LlamaCppEngine
    from autocompress_nemo.export.gguf_hybrid import write_hybrid_gguf

    eng = LlamaCppEngine(OmegaConf.load(ENGINE_YAML))
    problems = eng.check_servable(spec)
    assert any(message in p for p in problems), problems
    with pytest.raises(ValueError, match="llama.cpp cannot serve"):
        write_hybrid_gguf(spec, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_top_k_that_kills_llama_cpp_cannot_be_described(top_k) -> None:
    """Top-k 0 (SIGFPE in llama.cpp) or above the expert count (abort) is refused by the block itself."""
    with pytest.raises(ValueError, match=f"top_k={top_k} must be in 1..num_experts=4"):
        dataclasses.replace(E, top_k=top_k)


def test_capabilities_refuse_what_the_parent_lacks() -> None:
    """A parent the llama.cpp hybrid engine cannot serve is named with the reason by validate."""
    from autocompress_nemo.config.validate import collect_problems

    joined = "\n".join(collect_problems(compose(["+target=tiny_hybrid_cpu", "model=tiny_hybrid"])))
    assert "dense MLP" in joined and "tiny_hybrid_eager_cpu" in joined, joined
    joined = "\n".join(collect_problems(compose(["+target=tiny_hybrid_cpu", "model=tiny_moe"])))
    assert "mamba" in joined, joined
    assert collect_problems(compose(["+target=tiny_hybrid_cpu", "model=tiny_hybrid_moe"])) == []


@llama_cpp
@pytest.mark.engine
def test_engine_times_a_hybrid_and_reports_its_state(tmp_path) -> None:
    """A hybrid measured in llama.cpp: decode steps run (the state is not rolled back), the recurrent
    state is reported and scales with the Mamba blocks kept."""
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload

    cfg = compose(["+target=tiny_hybrid_cpu", "model=tiny_hybrid_moe", "target.engine.settings.decode_steps=24"])
    eng = get_engine(cfg.target, tmp_path)
    parent = conf_spec("tiny_hybrid_moe")
    one_mamba = parent.replace_block(3, dataclasses.replace(parent.blocks[3], num_heads=0))
    wl = Workload(batch=2, input_len=16, output_len=8, context_len=256)
    a, b = eng.measure_many([parent, one_mamba], wl, rounds=1)
    for m in (a, b):
        assert m.decode_ms > 0 and m.prefill_ms > 0 and len(m.raw["decode_ms"]) >= 24
    assert a.memory["state"] > 0 and b.memory["state"] > 0
    assert a.memory["state"] == pytest.approx(2 * b.memory["state"], rel=0.2)  # MiB to 2 decimals in the log


@llama_cpp
@pytest.mark.engine
def test_a_hybrid_state_cannot_be_rolled_back_one_token(tmp_path) -> None:
    """Why a hybrid's decode steps move forward (``_decode_window``), measured: after a decode step at
    position C, llama.cpp refuses to remove that one position of a sequence with Mamba state
    (``llama_memory_seq_rm`` returns false), and decoding at C again fails on the position gap."""
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.costs.engines.base import Workload
    from autocompress_nemo.costs.engines.llamacpp import _LlamaLive
    from autocompress_nemo.export.gguf_hybrid import write_hybrid_gguf

    eng = get_engine(compose(["+target=tiny_hybrid_cpu", "model=tiny_hybrid_moe"]).target, tmp_path)
    spec = conf_spec("tiny_hybrid_moe")
    path = write_hybrid_gguf(spec, tmp_path / "m.gguf", dtype="f16")
    live = _LlamaLive(eng, path, spec.vocab, Workload(1, 16, 8, 128), True, recurrent=True)
    try:
        live._fill(16)
        live._run([(1, 16, 0, True)])
        assert live.L.llama_memory_seq_rm(live.mem, 0, 16, -1) is False
        with pytest.raises(RuntimeError, match="inconsistent sequence positions"):
            live._run([(1, 16, 0, True)])
    finally:
        live.close()


@llama_cpp
@pytest.mark.engine
def test_a_file_that_kills_llama_cpp_is_an_error(tmp_path) -> None:
    """A hybrid file llama.cpp aborts on (an F16 conv weight: ``GGML_ASSERT(src1->nb[0] ==
    sizeof(float))`` in ``ssm_conv``) is loaded in a child process: the error names the signal."""
    import gguf

    from autocompress_nemo.costs.engines.llamacpp_child import probe_load
    from autocompress_nemo.export.gguf_hybrid import write_hybrid_gguf

    spec = conf_spec("tiny_hybrid_moe")
    good = write_hybrid_gguf(spec, tmp_path / "good.gguf", dtype="f16")
    probe_load(good)

    r = gguf.GGUFReader(str(good))
    conv = next(t for t in r.tensors if t.name.endswith("ssm_conv1d.weight"))
    assert conv.tensor_type == gguf.GGMLQuantizationType.F32  # the writer keeps it F32
    bad = _copy(good, tmp_path / "bad.gguf", f16="ssm_conv1d.weight")
    with pytest.raises(RuntimeError, match="killed by SIG"):
        probe_load(bad, n_ctx=64)

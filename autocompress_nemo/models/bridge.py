"""Megatron-Bridge (the NeMo Framework's LLM side) measured against this project, in a venv of its own.

Megatron-Bridge 0.6.2 cannot share the project's interpreter: it requires ``transformers>=5.8,<=5.12.1``
(the project runs 5.24; there ``import megatron.bridge`` fails with "No module named
transformers.modeling_attn_mask_utils"). ``scripts/make_bridge_venv.sh`` builds ``.venv-bridge``; this
module runs in both:

- in the project's interpreter: ``bridge_python()`` (``$ACN_BRIDGE_PYTHON``, else ``.venv-bridge``) and
  ``run_bridge(command, ...)``, which runs ``python -m autocompress_nemo.models.bridge <command>`` there
  (the repository on ``PYTHONPATH``) and returns the JSON it writes;
- in the bridge venv: the commands below, each one measurement. What they do not reach is recorded with
  the exception, the file and the line where it stopped (``stopped_at``).

What was measured (megatron-bridge 0.6.2, megatron-core 0.19.2, transformers 5.12.1, torch 2.14.1 CUDA
build on a CPU without a driver, gloo, world size 1), kept as tests in ``tests/test_megatron_bridge.py``:

- ``import megatron.bridge`` fails without Transformer Engine: ``megatron/bridge/peft/lora_layers.py``
  line 20 imports ``transformer_engine.pytorch`` unconditionally, and every path to ``AutoBridge``
  passes through it (``auto_bridge`` -> ``model_bridge`` -> ``peft_bridge`` -> ``canonical_lora`` ->
  ``lora_layers``). Transformer Engine does not install on a machine without CUDA (and installing its
  binary parts breaks ``import megatron.core``). ``import_bridge()`` therefore imports it with
  ``TE_STANDIN``: empty ``transformer_engine`` / ``transformer_engine.pytorch`` modules, put in
  ``sys.modules`` only after megatron-core's own Transformer Engine probes ran (so megatron-core still
  sees no Transformer Engine), whose classes raise when instantiated. Nothing below builds a
  Transformer Engine module: every model uses megatron-core's local (non-TE) layer specs.
- ``AutoBridge`` (``hf``): Llama (tiny; SmolLM2-135M from its GGUF), a DeciLM student through
  ``llama_nemotron`` (KV groups, ffn, no-op blocks per layer) and a tiny Nemotron-H (Mamba, attention,
  MoE, MLP) give logits equal to the project's adapter (max |d logit| 0.0) and export back the same
  tensors; per-layer query heads are refused ("Shape mismatch ... linear_proj.weight").
- ``save_megatron_model`` stops at ``torch.cuda.get_rng_state()`` (``training/checkpointing.py``).
- ``load-project-ckpt``: the project's DeciLM-style student checkpoint with ``write_run_config``'s
  ``run_config.yaml`` loads through Megatron-Bridge's loader, logits equal; as written (Megatron-LM
  ``args`` only) its MLM-compat reader stops at ``multi_latent_attention``; a uniform student's layers
  are saved one by one where Megatron-Bridge's GPT provider stacks them.
- ``train-probe``: ``finetune`` / ``distill`` stop at import (``training/pretrain.py:19``,
  ``nvidia_resiliency_ext``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_VENV = ROOT / ".venv-bridge"
TESTED_VERSIONS = {"megatron-bridge": "0.6.2", "megatron-core": "0.19.2", "transformers": "5.12.1", "torch": "2.14.1"}


# -- the project's side --------------------------------------------------------------------------
def bridge_python() -> Path | None:
    """The bridge venv's interpreter (``$ACN_BRIDGE_PYTHON``, else ``<repo>/.venv-bridge/bin/python``),
    or None when it does not exist (``scripts/make_bridge_venv.sh`` builds it)."""
    p = Path(os.environ.get("ACN_BRIDGE_PYTHON") or BRIDGE_VENV / "bin" / "python")
    return p if p.is_file() else None


class BridgeError(RuntimeError):
    """A bridge command failed in its own process (the message holds its output's tail)."""


def run_bridge(command: str, *args: str, timeout: float = 900, threads: int = 2) -> dict[str, Any]:
    """Run ``python -m autocompress_nemo.models.bridge <command> <args> --out <json>`` in the bridge venv
    and return what it wrote."""
    import tempfile

    py = bridge_python()
    if py is None:
        raise BridgeError(f"no Megatron-Bridge venv at {BRIDGE_VENV} (scripts/make_bridge_venv.sh builds it)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = str(threads)
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
        r = subprocess.run(
            [str(py), "-m", "autocompress_nemo.models.bridge", command, *args, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
        )
        if not out.is_file():
            raise BridgeError(
                f"bridge {command} exited {r.returncode} without a result:\n{(r.stdout + r.stderr)[-4000:]}"
            )
        return json.loads(out.read_text())


# -- the bridge venv's side ----------------------------------------------------------------------
TE_STANDIN = "transformer_engine (import-only stand-in: megatron/bridge/peft/lora_layers.py:20 imports it)"


class _NoTransformerEngine:
    def __init__(self, *a: Any, **k: Any) -> None:
        raise RuntimeError("Transformer Engine is not installed: a stand-in satisfied megatron.bridge's import only")


def _standin_module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def attr(a: str) -> Any:
        if a.startswith("__"):
            raise AttributeError(a)
        # ``te.ops.Sequential`` in a type annotation evaluated at class definition
        return _NoTransformerEngine if a[:1].isupper() else _standin_module(f"{name}.{a}")

    m.__getattr__ = attr  # type: ignore[method-assign]
    return m


class _CheckpointError(BaseException):
    """Stands for ``torch.distributed.checkpoint.api.CheckpointException`` (a ``BaseException``) in the
    measurements' ``except`` clauses; replaced by the real class once torch is imported."""


def _checkpoint_error() -> None:
    global _CheckpointError
    from torch.distributed.checkpoint.api import CheckpointException

    _CheckpointError = CheckpointException  # type: ignore[misc,assignment]


def _clip(text: str, n: int = 1500) -> str:
    """Head and tail of a long message (a CheckpointException wraps the rank's traceback: the cause is last)."""
    return text if len(text) <= 2 * n else f"{text[:n]} [...] {text[-n:]}"


def _where(e: BaseException) -> dict[str, Any]:
    """The exception and the innermost frame of the traceback (file relative to site-packages, line)."""
    tb = traceback.extract_tb(e.__traceback__)
    frame = tb[-1] if tb else None
    file = frame.filename.split("site-packages/")[-1] if frame else ""
    return {
        "error": _clip(f"{type(e).__name__}: {e}".strip()),
        "file": file,
        "line": frame.lineno if frame else 0,
        "code": (frame.line or "") if frame else "",
        "frames": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in tb[-8:]],
    }


def import_bridge() -> dict[str, Any]:
    """Import ``megatron.bridge`` as shipped; where Transformer Engine is missing, again with
    ``TE_STANDIN`` (after megatron-core's own probes). Returns what happened."""
    from autocompress_nemo.models import compat_cpu

    t = time.perf_counter()
    res: dict[str, Any] = {"compat_cpu": compat_cpu.apply()}  # before megatron.bridge imports the Mamba mixer
    try:
        importlib.import_module("megatron.bridge")
        res["plain_import"] = True
    except (Exception, _CheckpointError) as e:  # the measurement: the exact error of the import as shipped
        res["plain_import"] = False
        res["plain_import_error"] = _where(e)
        for k in [k for k in sys.modules if k.startswith("megatron.bridge")]:
            del sys.modules[k]
        # megatron-core decides "no Transformer Engine" at these imports: run them before the stand-in
        for mod in (
            "megatron.core.extensions",
            "megatron.core.models.gpt.gpt_layer_specs",
            "megatron.core.models.mamba",
            "megatron.core.dist_checkpointing",
            "megatron.core.optimizer",
        ):
            importlib.import_module(mod)
        for name in ("transformer_engine", "transformer_engine.pytorch"):
            sys.modules[name] = _standin_module(name)
        sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]  # type: ignore[attr-defined]
        importlib.import_module("megatron.bridge")
        res["te_standin"] = TE_STANDIN
    import megatron.bridge
    import megatron.core
    import torch
    import transformers

    res["import_s"] = round(time.perf_counter() - t, 1)
    res["versions"] = {
        "megatron-bridge": megatron.bridge.__version__.split("+")[0],
        "megatron-core": megatron.core.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    return res


def _init(threads: int = 2) -> None:
    import torch

    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models import compat_cpu

    torch.set_num_threads(threads)
    compat_cpu.apply()
    init_distributed(tp=1, seed=0)
    _checkpoint_error()


CPU_UNAVAILABLE = (
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "moe_permute_fusion",
    "moe_grouped_gemm",
    "moe_shared_expert_overlap",
)
"""Provider flags whose kernels need Transformer Engine / CUDA (megatron-core refuses them at
``finalize`` without: "apply_rope_fusion is not available. Please install TE >= 1.4.")."""


def finalize_as_written(provider: Any) -> Any:
    """``provider.finalize()`` as training runs it before it writes a ``run_config.yaml`` (it derives
    fields such as ``per_block_parameters`` that the serializer reads). Without Transformer Engine the
    kernel-fusion flags it validates (``CPU_UNAVAILABLE``) are off during finalize and put back as
    Megatron-Bridge set them: the file describes the model for the GPU that will load it."""
    import torch

    te = sys.modules.get("transformer_engine")
    if torch.cuda.is_available() and te is not None and getattr(te, "__file__", None):  # the real one
        provider.finalize()
        return provider
    saved = {f: getattr(provider, f) for f in CPU_UNAVAILABLE if hasattr(provider, f)}
    for f in saved:
        setattr(provider, f, False)
    provider.finalize()
    for f, v in saved.items():
        setattr(provider, f, v)
    return provider


def _cpu_provider(provider: Any, spec: Any = None) -> Any:
    """A Megatron-Bridge provider set to build on this CPU: megatron-core's local layer spec (its default
    is the Transformer Engine spec), float32, initialization on CPU. A hybrid (Nemotron-H) provider gets
    the project's local per-block stack for ``spec`` (megatron-core 0.19 ships Transformer Engine hybrid
    stacks only; the local modules' names are ones the Nemotron-H bridge maps: ``norm.weight``,
    ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``)."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    if isinstance(provider, HybridModelProvider):
        provider.hybrid_stack_spec = _hybrid_local_stack(spec)
        provider.first_last_layers_bf16 = False
        provider.use_mamba_mem_eff_path = False  # the fused path calls causal-conv1d's CUDA kernel
    # the Nemotron-H bridge sets these Transformer Engine / CUDA-only MoE paths ("fused permutation is
    # not available. Please install TE >= 2.1.0."); the allgather dispatcher and per-expert MLPs run on CPU
    provider.moe_grouped_gemm = False
    provider.moe_permute_fusion = False
    provider.moe_shared_expert_overlap = False
    if getattr(provider, "num_moe_experts", None):
        provider.moe_token_dispatcher_type = "allgather"

    from megatron.bridge.models.llama_nemotron.llama_nemotron_provider import LlamaNemotronHeterogeneousProvider

    if isinstance(provider, LlamaNemotronHeterogeneousProvider):  # its default: the TE heterogeneous spec
        provider.transformer_layer_spec = _heterogeneous_local_spec
    elif isinstance(provider, GPTModelProvider):
        provider.transformer_layer_spec = local_layer_spec
    provider.bf16 = provider.fp16 = False
    provider.params_dtype = torch.float32
    provider.pipeline_dtype = None
    provider.autocast_dtype = torch.float32
    provider.use_cpu_initialization = True
    provider.gradient_accumulation_fusion = False
    provider.masked_softmax_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.apply_rope_fusion = False
    provider.persist_layer_norm = False
    provider.cross_entropy_loss_fusion = False
    return provider


def _hybrid_local_stack(spec: Any) -> Any:
    def stack(config: Any) -> Any:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from autocompress_nemo.models.hybrid.configs import family_options
        from autocompress_nemo.models.hybrid.stack import _modules, block_plan, per_block_stack_class

        plan = block_plan(spec, config, False, family_options(spec).mamba_chunk_size)
        return ModuleSpec(
            module=per_block_stack_class(), params={"block_plan": plan, "final_norm": _modules(False)["final"]}
        )

    return stack


def _heterogeneous_local_spec(config: Any) -> Any:
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

    return get_gpt_heterogeneous_layer_spec(config, use_te=False)


def _build(provider: Any) -> Any:
    provider.finalize()
    return provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
    )[0]


def _logits(model: Any, ids: Any) -> Any:
    import torch

    from autocompress_nemo.models.megatron import forward_logits

    model.eval()
    with torch.no_grad():
        return forward_logits(model, ids)


def _ids(vocab: int, seed: int = 0, batch: int = 2, seq: int = 16) -> Any:
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _project_logits(hf_dir: Path, ids: Any) -> tuple[Any, Any]:
    """The project's own adapter on the same directory: its Hugging Face reader -> ``build_model`` ->
    ``hf_to_megatron`` (``models/hybrid/state_dict.py``) -> logits; returns (logits, spec)."""
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron
    from autocompress_nemo.models.parent import _hf_loader

    # megatron-core records a model's attention backend in NVTE_* variables (read by Transformer Engine
    # only) and asserts that a later model agrees; the bridge's provider may have chosen another one
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)
    spec, sd, _ = _hf_loader(hf_dir)(hf_dir, tokenizer=False)
    model = build_model(spec)
    hf_to_megatron(spec, sd, model)
    return _logits(model, ids), spec


def cmd_probe(a: argparse.Namespace) -> dict[str, Any]:
    """Versions, the import as shipped and with the stand-in, and which model bridges are registered."""
    res = import_bridge()
    from megatron.bridge import AutoBridge

    supported = AutoBridge.list_supported_models()
    res["supported_count"] = len(supported)
    res["supported_sample"] = [m for m in supported if any(k in m for k in ("Llama", "NemotronH", "DeciLM", "Qwen3"))]
    return res


def cmd_hf(a: argparse.Namespace) -> dict[str, Any]:
    """A Hugging Face directory (or a GGUF file, read by transformers' ``gguf_file=``) through
    ``AutoBridge``: Megatron-core model on CPU, logits against the project's adapter on the same weights
    and batch, exported back to Hugging Face names (max |d weight| to the input), and Megatron-Bridge's
    own checkpoint save / load (``save_megatron_model`` / ``load_megatron_model``) with logits after."""
    import torch

    res = import_bridge()
    from megatron.bridge import AutoBridge

    _init()
    src = Path(a.src)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".gguf":  # transformers dequantizes the GGUF; saved as a plain HF directory for both sides
        import transformers

        t = time.perf_counter()
        m = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        hf_dir = work / "hf_from_gguf"
        m.save_pretrained(str(hf_dir))
        del m
        res["gguf_to_hf_s"] = round(time.perf_counter() - t, 1)
    else:
        hf_dir = src
    stage = "AutoBridge.from_hf_pretrained"
    try:
        t = time.perf_counter()
        bridge = AutoBridge.from_hf_pretrained(str(hf_dir), dtype=torch.float32, trust_remote_code=a.trust_remote_code)
        stage = "to_megatron_provider / provide_distributed_model"
        from autocompress_nemo.models.parent import _hf_loader

        spec = _hf_loader(hf_dir)(hf_dir, tokenizer=False)[0]
        provider = _cpu_provider(bridge.to_megatron_provider(load_weights=True), spec)
        model = _build(provider)
        res["import_s"] = round(time.perf_counter() - t, 1)
        res["megatron_class"] = type(model).__name__
        vocab = int(bridge.hf_pretrained.config.vocab_size)
        ids = _ids(vocab, seq=a.seq)
        stage = "forward"
        got = _logits(model, ids)[..., :vocab]
        stage = "project adapter"
        want, spec = _project_logits(hf_dir, ids)
        res["max_abs_dlogit_vs_project"] = float((got - want[..., :vocab]).abs().max())
        res["max_abs_logit"] = float(want.abs().max())
        res["argmax_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        stage = "export_hf_weights"
        from safetensors.torch import load_file

        ref: dict[str, Any] = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            ref.update(load_file(str(f)))
        worst, names = 0.0, 0
        for name, tensor in bridge.export_hf_weights([model], cpu=True):
            names += 1
            if name in ref:
                worst = max(worst, float((tensor.float() - ref[name].float()).abs().max()))
            else:
                res.setdefault("exported_not_in_source", []).append(name)
        res["exported_tensors"] = names
        res["source_tensors"] = len(ref)
        res["max_abs_dweight_roundtrip"] = worst
        stage = "save_megatron_model"
        ck = work / "bridge_ckpt"
        bridge.save_megatron_model([model], str(ck))
        res["bridge_ckpt_files"] = sorted(str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file())[:20]
        stage = "load_megatron_model"
        loaded = bridge.load_megatron_model(str(ck), wrap_with_ddp=False)[0]
        res["max_abs_dlogit_after_bridge_ckpt"] = float((_logits(loaded, ids)[..., :vocab] - got).abs().max())
        res["done"] = True
    except (Exception, _CheckpointError) as e:  # the measurement: where it stops
        res["done"] = False
        res["stopped_in"] = stage
        res["stopped_at"] = _where(e)
    return res


def write_run_config(ckpt: str | Path) -> Path:
    """Make a checkpoint the project wrote (``models/dist_checkpoint.py``) a Megatron-Bridge checkpoint:
    ``<iteration dir>/run_config.yaml`` holding the model provider that Megatron-Bridge itself builds
    for the student (``AutoBridge.from_hf_config`` on the student's Hugging Face config:
    ``LlamaBridge`` / ``LlamaNemotronBridge`` for DeciLM students / ``NemotronHBridge``), serialized by
    Megatron-Bridge's own config serializer. Its ``load_megatron_model`` and the recipes'
    ``checkpoint.pretrained_checkpoint`` read the model from that file. Runs in the bridge venv."""
    import tempfile

    import yaml
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.training.config.yaml_utils import safe_yaml_representers
    from transformers import AutoConfig

    from autocompress_nemo.export.hf_config import write_hf_config_dir
    from autocompress_nemo.models.dist_checkpoint import checkpoint_path, read_spec

    ck = Path(ckpt)
    spec = read_spec(ck)
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_config_dir(spec, tmp, engine="", dtype="float32")
        config = AutoConfig.from_pretrained(tmp, trust_remote_code=True)
        provider = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
    finalize_as_written(provider)
    model = _ConfigContainerBase._convert_value_to_dict(provider)
    run_config = {
        "model": model,
        # what Megatron-Bridge's loader reads besides the model: no RNG / optimizer state was saved
        "checkpoint": {
            "save_rng": False,
            "save_optim": False,
            "fully_parallel_save": False,
            "ckpt_format": "torch_dist",
        },
    }
    out = checkpoint_path(ck) / "run_config.yaml"
    with safe_yaml_representers():  # what ConfigContainer.to_yaml writes with (dtypes, callables, enums)
        out.write_text(yaml.safe_dump(run_config, default_flow_style=False))
    return out


def cmd_load_project_ckpt(a: argparse.Namespace) -> dict[str, Any]:
    """A student checkpoint written by the project (``models/dist_checkpoint.py``, torch_dist, Megatron-LM
    layout with ``args`` in it) through Megatron-Bridge's own loader
    (``megatron.bridge.training.model_load_save``: ``load_model_config`` + ``build_and_load_model``, what
    ``load_megatron_model`` runs): first as written (Megatron-LM ``args`` only), then with the
    ``run_config.yaml`` of ``write_run_config``; logits against the project's loader on the same batch.
    The provider read back is set to this CPU (``_cpu_provider``) before it builds."""
    res = import_bridge()
    _init()
    from megatron.bridge.training.model_load_save import build_and_load_model, load_model_config

    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import checkpoint_path, load_checkpoint, read_spec

    ck = Path(a.ckpt)
    it = checkpoint_path(ck)
    spec = read_spec(ck)
    ids = _ids(spec.vocab, seq=a.seq)
    own = build_model(spec)
    load_checkpoint(own, ck)
    want = _logits(own, ids)
    stage = "load_model_config (Megatron-LM args, as written)"
    try:
        load_model_config(str(it))
        res["args_only"] = {"done": True}
    except (Exception, _CheckpointError) as e:
        res["args_only"] = {"done": False, "stopped_at": _where(e)}
    try:
        stage = "write_run_config"
        res["run_config"] = str(write_run_config(ck))
        stage = "load_model_config (run_config.yaml)"
        t = time.perf_counter()
        model_cfg, _ = load_model_config(str(it))
        res["provider"] = type(model_cfg).__name__
        _cpu_provider(model_cfg, spec)
        stage = "build_and_load_model"
        model = build_and_load_model(str(it), model_cfg, use_cpu_init=True, skip_temp_dist_context=True)
        model = model[0] if isinstance(model, list) else model
        res["load_s"] = round(time.perf_counter() - t, 1)
        res["megatron_class"] = type(model).__name__
        stage = "forward"
        got = _logits(model, ids)[..., : spec.vocab]
        res["max_abs_dlogit_vs_project"] = float((got - want).abs().max())
        res["max_abs_logit"] = float(want.abs().max())
        res["done"] = True
    except (Exception, _CheckpointError) as e:
        res["done"] = False
        res["stopped_in"] = stage
        res["stopped_at"] = _where(e)
    return res


def cmd_run_config(a: argparse.Namespace) -> dict[str, Any]:
    """``write_run_config`` for ``--ckpt``."""
    res = import_bridge()
    res["run_config"] = str(write_run_config(a.ckpt))
    return res


def cmd_train_probe(a: argparse.Namespace) -> dict[str, Any]:
    """Megatron-Bridge's training entry points (``finetune``, ``distill``: both run ``training/pretrain.py``'s
    loop) on this machine: where their import stops. ``pretrain.py`` line 19 imports
    ``nvidia_resiliency_ext.inprocess``; the only nvidia-resiliency-ext PyPI carries for this platform,
    0.4.1, has no ``__version__`` and then breaks ``import megatron.core`` itself
    (``megatron/core/dist_checkpointing/strategies/nvrx.py:85``, measured by installing it), so the
    loop cannot be reached here with or without it."""
    res = import_bridge()
    for mod in ("megatron.bridge.training.finetune", "megatron.bridge.training.distill"):
        try:
            importlib.import_module(mod)
            res[mod] = {"imported": True}
        except Exception as e:
            res[mod] = _where(e)
    return res


COMMANDS = {
    "probe": cmd_probe,
    "hf": cmd_hf,
    "load-project-ckpt": cmd_load_project_ckpt,
    "run-config": cmd_run_config,
    "train-probe": cmd_train_probe,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autocompress_nemo.models.bridge", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--out", required=True, help="where the JSON result goes")
    p.add_argument("--src", help="hf: a Hugging Face directory or a GGUF file")
    p.add_argument("--work", help="hf: a scratch directory (checkpoints, the HF directory from a GGUF)")
    p.add_argument("--ckpt", help="load-project-ckpt: the project's dist checkpoint directory")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--trust-remote-code", action="store_true")
    a = p.parse_args(argv)
    res = COMMANDS[a.command](a)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Import smoke test for the container: every package the project imports on GPU must import.

    python docker/smoke_imports.py            # inside the running container (needs a GPU)
    python docker/smoke_imports.py --no-cuda  # at image build time (no GPU in `docker build`)

Exit status 0 when everything required imports and the versions hold; 1 otherwise, with a
line per failure. Optional packages (llama.cpp bindings, TensorRT-LLM, vLLM) are reported,
not required.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

REQUIRED = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.models.hybrid",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.extensions.transformer_engine",
    "transformer_engine.pytorch",
    "mamba_ssm",
    "hydra",
    "omegaconf",
    "transformers",
    "safetensors",
    "gguf",
    "submitit",
    "jinja2",
    "autocompress_nemo",
    "autocompress_nemo.arch.counts",
    "autocompress_nemo.config.schema",
    "autocompress_nemo.costs.memory",
    "autocompress_nemo.plan.dry_run",
    "autocompress_nemo.plan.layout",
    "launchers.launch",
]
OPTIONAL = ["llama_cpp", "tensorrt_llm", "vllm", "causal_conv1d", "apex", "lm_eval"]
MIN_TE = (2, 10)


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for p in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA device checks (image build time)")
    args = ap.parse_args(argv)
    failures: list[str] = []
    if sys.version_info[:2] != (3, 12):
        failures.append(f"python {sys.version.split()[0]}: the project targets 3.12")
    modules = REQUIRED
    if args.no_cuda:
        # these import CUDA libraries at import time; the runtime check covers them
        modules = [m for m in REQUIRED if not m.startswith(("transformer_engine", "mamba_ssm",
                                                             "megatron.core.extensions.transformer_engine"))]
    for name in modules:
        try:
            importlib.import_module(name)
            print(f"ok       {name}")
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            failures.append(f"{name}: {type(e).__name__}: {e}")
            print(f"FAILED   {name}: {type(e).__name__}: {e}")
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
            print(f"ok       {name} (optional)")
        except Exception as e:  # noqa: BLE001
            print(f"missing  {name} (optional): {type(e).__name__}")
    versions = {}
    for dist in ("torch", "megatron-core", "transformer-engine", "transformer_engine", "autocompress-nemo"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    print("versions:", versions)
    mc = versions.get("megatron-core", "0")
    if _version_tuple(mc)[:2] != (0, 19):
        failures.append(f"megatron-core {mc}: the project needs 0.19.x")
    te = versions.get("transformer-engine") or versions.get("transformer_engine")
    if te is None:
        failures.append("transformer-engine is not installed (the NGC PyTorch image ships it)")
    elif _version_tuple(te)[:2] < MIN_TE:
        failures.append(f"transformer-engine {te} < {MIN_TE[0]}.{MIN_TE[1]} (megatron-core 0.19 checks for it)")
    if not args.no_cuda:
        import torch

        if not torch.cuda.is_available():
            failures.append("torch.cuda.is_available() is False: run with --gpus all (or pass --no-cuda)")
        else:
            print(f"cuda     {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, "
                  f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
    if failures:
        print("\nsmoke test FAILED:\n  - " + "\n  - ".join(failures))
        return 1
    print("\nsmoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

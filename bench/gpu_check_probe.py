"""GPU probes of ``bench/gpu_check.sh`` that need the project's Python (one probe per call):

    python bench/gpu_check_probe.py te                                   # Transformer Engine layer spec
    torchrun --standalone --nproc-per-node=2 bench/gpu_check_probe.py nccl   # NCCL, TP=2

Each prints one JSON line (``{"probe", "ok", ...}``, rank 0 only) and exits non-zero when it fails.
``te``: the tiny heterogeneous model (per-layer heads, KV groups, ffn, removed blocks) built with the
Transformer Engine layer spec (``impl="te"``: TE linear / norm / attention modules) at TP=1 on NCCL,
its logits against the float32 CPU reference. ``nccl``: the same model at TP=2 over NCCL (two GPUs),
each rank's logits against the same reference.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

TOL = 1e-3  # TF32 / fused kernels on GPU against a float32 CPU reference (tests/test_compat_builder.py)


def _tiny_hetero():
    from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

    A, M = AttentionBlock, MlpBlock
    blocks = (A(4, 2, 16), M(96), A(2, 2, 16), M(0), A(0, 0, 16), M(64), A(6, 2, 16), M(32))
    return ArchSpec(hidden=64, vocab=128, blocks=blocks, name="tiny_hetero", norm_eps=1e-5)


def _logits_error(tp: int, impl: str) -> tuple[float, list[str]]:
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.builder import build_model, forward_logits
    from autocompress_nemo.models.llama import hf_to_megatron
    from autocompress_nemo.models.llama.reference import random_hf_state_dict, reference_logits

    init_distributed(tp=tp, backend="nccl", seed=0)
    spec = _tiny_hetero()
    hf_sd = random_hf_state_dict(spec, seed=2)
    model = build_model(spec, impl=impl)  # type: ignore[arg-type]
    hf_to_megatron(spec, hf_sd, model)
    ids = torch.randint(0, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = forward_logits(model, ids).float().cpu()
    err = (got - reference_logits(spec, hf_sd, ids)).abs().max().item()
    te = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("TE")})
    return err, te


def main(argv: list[str]) -> int:
    probe = argv[1] if len(argv) > 1 else ""
    t0 = time.time()
    out: dict = {"probe": probe}
    try:
        if probe == "te":
            import transformer_engine

            err, te = _logits_error(1, "te")
            out.update(
                transformer_engine=getattr(transformer_engine, "__version__", "?"), te_modules=te, max_abs_err=err
            )
            out["ok"] = bool(te) and err < TOL
        elif probe == "nccl":
            err, _ = _logits_error(2, "auto")
            t = torch.tensor([float(err)], device="cuda")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            out.update(world=torch.distributed.get_world_size(), nccl=".".join(map(str, torch.cuda.nccl.version())))
            out.update(max_abs_err=t.item(), ok=t.item() < TOL)
        else:
            raise SystemExit(f"usage: {argv[0]} te|nccl")
    except Exception as e:  # noqa: BLE001 -- the probe reports every failure as a JSON line
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    out["seconds"] = round(time.time() - t0, 1)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out), flush=True)
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Inputs of bench/gpu_check.sh's Megatron-Bridge recovery-recipe check (run in the project's interpreter).

    python bench/gpu_check_bridge.py OUT_DIR

writes into OUT_DIR a tiny parent (Llama, head_dim 64, vocab 512, with the byte tokenizer as a Hugging
Face tokenizer), a heterogeneous student checkpoint sliced by the project's own code paths
(``models/dist_checkpoint.py``) made a Megatron-Bridge checkpoint (``models.bridge.write_run_config``, in
the bridge interpreter: ``$ACN_BRIDGE_PYTHON``), and ``inputs.json`` (``bridge_recipe.recipe_inputs`` of a
composed run config with a 16-step token budget). gpu_check.sh then runs
``python -m autocompress_nemo.models.bridge_recipe --config OUT_DIR/inputs.json --run`` under torchrun.
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.context import ByteTokenizer
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.models.bridge import run_bridge
    from autocompress_nemo.models.bridge_recipe import recipe_inputs
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.dist_checkpoint import save_checkpoint
    from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron
    from autocompress_nemo.models.llama.hf_io import export_hf
    from autocompress_nemo.models.llama.reference import random_hf_state_dict

    out.mkdir(parents=True, exist_ok=True)
    init_distributed(tp=1, seed=0)
    parent = ArchSpec.llama(hidden=256, vocab=512, layers=4, heads=4, kv_groups=2, ffn=512, head_dim=64, name="p")
    parent_hf = export_hf(
        parent, random_hf_state_dict(parent, seed=1), out / "parent_hf", tokenizer=ByteTokenizer(512).to_hf()
    )
    A, M = AttentionBlock, MlpBlock
    blocks = (A(4, 2, 64), M(512), A(4, 1, 64), M(256), A(0, 0, 64), M(512), A(4, 2, 64), M(256))
    student = ArchSpec(hidden=256, vocab=512, blocks=blocks, name="s", norm_eps=1e-5)
    model = build_model(student)
    hf_to_megatron(student, random_hf_state_dict(student, seed=2), model)
    ckpt = out / "student_ckpt"
    save_checkpoint(model, student, ckpt)
    rc = run_bridge("run-config", "--ckpt", str(ckpt))
    cfg = compose(
        ["model=tiny_llama", "+target=tiny_cpu", "distill.tokens=16384", "distill.batch_size=4", "distill.seq_len=256"]
    )
    inp = recipe_inputs(cfg, ckpt, parent_hf, out / "bridge_distill")
    inp["checkpoint_every"] = 8
    (out / "inputs.json").write_text(json.dumps(inp, indent=1))
    print(
        json.dumps(
            {
                "inputs": str(out / "inputs.json"),
                "run_config": rc["run_config"],
                "te_standin": bool(rc.get("te_standin")),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Build a Megatron ``HybridModel`` (Mamba-2 / attention / MLP / MoE blocks) from an ArchSpec.

Legend: B batch, T sequence length, V vocabulary, h hidden.

The model is Megatron-core's ``HybridModel`` driven by ``hybrid_layer_pattern`` (one
character per block: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE), whose decoder is a
``PerBlockHybridStack`` (``stack.py``): every block has its own shape, and a removed block is a
no-op. This covers Nemotron-H (Mamba-2 + attention + relu² MLP), Nemotron 3 Nano / Super
(+ MoE with a shared expert, Super's LatentMoE projection) and Qwen3-MoE (attention + SwiGLU
MoE, RoPE, q/k norms: pattern ``*E*E...``).

Module names (local spec): ``embedding.word_embeddings``, ``decoder.layers[i].{norm,
mixer.{in_proj, conv1d_weight, conv1d_bias, dt_bias, A_log, D, norm, out_proj}}`` (Mamba),
``{input_layernorm, self_attention.{linear_qkv, linear_proj, q_layernorm, k_layernorm}}``
(attention), ``{pre_mlp_layernorm, mlp.{linear_fc1, linear_fc2}}`` (MLP),
``{pre_mlp_layernorm, mlp.{router, experts.local_experts[j], shared_experts, fc1_latent_proj,
fc2_latent_proj}}`` (MoE), ``decoder.final_norm``, ``output_layer``.

On CPU (gloo): Mamba runs mamba-ssm's PyTorch reference scan / gated norm and LatentMoE a
replicated linear (``compat_cpu`` patches 4-5); the MoE token dispatcher is ``allgather``
(the ``alltoall`` one needs CUDA streams). On GPU: Transformer Engine modules when available.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models import compat_cpu

MAMBA_INSTALL = (
    "MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-deps --no-build-isolation "
    "mamba-ssm==2.3.2.post1 && pip install einops"
)


def is_hybrid(spec: ArchSpec) -> bool:
    """True for specs this builder handles: any MoE / Mamba block, or a hybrid/MoE family."""
    return bool(spec.kinds() & {"moe", "mamba"}) or spec.family in ("nemotron_h", "qwen3_moe")


def _require_mamba(spec: ArchSpec) -> None:
    if "mamba" not in spec.kinds():
        return
    missing = [m for m in ("mamba_ssm", "einops") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"ArchSpec {spec.name!r} has Mamba blocks but {missing} is not installed; install with: {MAMBA_INSTALL}"
        )


def build_hybrid_model(
    spec: ArchSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    init_seed: int = 0,
    impl: str = "auto",
    **config_overrides: Any,
) -> Any:
    """A Megatron ``HybridModel`` of ``spec`` on this rank, randomly initialized, in eval mode.

    Needs Megatron's parallel state (``init_distributed(tp=, pp=, ep=)``). Routed experts are
    split over the EP group (every MoE block's expert count must divide by EP). The spec is
    attached as ``model.arch_spec`` (``builder.forward_logits`` gives full-vocabulary logits).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import ModuleSpec

    from autocompress_nemo.models.hybrid.configs import family_options, model_config
    from autocompress_nemo.models.hybrid.names import hf_names
    from autocompress_nemo.models.hybrid.stack import _modules, block_plan, per_block_stack_class
    from autocompress_nemo.models.megatron import padded_vocab, resolve_impl

    compat_cpu.apply()
    _require_mamba(spec)
    hf_names(spec)  # validates the family's block layout
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel state is not initialized: call "
            "autocompress_nemo.distributed.init_distributed(tp=..., ep=...) first"
        )
    use_te = resolve_impl(impl)  # type: ignore[arg-type]
    fam = family_options(spec)
    config = model_config(
        spec, params_dtype=params_dtype, sequence_parallel=sequence_parallel, use_te=use_te, **config_overrides
    )
    plan = block_plan(spec, config, use_te, fam.mamba_chunk_size)
    stack_spec = ModuleSpec(
        module=per_block_stack_class(), params={"block_plan": plan, "final_norm": _modules(use_te)["final"]}
    )
    torch.manual_seed(init_seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(init_seed, force_reset_rng=True)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pattern = "".join("*-EM"["attention mlp moe mamba".split().index(b.kind)] for b in spec.blocks)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=stack_spec,
        vocab_size=padded_vocab(spec.vocab, tp),
        max_sequence_length=spec.max_position,
        hybrid_layer_pattern=pattern,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=fam.position_embedding,
        rotary_base=int(spec.rope_theta),
    )
    if torch.cuda.is_available():
        model = model.cuda()
    if spec.vocab != padded_vocab(spec.vocab, tp):
        from autocompress_nemo.models.megatron import _zero_padded_vocab_rows

        _zero_padded_vocab_rows(model, spec.vocab)
    model.arch_spec = spec
    model.blocks_per_layer = 1  # one ArchSpec block per decoder layer (models/megatron.block_layers)
    return model.eval()

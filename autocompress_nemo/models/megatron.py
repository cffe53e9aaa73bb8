"""What every Megatron model here shares, whichever class builds it (``GPTModel`` for Llama-style
models in ``builder.py``, ``HybridModel`` in ``hybrid/``): the common ``TransformerConfig`` fields,
the Transformer Engine switch, vocabulary padding, full-vocabulary logits, and the one accessor
from a block index of the ``ArchSpec`` to the Megatron layer that holds it."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.models import compat_cpu


def common_config(
    spec: ArchSpec, params_dtype: torch.dtype, tp: int, pp: int, sequence_parallel: bool
) -> dict[str, Any]:
    """``TransformerConfig`` fields every family shares here: RMSNorm, no biases, no dropout, no
    fused kernels (CPU has none; GPU runs the same numerics), CPU initialization without CUDA,
    the parameter dtype and the TP / PP sizes (sequence parallelism only with TP > 1)."""
    return dict(
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        sequence_parallel=sequence_parallel and tp > 1,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        init_method_std=0.02,
    )


Impl = Literal["auto", "local", "te"]


def _megatron():  # noqa: ANN202 - lazy import: megatron is heavy and patched on CPU first
    compat_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    return parallel_state, HeterogeneousTransformerConfig


def te_available() -> bool:
    """True when Transformer Engine is importable and a GPU is present."""
    if not torch.cuda.is_available():
        return False
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # noqa: BLE001 - a broken TE install counts as absent
        return False
    return bool(HAVE_TE)


def resolve_impl(impl: Impl) -> bool:
    """``impl`` -> use Transformer Engine? ``auto`` = TE when importable with CUDA."""
    if impl == "auto":
        return te_available()
    if impl == "te":
        if not te_available():
            raise RuntimeError("impl='te' needs Transformer Engine and CUDA; use impl='local' on this machine")
        return True
    if impl == "local":
        return False
    raise ValueError(f"impl {impl!r}: use 'auto', 'local' or 'te'")


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of TP (VocabParallelEmbedding splits it evenly)."""
    return -(-vocab // tp) * tp


def _zero_padded_vocab_rows(model: Any, vocab: int) -> None:
    """Rows past the real vocabulary are padding: zero them (their logits are dropped anyway)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for w in (
            getattr(getattr(model, "embedding", None), "word_embeddings", None),
            getattr(model, "output_layer", None),
        ):
            if w is None or getattr(w, "weight", None) is None:
                continue
            rows = w.weight.shape[0]
            start = tp_rank * rows
            local_pad_from = max(0, vocab - start)
            if local_pad_from < rows:
                w.weight[local_pad_from:].zero_()


def block_layers(model: Any) -> dict[int, Any]:
    """``{block index: Megatron layer}`` for the blocks built on this rank (pipeline stages hold a
    slice). A ``GPTModel`` layer holds two blocks (attention ``2l`` in ``self_attention``, mlp
    ``2l+1`` in ``mlp``); a ``HybridModel`` layer holds one. The module paths inside a layer are
    the same for both (``self_attention.linear_proj``, ``mlp.linear_fc2``, ``mixer.out_proj``)."""
    spec: ArchSpec = model.arch_spec
    layers = {int(layer.layer_number) - 1: layer for layer in model.decoder.layers}
    if getattr(model, "blocks_per_layer", None) == 1:
        return layers
    return {2 * n + j: layer for n, layer in layers.items() for j in (0, 1) if 2 * n + j < len(spec.blocks)}


def forward_logits(model: Any, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary next-token logits ``[B, T, V]`` in float32, on every TP rank.

    Position ids are ``0..T-1``; the causal mask is Megatron's own (``attention_mask=None``
    with a causal mask type). Vocab-parallel logits are gathered over the TP group
    (differentiable: the backward takes each rank's slice) and padding columns dropped.
    Pipeline parallelism is not handled here (use Megatron's schedules).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    spec: ArchSpec | None = getattr(model, "arch_spec", None)
    device = next(model.parameters()).device
    input_ids_BT = input_ids_BT.to(device)
    B, T = input_ids_BT.shape
    sp = getattr(model.config, "sequence_parallel", False)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if sp and T % tp:
        raise ValueError(f"sequence parallel needs the sequence length ({T}) divisible by TP ({tp})")
    position_ids_BT = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
    logits_BTv = model(input_ids=input_ids_BT, position_ids=position_ids_BT, attention_mask=None)
    logits_BTV = gather_from_tensor_model_parallel_region(logits_BTv) if tp > 1 else logits_BTv
    if spec is not None and logits_BTV.shape[-1] != spec.vocab:
        logits_BTV = logits_BTV[..., : spec.vocab]
    return logits_BTV.float()


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² (Nemotron-H's ``relu2``), eager: Megatron's copy is ``torch.compile``'d, which on
    CPU costs tens of seconds of C++ compilation on the first call."""
    return torch.square(F.relu(x))


def activation(name: str) -> tuple[Any, bool]:
    """``(activation_func, gated_linear_unit)`` of an ArchSpec activation name."""
    if name == "swiglu":
        return F.silu, True
    if name == "relu2":
        if torch.cuda.is_available():
            from megatron.core.activations import squared_relu as compiled_squared_relu

            return compiled_squared_relu, False
        return squared_relu, False
    if name == "gelu":
        return F.gelu, False
    raise ValueError(f"unknown activation {name!r}")

"""Per-GPU training memory: small pure functions, each docstring deriving its formula.

Everything here is an estimate from shapes (estimated, not measured). Parameter counts come
from ``arch/counts.py``; nothing here re-derives them.

Legend: s = sequence length per context-parallel rank (``seq_len / cp``), b = micro batch,
h = hidden, V = vocab, H/G/d = query heads / KV groups / head dim, F = ffn width,
E/k/Fe/S/L = routed experts / top-k / expert ffn / shared-expert ffn / latent size,
di = Mamba inner width (heads x head dim), N = state size, Gm = Mamba groups,
t = tensor parallel, BF16 = 2 bytes per activation element.

Mixed-precision training as Megatron does it (bf16 parameters, fp32 gradient buffers,
fp32 master weights and two fp32 Adam moments) costs per trainable parameter:

    2 (bf16 weight) + 4 (fp32 main grad) + 12 (fp32 master + Adam m + Adam v) = 18 bytes,

with the 12 optimizer bytes divided by the data-parallel size under the distributed
optimizer: ``6 + 12 / dp`` (the same accounting as Megatron-LM's theoretical memory report).
"""

from __future__ import annotations

from autocompress_nemo.arch.counts import block_params
from autocompress_nemo.arch.spec import AttentionBlock, Block, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.blocks.base import ffn_params

BF16 = 2
FP32 = 4
RECOMPUTE_MODES = ("none", "selective", "full")


# -- parameters, gradients, optimizer -------------------------------------------------------


def expert_params(b: Block, hidden: int) -> int:
    """Routed-expert parameters of a block: ``E * ffn_params(L or h, Fe)`` for MoE, else 0.

    These are the parameters sharded by expert parallelism (and expert tensor parallelism);
    everything else in the block (router, latent projections, shared expert, norm) is dense.
    """
    if isinstance(b, MoeBlock) and not b.removed and b.num_experts:
        return b.num_experts * ffn_params(b.latent or hidden, b.expert_ffn, b.gated)
    return 0


def weight_bytes(params: float, dtype_bytes: float = BF16) -> float:
    """Model weights: ``params * dtype_bytes`` (bf16: 2 bytes)."""
    return params * dtype_bytes


def grad_bytes(trainable_params: float, grad_dtype_bytes: float = FP32) -> float:
    """Gradient buffers: ``trainable * 4`` (Megatron keeps main grads in fp32)."""
    return trainable_params * grad_dtype_bytes


def optimizer_bytes(trainable_params: float, dp: int, distributed: bool) -> float:
    """Adam with fp32 master weights: ``12 * trainable`` bytes, or ``12 * trainable / dp``
    when the distributed optimizer shards them over the ``dp`` data-parallel ranks
    (for experts, ``dp`` is the expert-data-parallel size ``world / (ep * etp * pp)``)."""
    return 12.0 * trainable_params / (dp if distributed else 1)


# -- activations -------------------------------------------------------------------------


def _norm_parts(s: int, b: int, h: int, t: int, sp: bool) -> tuple[float, float]:
    """(block input, norm output) stored per block: ``2*s*b*h`` bytes each; split ``t`` ways
    with sequence parallelism, replicated on every TP rank without it."""
    x = BF16 * s * b * h / (t if sp else 1)
    return x, x


def attention_activation_bytes(blk: AttentionBlock, h: int, s: int, b: int, t: int, sp: bool, recompute: str) -> float:
    """Stored activations of an attention block with flash attention (no s x s scores).

    ``input 2sbh + norm out 2sbh`` (both / t under SP) ``+ Q,K,V 2sb(H + 2G)d / t +
    attention out 2sbHd / t + softmax stats 4sbH / t``. Selective recompute drops the norm
    output; full recompute keeps only the input (see ``block_activation_bytes``).
    """
    if blk.removed:
        return 0.0
    x, n = _norm_parts(s, b, h, t, sp)
    core = BF16 * s * b * ((blk.num_heads + 2 * blk.num_kv_groups) * blk.head_dim + blk.num_heads * blk.head_dim)
    core += FP32 * s * b * blk.num_heads
    return x + (0.0 if recompute == "selective" else n) + core / t


def mlp_activation_bytes(blk: MlpBlock, h: int, s: int, b: int, t: int, sp: bool, recompute: str) -> float:
    """Stored activations of a dense MLP block.

    ``input 2sbh + norm out 2sbh + fc1 out 2sb*F*(2 if gated else 1) / t + act out 2sbF / t``.
    Selective recompute drops the norm output and the activation output.
    """
    if blk.removed:
        return 0.0
    x, n = _norm_parts(s, b, h, t, sp)
    fc1 = BF16 * s * b * blk.ffn * (2 if blk.gated else 1) / t
    act = BF16 * s * b * blk.ffn / t
    if recompute == "selective":
        return x + fc1
    return x + n + fc1 + act


def moe_activation_bytes(blk: MoeBlock, h: int, s: int, b: int, t: int, etp: int, sp: bool, recompute: str) -> float:
    """Stored activations of a (latent) MoE block, balanced routing assumed.

    Per token: ``input 2h + norm out 2h`` (/ t under SP) ``+ router logits 4E (fp32)
    + latent down/up 2*2L`` and, for each of its k routed copies, ``permuted input 2(L or h)
    + fc1 out 2Fe(x2 if gated) + act out 2Fe + expert out 2(L or h)``, plus the shared expert
    like an MLP of width S. Expert parallelism moves tokens but not their count per GPU
    (balanced routing); expert tensors are split by ``t`` when tokens are sequence-split
    over TP (SP), else by ``etp``. Selective recompute drops norm and activation outputs.
    """
    if blk.removed:
        return 0.0
    x, n = _norm_parts(s, b, h, t, sp)
    tok = s * b
    inner = blk.latent or h
    split = t if sp else etp
    routed = 0.0
    if blk.num_experts and blk.expert_ffn:
        per_copy = BF16 * (2 * inner + blk.expert_ffn * (2 if blk.gated else 1))
        act: float = BF16 * blk.expert_ffn
        routed = tok * blk.top_k * (per_copy + (0 if recompute == "selective" else act)) / split
        routed += FP32 * tok * blk.num_experts / (t if sp else 1)
    latent = BF16 * tok * 2 * blk.latent / t if blk.latent else 0.0
    shared = 0.0
    if blk.shared_ffn:
        fc1 = BF16 * tok * blk.shared_ffn * (2 if blk.gated else 1) / t
        act = BF16 * tok * blk.shared_ffn / t
        shared = fc1 + (0.0 if recompute == "selective" else act)
    return x + (0.0 if recompute == "selective" else n) + routed + latent + shared


def mamba_activation_bytes(blk: MambaBlock, h: int, s: int, b: int, t: int, sp: bool, recompute: str) -> float:
    """Stored activations of a Mamba-2 block (chunked SSD scan; chunk states are recomputed
    in backward, as mamba-ssm does).

    Per token: ``input 2h + norm out 2h`` (/ t under SP) ``+ in_proj out 2(2di + 2GmN + Hm)
    + conv out 2(di + 2GmN) + scan out 2di + gated-norm out 2di + dA_cumsum 4Hm``, all
    but the first two split over t (heads and groups are split by TP). Selective recompute
    drops the norm output and the conv activation output.
    """
    if blk.removed:
        return 0.0
    x, n = _norm_parts(s, b, h, t, sp)
    di, gn = blk.d_inner, blk.num_groups * blk.state_size
    per_tok = BF16 * (2 * di + 2 * gn + blk.num_heads) + BF16 * 2 * di + FP32 * blk.num_heads
    conv = BF16 * (di + 2 * gn)
    if recompute != "selective":
        per_tok += conv
    return x + (0.0 if recompute == "selective" else n) + s * b * per_tok / t


def block_activation_bytes(
    blk: Block, h: int, s: int, b: int, t: int, etp: int, sp: bool, recompute: str, *, full_layer: bool = False
) -> float:
    """Stored activations of one block for one micro batch under ``recompute``.

    ``full``: only the block input is kept, ``2*s*b*h`` (/ t under SP); the block's full
    activations are rebuilt one block at a time during backward (count them once per stage
    with ``full_layer=True``). ``none`` / ``selective``: the per-kind formulas.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"cluster.recompute={recompute!r}: use one of {RECOMPUTE_MODES}")
    if blk.removed:
        return 0.0
    if recompute == "full" and not full_layer:
        return BF16 * s * b * h / (t if sp else 1)
    mode = "none" if recompute == "full" else recompute
    if isinstance(blk, AttentionBlock):
        return attention_activation_bytes(blk, h, s, b, t, sp, mode)
    if isinstance(blk, MlpBlock):
        return mlp_activation_bytes(blk, h, s, b, t, sp, mode)
    if isinstance(blk, MoeBlock):
        return moe_activation_bytes(blk, h, s, b, t, etp, sp, mode)
    if isinstance(blk, MambaBlock):
        return mamba_activation_bytes(blk, h, s, b, t, sp, mode)
    raise TypeError(f"unknown block {blk!r}")


def stage_activation_bytes(
    blocks: list[Block], h: int, s: int, b: int, t: int, etp: int, sp: bool, recompute: str
) -> float:
    """Activations of one pipeline stage for one micro batch: the sum over its blocks, plus,
    under full recompute, the largest block's full activations (rebuilt during backward)."""
    total = sum(block_activation_bytes(x, h, s, b, t, etp, sp, recompute) for x in blocks)
    if recompute == "full" and blocks:
        total += max(block_activation_bytes(x, h, s, b, t, etp, sp, "full", full_layer=True) for x in blocks)
    return total


def forward_only_peak_bytes(blocks: list[Block], h: int, s: int, b: int, t: int, etp: int, sp: bool) -> float:
    """Peak transient activations of a no-grad forward (teacher, ranking pass): nothing is
    kept for backward, so the peak is about one block's activations plus its input:
    ``max over blocks of block_activation_bytes(recompute='none') + 2sbh``."""
    if not blocks:
        return 0.0
    peak = max(block_activation_bytes(x, h, s, b, t, etp, sp, "none") for x in blocks)
    return peak + BF16 * s * b * h


def in_flight_microbatches(pp: int, stage: int, num_microbatches: int) -> int:
    """Micro batches whose activations a pipeline stage holds at once under 1F1B:
    ``min(pp - stage, num_microbatches)`` (stage 0 holds the most: ``pp``)."""
    return max(1, min(pp - stage, num_microbatches))


def logits_bytes(vocab: int, s: int, b: int, t: int, with_teacher: bool, trainable: bool) -> float:
    """Output-layer tensors on the last pipeline stage, vocab split over TP:
    student ``s*b*V/t * (2 bf16 logits + 4 fp32 log-softmax + 4 fp32 grad)`` when it trains
    (``2 + 4`` without backward), plus ``4*s*b*V/t`` for the teacher's fp32 probabilities
    during distillation."""
    per = (BF16 + FP32 + FP32) if trainable else (BF16 + FP32)
    if with_teacher:
        per += FP32
    return per * s * b * vocab / t


def embedding_and_head_params(vocab: int, hidden: int, tied: bool, pp: int) -> tuple[int, int]:
    """(first-stage, last-stage) parameters outside the blocks: the embedding ``V*h`` on the
    first stage; the LM head ``V*h`` plus the final norm ``h`` on the last stage. A tied head
    shares the embedding when ``pp == 1``; across pipeline stages Megatron keeps a second copy
    on the last stage (kept in sync by an all-reduce of their gradients)."""
    head = 0 if (tied and pp == 1) else vocab * hidden
    return vocab * hidden, head + hidden


def dense_and_expert_params(blocks: list[Block], hidden: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a list of blocks, from ``arch/counts.py``."""
    expert = sum(expert_params(x, hidden) for x in blocks)
    return sum(block_params(x, hidden) for x in blocks) - expert, expert

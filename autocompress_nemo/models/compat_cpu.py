"""The one place where megatron-core 0.19 is adapted to run on CPU with gloo.

Megatron is written for CUDA. On a machine without a GPU driver a handful of its
assumptions fail; each adaptation below is a small, named ``Patch`` with a comment saying
what Megatron assumes and why replacing it is safe. ``apply()`` is idempotent and a
no-op when CUDA is available (on GPU nothing is patched; the real code paths run).

Later adaptations (MoE alltoall dispatcher streams, Mamba scan / norm stand-ins, DDP
tensor factories, the ``dist_checkpointing`` writer's CUDA synchronize) are added to ``PATCHES``
the same way.

Besides the patches this module provides ``SequenceParallelTorchNorm``: Megatron's
local (non Transformer-Engine) norm refuses ``sequence_parallel``; the builder uses this
norm in the local spec instead (see its docstring).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    apply: Callable[[], None]


_APPLIED: set[str] = set()


def cuda_available() -> bool:
    return torch.cuda.is_available()


# -- 1. current device ---------------------------------------------------------------------
# Megatron assumes: ``torch.cuda.current_device()`` names the device of every tensor it
# allocates (tensor_parallel.layers / mappings / attention / rotary embedding).
# Without a driver that call raises "Found no NVIDIA driver". Safe because: on a machine
# with no CUDA device there is only one device the tensors can live on, the CPU; the
# patch is installed only when ``torch.cuda.is_available()`` is False, so no code that
# could have used a GPU is redirected.
def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]  # torch types it as returning an int index


# -- 2. tensor-parallel RNG tracker -----------------------------------------------------------
# Megatron assumes: the tensor-parallel RNG tracker (``model_parallel_cuda_manual_seed``,
# ``get_cuda_rng_tracker().fork()`` around dropout and GPU weight init) saves and restores
# the *CUDA* generator state. Without CUDA, ``torch.cuda.get_rng_state`` raises.
# Safe because: the tracker's contract is "named streams of random numbers, forked and
# restored"; on CPU every random op draws from the CPU generator, so tracking the CPU
# generator's state gives exactly that contract (same seeds -> same streams).
def _make_cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker, keeping CPU generator states instead of CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # initialize_rng_tracker looks the class up at call time, so it now builds ours.
    mrandom.CudaRNGStatesTracker = _make_cpu_tracker_class()
    mrandom.initialize_rng_tracker(force_reset=True)


# -- 3. default causal mask -------------------------------------------------------------------
# Megatron assumes: with ``attention_mask=None`` and a causal mask type, the softmax builds
# the mask with ``torch.ones(sq, sq, device="cuda")`` (transformer/utils.py, imported by
# name into fusions/fused_softmax.py). Safe because: the replacement builds the identical
# boolean upper-triangular mask (True = masked) on the CPU, where the scores are.
@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = _cpu_causal_mask
        mod.get_sliding_window_causal_mask = _cpu_sliding_window_mask


# -- 4. Mamba-2 through mamba-ssm's pure-PyTorch reference ops (hybrid models) ------------------
# Megatron assumes: mamba-ssm with its compiled parts. ``import mamba_ssm`` imports the
# Mamba-1 CUDA extension ``selective_scan_cuda`` (not built with MAMBA_SKIP_CUDA_BUILD, so the
# import fails and Megatron's ``MambaMixer`` refuses to build), and the Mamba-2 mixer calls
# Triton kernels (``mamba_chunk_scan_combined`` for the chunked SSD scan, ``rmsnorm_fn`` for
# the gated RMSNorm) that need a GPU. Safe because: the stand-in extension is only imported,
# never called (Megatron's Mamba-2 path does not use the Mamba-1 selective scan; any call
# raises); the norm is replaced by mamba-ssm's own reference implementation (``rms_norm_ref``)
# and the scan by ``_ssd_scan_reference``: the decomposition of mamba-ssm's reference
# ``ssd_chunk_scan_combined_ref`` in plain PyTorch (differentiable), with its decay matrices
# masked *before* the exponential (the reference's backward is NaN once a chunk's
# ``sum(dt * |A|)`` exceeds ~88.7: tests/test_ep_router_nan.py). The scan needs the sequence to
# be a multiple of the chunk size: it is zero-padded at the end, which cannot change earlier
# outputs of a causal scan. Only the full-sequence path is adapted (no initial / final states: no
# incremental decoding on CPU). Needs ``use_mamba_mem_eff_path=False`` (the fused
# conv+scan+norm kernel has no reference); the hybrid builder sets it on CPU.
class _MissingCudaExtension:
    """Stand-in for a CUDA extension module that is imported but must never be used."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getattr__(self, attr: str) -> object:
        raise RuntimeError(
            f"{self.__name__}.{attr}: this CUDA extension is not available on a CPU-only machine "
            "(compat_cpu stand-in); only Mamba-2 with the reference PyTorch ops runs here"
        )


def _causal_decay(cs: torch.Tensor) -> torch.Tensor:
    """``decay[..., l, s] = exp(cs[l] - cs[s])`` for ``s <= l`` and exactly 0 above the diagonal.

    ``cs`` is a cumulative log-decay (``cumsum(dt * A)``, non-increasing), so the causal entries
    are ``<= 1``; the acausal ones, ``+sum(dt * |A|)`` over up to a whole chunk, overflow float32
    above ~88.7. They are set to ``-inf`` *before* the exponential: ``exp(-inf) = 0`` and its
    derivative ``0`` (masking after ``exp`` leaves ``inf`` there, and the backward ``0 * inf``
    is NaN).
    """
    T = cs.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=cs.device).tril()
    return torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")))


def _ssd_scan_reference(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,  # noqa: ANN001, ANN201
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
    **_ignored,
):
    """``mamba_chunk_scan_combined`` (Mamba-2 SSD) in plain PyTorch, chunk by chunk.

    Shapes: x ``[b, L, h, p]``, dt ``[b, L, h]``, A ``[h]``, B/C ``[b, L, g, n]``. With
    ``dt <- softplus(dt + dt_bias)``, ``a_t = dt_t * A`` and the state ``S_t [h, p, n]``::

        S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t + D x_t,      y <- y * silu(z)

    computed per chunk of ``chunk_size`` (``cs`` the in-chunk cumsum of ``a``): the in-chunk
    part ``sum_{s<=l} (C_l.B_s) exp(cs_l - cs_s) dt_s x_s``, each chunk's end state
    ``sum_s exp(cs_end - cs_s) dt_s x_s B_s^T``, the states carried across chunks with the
    chunk totals, and their read-out ``exp(cs_l) C_l S_prev``. The same decomposition and
    einsums as mamba-ssm's ``ssd_chunk_scan_combined_ref``, except that the decay matrices are
    masked before the exponential (``_causal_decay``): the reference exponentiates the acausal
    entries too, which overflow when a chunk's ``sum(dt * |A|)`` exceeds ~88.7, and its
    backward then gives NaN gradients while the forward stays finite.
    """
    if initial_states is not None or seq_idx is not None or cu_seqlens is not None:
        raise NotImplementedError("CPU Mamba scan: initial states / packed sequences are not supported")
    if return_final_states or return_varlen_states:
        raise NotImplementedError("CPU Mamba scan: returning final states (incremental decoding) is not supported")
    if tuple(dt_limit) != (0.0, float("inf")):
        raise NotImplementedError(f"CPU Mamba scan: dt_limit={dt_limit} is not supported")
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    pad = (-L) % chunk_size  # zero-padding at the end cannot change earlier outputs of a causal scan
    if pad:

        def _p(t):  # noqa: ANN001, ANN202 - pad the sequence dim (dim 1) at the end
            return None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))

        x, dt, B, C, z = _p(x), _p(dt), _p(B), _p(C), _p(z)
    c, q = (L + pad) // chunk_size, chunk_size
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt.view(b, c, q, h).permute(0, 3, 1, 2)  # [b, h, c, q]
    cs = torch.cumsum(dt * A.float().view(h, 1, 1), dim=-1)  # [b, h, c, q]
    xc = x.view(b, c, q, h, p)
    Bc = B.repeat_interleave(h // g, dim=2).view(b, c, q, h, n)
    Cc = C.repeat_interleave(h // g, dim=2).view(b, c, q, h, n)
    # in-chunk: sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) dt_s x_s
    CB = torch.einsum("bclhn,bcshn->bchls", Cc, Bc)
    scores = (CB * _causal_decay(cs).permute(0, 2, 1, 3, 4)).to(x.dtype)
    y = torch.einsum("bchls,bhcs,bcshp->bclhp", scores, dt.to(x.dtype), xc)
    # each chunk's end state, then the states entering each chunk (chunk totals, initial state 0)
    end = torch.einsum(
        "bclhn,bhcl,bhcl,bclhp->bchpn", Bc, torch.exp(cs[..., -1:] - cs).to(x.dtype), dt.to(x.dtype), xc
    ).float()
    end = torch.cat([torch.zeros_like(end[:, :1]), end], dim=1).reshape(b, c + 1, h, p * n)
    totals = torch.nn.functional.pad(cs[..., -1], (1, 0)).cumsum(dim=-1)  # [b, h, c + 1]
    prev = torch.einsum("bhzc,bchd->bzhd", _causal_decay(totals), end)[:, :-1].reshape(b, c, h, p, n)
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, prev.to(C.dtype)) * torch.exp(cs.permute(0, 2, 3, 1)).unsqueeze(-1)
    y = y.reshape(b, c * q, h, p)
    if D is not None:
        y = y + x * (D.view(h, 1) if D.dim() == 1 else D)
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return y[:, :L]


def _gated_rmsnorm_reference(
    x,
    weight,
    bias,
    z=None,
    eps=1e-6,
    group_size=None,  # noqa: ANN001, ANN201
    norm_before_gate=True,
):
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref

    return rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


def _patch_mamba_reference_ops() -> None:
    import importlib.util
    import sys

    if importlib.util.find_spec("mamba_ssm") is None:
        return  # not installed: the hybrid builder says how to install it when a Mamba block is built
    try:
        import selective_scan_cuda  # noqa: F401
    except ImportError:
        sys.modules["selective_scan_cuda"] = _MissingCudaExtension("selective_scan_cuda")  # type: ignore[assignment]
    from mamba_ssm.ops.triton import layernorm_gated
    from megatron.core.ssm import mamba_mixer

    if not mamba_mixer.HAVE_MAMBA_SSM:
        raise RuntimeError(
            "megatron.core.ssm.mamba_mixer was imported before compat_cpu.apply() could install the "
            "mamba-ssm stand-ins; call autocompress_nemo.models.compat_cpu.apply() before importing it"
        )
    mamba_mixer.mamba_chunk_scan_combined = _ssd_scan_reference
    layernorm_gated.rmsnorm_fn = _gated_rmsnorm_reference


# -- 5. LatentMoE projections without Transformer Engine ------------------------------------------
# Megatron assumes: the LatentMoE down/up projections (``MoELayer.fc1_latent_proj`` /
# ``fc2_latent_proj``, hidden <-> ``moe_latent_size``) are TE ``TELinear`` layers in
# "duplicated" mode (the same full weight on every tensor-parallel rank); without TE the
# layer asserts. Safe because: a duplicated ``TELinear`` is a plain replicated linear
# ``y = x W^T (+ b)`` returning ``(y, bias-or-None)``; ``DuplicatedLinear`` is exactly that,
# with the same parameter names (``weight``, ``bias``). Under sequence parallelism each TP
# rank sees a slice of the tokens, so (as Megatron does for replicated weights) the
# parameters are marked ``sequence_parallel`` for the gradient all-reduce in
# ``finalize_model_grads``. Installed only when Transformer Engine is absent.
class DuplicatedLinear(torch.nn.Module):
    """A replicated linear layer with TE ``TELinear``'s call signature (``parallel_mode='duplicated'``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,  # noqa: ANN001
        skip_bias_add: bool,
        parallel_mode: str = "duplicated",
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        **_: object,
    ) -> None:
        super().__init__()
        if parallel_mode != "duplicated" or skip_weight_param_allocation:
            raise NotImplementedError(f"DuplicatedLinear: parallel_mode={parallel_mode!r} is not supported")
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        for p_ in (self.weight, self.bias):
            if p_ is not None:
                p_.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


def _patch_latent_moe_linear() -> None:
    from megatron.core.transformer.moe import moe_layer

    if moe_layer.HAVE_TE:
        return
    moe_layer.HAVE_TE = True  # only read by the latent-projection assert at construction time
    moe_layer.TELinear = DuplicatedLinear


# -- 6. torch.compile'd router helper ---------------------------------------------------------------
# Megatron assumes: ``jit_fuser`` (``torch.compile`` on torch >= 2.2) is cheap on the GPU it
# targets. ``TopKRouter._apply_expert_bias`` (the expert-bias token counter, used by sigmoid
# routers such as Nemotron-H's) is decorated with it; on CPU the first call compiles C++ with
# inductor (~30 s on these machines) for a one-line ``+=``. Safe because: the compiled and the
# original function compute the same thing; the original (``__wrapped__``) runs eagerly.
def _patch_router_jit() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    f = TopKRouter.__dict__["_apply_expert_bias"]
    TopKRouter._apply_expert_bias = getattr(f, "_torchdynamo_orig_callable", getattr(f, "__wrapped__", f))


# -- 7. dist_checkpointing save (torch_dist) ---------------------------------------------------------
# Megatron assumes: the checkpoint writer copies GPU tensors to host memory with
# ``non_blocking=True`` and then waits with ``torch.cuda.synchronize()``
# (``FileSystemWriterAsync.preload_tensors``); without a driver that call raises. The
# failure flag broadcast after writing (``state_dict_saver``) is allocated on
# ``torch.cuda.current_device()``, which patch 1 already answers with the CPU.
# Safe because: on a machine without CUDA every tensor already lives in host memory, so the
# copy is synchronous (``non_blocking=False``) and there is nothing to wait for; the original
# function runs, only its ``synchronize`` is skipped.
def _patch_dist_ckpt_preload() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__["preload_tensors"].__func__

    def preload_tensors(write_buckets, non_blocking=True):  # noqa: ANN001, ANN202, ARG001
        return original(write_buckets, non_blocking=False)

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors)


PATCHES: list[Patch] = [
    Patch("current_device", "torch.cuda.current_device() used as the allocation device", _patch_current_device),
    Patch("rng_tracker", "tensor-parallel RNG tracker keeps CUDA generator states", _patch_rng_tracker),
    Patch("causal_mask", "default causal mask built with device='cuda'", _patch_causal_mask),
    Patch(
        "mamba_reference_ops", "mamba-ssm CUDA/Triton kernels -> its PyTorch reference ops", _patch_mamba_reference_ops
    ),
    Patch("latent_moe_linear", "LatentMoE projections are TE TELinear layers", _patch_latent_moe_linear),
    Patch("router_jit", "torch.compile'd MoE router helper (30 s C++ compile on CPU)", _patch_router_jit),
    Patch("dist_ckpt_preload", "dist_checkpointing save waits with torch.cuda.synchronize()", _patch_dist_ckpt_preload),
]


def apply() -> list[str]:
    """Install every CPU adaptation once; returns the names applied so far.

    No-op (returns ``[]``) when CUDA is available.
    """
    if cuda_available():
        return []
    for p in PATCHES:
        if p.name not in _APPLIED:
            p.apply()
            _APPLIED.add(p.name)
            log.debug("compat_cpu: applied %s (%s)", p.name, p.why)
    return sorted(_APPLIED)


# -- sequence-parallel norm for the local spec ---------------------------------------------------
class _AllReduceGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            g = g.contiguous()
            torch.distributed.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        return g


class SequenceParallelTorchNorm(torch.nn.Module):
    """RMSNorm / LayerNorm for the local spec that also works with sequence parallelism.

    Megatron assumes: sequence parallelism uses Transformer Engine's norm (``TENorm``);
    ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. With sequence
    parallelism each TP rank normalizes its own slice of the sequence, so the norm
    weight's gradient on one rank covers only that slice: the true gradient is the sum
    over the TP group. Megatron's own fix is ``finalize_model_grads`` all-reducing params
    marked ``sequence_parallel``; this norm instead all-reduces the weight's gradient
    inside autograd (so plain ``loss.backward()`` is correct without Megatron's DDP), and
    does *not* set the ``sequence_parallel`` attribute, so the all-reduce is never done
    twice. Without sequence parallelism it is exactly ``torch.nn.RMSNorm``/``LayerNorm``.
    Parameter names (``weight``, ``bias``) match torch's norms.

    ``reduce_grads_over_tp=True`` is for norms whose input is split over TP ranks along
    another axis (q/k norms see only the rank's heads): their gradient is summed over TP
    whatever the sequence-parallel setting. Do not combine with Megatron's
    ``finalize_model_grads`` (it would reduce these gradients a second time).
    """

    def __init__(
        self, config, hidden_size: int, eps: float = 1e-5, reduce_grads_over_tp: bool = False, **_: object
    ) -> None:  # noqa: ANN001
        super().__init__()
        self.reduce_grads = bool(config.sequence_parallel) or reduce_grads_over_tp
        self.normalization = config.normalization
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.normalization == "LayerNorm":
            self.bias: torch.nn.Parameter | None = torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=config.params_dtype)
            )
        elif config.normalization == "RMSNorm":
            self.bias = None
        else:
            raise ValueError(f"normalization {config.normalization!r}: only RMSNorm and LayerNorm are supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.reduce_grads and torch.is_grad_enabled():
            w = _AllReduceGradOverTP.apply(w)
            b = _AllReduceGradOverTP.apply(b) if b is not None else None
        shape = (x.shape[-1],)
        if self.normalization == "RMSNorm":
            return torch.nn.functional.rms_norm(x, shape, w, self.eps)
        return torch.nn.functional.layer_norm(x, shape, w, b, self.eps)


def qk_norm(config, hidden_size: int, eps: float = 1e-5, **kw: object) -> SequenceParallelTorchNorm:  # noqa: ANN001
    """Per-head q/k norm of the local spec (Qwen3): gradient summed over the TP group."""
    return SequenceParallelTorchNorm(config, hidden_size, eps, reduce_grads_over_tp=True)

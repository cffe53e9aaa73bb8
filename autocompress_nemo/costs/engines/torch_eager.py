"""PyTorch eager (transformers) on CPU: a *measurement* engine for heterogeneous hybrids.

**Not a production serving engine: the explicitly labelled fallback.** Hybrids on this CPU are
measured and served in llama.cpp (``nemotron_h`` / ``nemotron_h_moe``, ``conf/engine/llama_cpp_hybrid_cpu.yaml``),
which reads per layer the dense ffn width, query / KV heads, routed-expert width and top-k. This
engine stays for what llama.cpp refuses, as measured with llama-cpp-python 0.3.36
(``tests/test_llamacpp_hybrid_engine.py``): per-block routed-expert counts, shared-expert widths and
Mamba heads, and a dense MLP block in a model with MoE blocks. Every number this engine produces is labelled
"PyTorch eager (transformers) on CPU" (``version()``, ``provenance()['serving']``).

Model: transformers' own ``NemotronHForCausalLM`` (uniform config from
``models.nemotron_h.hf_config_from_spec``); every block whose shape differs from the global
config is rebuilt as ``NemotronHBlock`` from a copy of the config with that block's fields
(experts, top-k, expert / shared width, latent, Mamba heads and groups, attention heads, MLP
width) — the per-layer route vLLM takes for the Puzzle format. Removed blocks are dropped and
routed-expert-free MoE blocks become MLPs (``nemotron_h.hf_io.compact_state_dict``); a MoE block
without a shared expert gets a zero module in place of transformers' fallback width. Mamba uses
transformers' pure-PyTorch ops (the mamba-ssm / Hub kernels need CUDA), attention ``sdpa``.

Timing (``torch.set_num_threads(threads)`` for the measurement, restored afterwards):

- prefill: a fresh cache, one forward of ``batch x input_len`` random tokens (logits of the last
  token only); one warm-up, then ``repeats`` timed runs.
- decode: prefill to the decode context ``C`` once, then repeatedly forward one token per
  sequence and drop it from the attention KV cache again, so every timed step sees ``C`` cached
  tokens (the Mamba conv / SSM state advances, but its size is constant in context);
  ``decode_warmup`` steps, then ``decode_steps`` timed ones.
- clock: thread CPU time at one thread (PyTorch computes on the calling thread; other
  processes on the shared cores do not count), wall time otherwise (``settings.clock``);
  both are kept (``*_wall_ms``). Statistic: the ``percentile``-th percentile (default 10th).
- several models: held together (up to ``settings.hold_bytes`` of weights) and timed in many short
  interleaved rounds (``settings.rounds``), each turn cache-warm after ``decode_warmup`` steps.

Memory by part (``Measurement.memory``), with what is counted and what is measured:

- ``weights``: measured — bytes of the instantiated parameters (sum of numel x element size);
- ``kv``: counted — ``2 * G * d * C_ctx * B * b(kv)`` over attention blocks at ``context_len``
  (transformers grows its cache per step; no preallocation). The bytes of the real cache
  tensors at the decode context are recorded as ``raw['memory_kv_at_decode_context']``;
- ``state``: measured — bytes of the conv + SSM state tensors in the cache after prefill;
- ``output``: counted — logits of one token per sequence, ``V * B * 4``;
- ``compute``: 0 — eager PyTorch allocates activations per op; the workspace is not measured.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MambaBlock, MlpBlock, MoeBlock
from autocompress_nemo.costs.engines.base import CpuTimedEngine, Measurement, Workload
from autocompress_nemo.costs.engines.paired import interleave

LABEL = "PyTorch eager (transformers) on CPU — a measurement engine, not a production serving engine"
_MAMBA_OPS = (
    "mamba2_chunk_scan",
    "causal_conv1d_fn",
    "mamba2_split_conv1d_scan_combined",
    "causal_conv1d_update",
    "mamba2_selective_state_update",
)


@contextlib.contextmanager
def torch_mamba_ops() -> Iterator[Any]:
    """transformers' NemotronH module with its pure-PyTorch Mamba ops (restored on exit)."""
    import transformers.models.nemotron_h.modeling_nemotron_h as mn

    saved = {f: getattr(mn, f) for f in _MAMBA_OPS if hasattr(mn, f)}
    try:
        for f, fn in saved.items():
            setattr(mn, f, getattr(fn, "__wrapped__", fn))
        yield mn
    finally:
        for f, fn in saved.items():
            setattr(mn, f, fn)


class _Zero(torch.nn.Module):
    """A MoE block's missing shared expert (adds nothing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def _block_fields(b: Any) -> dict[str, Any]:
    """The config fields a block of this shape needs in its own layer config."""
    if isinstance(b, MoeBlock):
        return {
            "n_routed_experts": b.num_experts,
            "num_experts_per_tok": b.top_k,
            "moe_intermediate_size": b.expert_ffn,
            "moe_shared_expert_intermediate_size": b.shared_ffn,
            "moe_latent_size": b.latent or None,
        }
    if isinstance(b, MlpBlock):
        return {"intermediate_size": b.ffn}
    if isinstance(b, MambaBlock):
        return {
            "mamba_num_heads": b.num_heads,
            "n_groups": b.num_groups,
            "ssm_state_size": b.state_size,
            "mamba_head_dim": b.head_dim,
        }
    assert isinstance(b, AttentionBlock)
    return {"num_attention_heads": b.num_heads, "num_key_value_heads": b.num_kv_groups, "head_dim": b.head_dim}


def hf_eager_model(
    spec: ArchSpec, sd: dict[str, torch.Tensor], mn: Any, attn: str = "sdpa", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """transformers ``NemotronHForCausalLM`` of ``spec`` (any per-block shapes) holding ``sd``
    (Nemotron-H-named, ``models/hybrid/names.py``). ``mn``: the modeling module (``torch_mamba_ops``)."""
    from autocompress_nemo.models.nemotron_h.config import hf_config_from_spec
    from autocompress_nemo.models.nemotron_h.hf_io import compact_state_dict

    cspec, csd = compact_state_dict(spec, sd)
    cfg = hf_config_from_spec(cspec)
    for k in ("block_configs", "architectures", "model_type", "mtp_block_configs", "num_nextn_predict_layers"):
        cfg.pop(k, None)
    config = mn.NemotronHConfig(**cfg)
    config._attn_implementation = attn
    model = mn.NemotronHForCausalLM(config)
    for i, b in enumerate(cspec.blocks):
        fields = {k: v for k, v in _block_fields(b).items() if getattr(config, k, None) != v}
        if fields:
            lc = copy.deepcopy(config)
            for k, v in fields.items():
                setattr(lc, k, v)
            model.model.layers[i] = mn.NemotronHBlock(lc, i)
        if isinstance(b, MoeBlock) and b.shared_ffn == 0:
            model.model.layers[i].mixer.shared_experts = _Zero()
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in csd.items():
        k = k.replace("backbone.", "model.", 1)
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():  # one tensor per expert -> [E, out, in]
            j = parts.index("experts")
            experts.setdefault(".".join(parts[: j + 1] + [parts[j + 2]]), {})[int(parts[j + 1])] = v
        else:
            state[k] = v
    state.update({k: torch.stack([d[e] for e in sorted(d)]) for k, d in experts.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [
        m
        for m in missing
        if not m.endswith("e_score_correction_bias") and not (cspec.tied_embeddings and m.endswith("lm_head.weight"))
    ]
    empty = {n for n, p in model.named_parameters() if p.numel() == 0}
    if unexpected or set(missing) - empty:
        raise RuntimeError(
            f"torch_eager: weights do not fit the transformers model: missing {missing}, unexpected {unexpected}"
        )
    return model.to(dtype).eval()


def _cache_bytes(cache: Any) -> tuple[float, float]:
    """(attention KV bytes, Mamba conv + SSM state bytes) of the tensors held by a transformers cache."""
    from transformers.cache_utils import DynamicLayer

    kv = st = 0.0
    for layer in getattr(cache, "layers", []):
        ts = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        for v in vars(layer).values():
            if isinstance(v, dict):
                v = list(v.values())
            if isinstance(v, (list, tuple)):
                ts += [t for t in v if isinstance(t, torch.Tensor)]
        n = float(sum(t.numel() * t.element_size() for t in ts))
        if isinstance(layer, DynamicLayer):
            kv += n
        else:
            st += n
    return kv, st


class TorchEagerEngine(CpuTimedEngine):
    name = "torch_eager"
    decode_steps = 60

    def __init__(self, cfg: Any, hardware: Any = None, workdir: Any = None, *, in_worker: bool = False) -> None:
        super().__init__(cfg, hardware, workdir, in_worker=in_worker)

    def version(self) -> str:
        import transformers

        return f"PyTorch eager {torch.__version__.split('+')[0]} / transformers {transformers.__version__} (CPU)"

    def provenance(self) -> dict[str, Any]:
        p = super().provenance()
        p.update(serving=LABEL)
        return p

    def check_servable(self, spec: ArchSpec, parent: ArchSpec | None = None) -> list[str]:
        out = super().check_servable(spec, parent)
        if spec.family != "nemotron_h":
            out.append(
                f"torch_eager serves Nemotron-H hybrids (transformers NemotronHForCausalLM), got family {spec.family!r}"
            )
        if not any(isinstance(b, AttentionBlock) and not b.removed for b in spec.blocks):
            out.append("no attention block left: transformers' NemotronH cache needs one (get_seq_length)")
        acts = {b.activation for b in spec.blocks if isinstance(b, (MlpBlock, MoeBlock)) and not b.removed}
        if acts - {"relu2"}:
            out.append(f"Nemotron-H MLPs / experts are relu2, got {sorted(acts)}")
        return out

    def _dtype(self) -> torch.dtype:
        d = str(self.cfg.dtype)
        table = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
        if d not in table:
            raise ValueError(f"engine.dtype={d!r}: torch_eager runs f32, bf16 or f16")
        return table[d]

    # -- measurement --------------------------------------------------------------------------
    def measure(self, spec: ArchSpec, workload: Workload, weights: dict[str, Any] | None = None) -> Measurement:
        return self.measure_many([spec], workload, weights=[weights], rounds=1)[0]

    def measure_many(
        self,
        specs: list[ArchSpec],
        workload: Workload,
        *,
        rounds: int | None = None,
        weights: list[dict[str, Any] | None] | None = None,
        timing: bool = True,
        log: Any = None,
        reference: ArchSpec | None = None,
        scale: dict[str, float] | None = None,
    ) -> list[Measurement]:
        """Measure several models in interleaved rounds (see the module docstring), each turn paired
        with ``reference`` when the settings ask for one (``costs/engines/paired.py``).

        The models of a group (as many as fit ``settings.hold_bytes`` of weights, default 2 GiB)
        are built once and kept; each round gives every model of the group its turn of
        ``ceil(repeats / rounds)`` prefills and ``ceil(decode_steps / rounds)`` decode steps (the first
        turn after ``decode_warmup`` untimed steps, so its weights are cache-warm as in a lone run).
        Many short rounds spread slow drift of a shared machine over all models alike."""
        from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict

        weights = weights or [None] * len(specs)
        for s in specs:
            self.require_servable(s)
        if not self.in_worker:
            return self._in_worker(specs, workload, weights, rounds, timing, log, reference, scale)
        cpu_clock = self.clock() == "thread_cpu"
        old_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads())

        def build(spec: ArchSpec, sd: Any, mn: Any) -> _Live:
            sd = random_hf_state_dict(spec, seed=0) if sd is None else sd
            sd = {k: torch.as_tensor(v) for k, v in sd.items()}
            model = hf_eager_model(spec, sd, mn, self.settings.attn_implementation, self._dtype())
            return _Live(model, spec, workload, self, cpu_clock)

        try:
            with torch_mamba_ops() as mn, torch.inference_mode():

                def open_model(i: int) -> _Live:
                    self.runs += 1
                    return build(specs[i], weights[i], mn)

                open_reference = None
                if reference is not None and timing and self.uses_reference():
                    self.require_servable(reference)

                    def open_reference() -> _Live:
                        return build(reference, None, mn)

                return interleave(
                    self,
                    specs,
                    open_model,
                    open_reference,
                    ("weights", "kv", "state", "compute", "output"),
                    rounds=rounds,
                    min_steps=2,
                    scale=scale,
                    keep=True,
                    groups=self._groups(specs),
                    timing=timing,
                    log=log,
                )
        finally:
            torch.set_num_threads(old_threads)

    def _in_worker(
        self,
        specs: list[ArchSpec],
        workload: Workload,
        weights: list[dict[str, Any] | None],
        rounds: int | None,
        timing: bool,
        log: Any,
        reference: ArchSpec | None,
        scale: dict[str, float] | None,
    ) -> list[Measurement]:
        """``measure_many`` in the engine's worker process; given weights travel as safetensors files."""
        from safetensors.torch import save_file

        from autocompress_nemo.costs.engines.worker import call_project_worker, project_request

        files: list[str | None] = []
        for i, sd in enumerate(weights):
            if sd is None:
                files.append(None)
                continue
            f = self.workdir / f"weights-{os.getpid()}-{i}.safetensors"
            save_file({k: torch.as_tensor(v).contiguous() for k, v in sd.items()}, str(f))
            files.append(str(f))
        req = project_request(
            self,
            specs,
            workload,
            weights=files,
            reference=reference.to_dict() if reference is not None else None,
            rounds=rounds,
            timing=timing,
            scale=scale,
        )
        try:
            return call_project_worker(self, "autocompress_nemo.costs.engines.torch_eager", req, log)
        finally:
            for name in files:
                if name:
                    Path(name).unlink(missing_ok=True)

    def _groups(self, specs: list[ArchSpec]) -> list[list[int]]:
        """Consecutive groups of models whose weights together fit ``settings.hold_bytes``."""
        from autocompress_nemo.arch.counts import block_params, embedding_params

        cap = float(self.settings.hold_bytes)
        per = torch.tensor([], dtype=self._dtype()).element_size()
        groups: list[list[int]] = [[]]
        used = 0.0
        for i, s in enumerate(specs):
            b = per * float(embedding_params(s) + sum(block_params(x, s.hidden) for x in s.blocks))
            if groups[-1] and used + b > cap:
                groups.append([])
                used = 0.0
            groups[-1].append(i)
            used += b
        return groups


class _Live:
    """One model held for measurement: a decode cache at context ``C`` and the timed forwards.

    A *turn* = ``repeats`` prefills of ``batch x input_len`` (fresh cache; one untimed warm-up in the
    first turn) and ``decode_warmup`` untimed + ``steps`` timed decode steps at context ``C``
    (each step's token is cropped from the attention KV cache again)."""

    model: torch.nn.Module | None
    """The model; None once closed."""

    def __init__(
        self, model: torch.nn.Module, spec: ArchSpec, wl: Workload, engine: TorchEagerEngine, cpu_clock: bool
    ) -> None:
        from autocompress_nemo.costs import memory as cmem

        self.model, self.spec, self.wl, self.cpu_clock = model, spec, wl, cpu_clock
        self.gen = torch.Generator().manual_seed(0)
        self.warm = engine.settings.decode_warmup
        self.warm_prefill = True
        self.c = engine.decode_context(wl)
        _, self.cache = self._fwd(self._toks(self.c), None)
        kv_now, state = _cache_bytes(self.cache)
        self.memory: dict[str, float] = {
            "weights": float(sum(p.numel() * p.element_size() for p in model.parameters())),
            "kv": cmem.kv_cache_bytes(spec, wl.context_len, wl.batch, str(engine.cfg.kv_dtype)),
            "state": state,
            "compute": 0.0,
            "output": float(cmem.output_buffer_bytes(spec.vocab, wl.batch)),
            "kv_at_decode_context": kv_now,
        }

    def _toks(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.spec.vocab, (self.wl.batch, n), generator=self.gen)

    def _fwd(self, ids: torch.Tensor, cache: Any, past: int = 0) -> tuple[tuple[float, float], Any]:
        """One forward; ((clock ms, wall ms), cache). Positions given: a model without attention has no KV length."""
        assert self.model is not None, "forward on a closed model"
        pos = torch.arange(past, past + ids.shape[1])[None].expand(ids.shape[0], -1)
        c, t = time.thread_time(), time.perf_counter()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, position_ids=pos)
        dt, dc = (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3
        return ((dc if self.cpu_clock else dt), dt), out.past_key_values

    def kv_bytes(self) -> float:
        return _cache_bytes(self.cache)[0]

    def prefill(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed prefills of ``batch x input_len`` (fresh cache each; one untimed warm-up the first time)."""
        out = []
        for r in range(n + (1 if self.warm_prefill else 0)):
            t, _ = self._fwd(self._toks(self.wl.input_len), None)
            if r or not self.warm_prefill:
                out.append(t)
        self.warm_prefill = False
        return out

    def decode(self, n: int) -> list[tuple[float, float]]:
        """``n`` timed decode steps at context ``C`` (``decode_warmup`` untimed ones the first time);
        each step's token is cropped from the attention KV cache again."""
        from transformers.cache_utils import DynamicLayer

        out = []
        for step in range(n + self.warm):
            t, self.cache = self._fwd(self._toks(1), self.cache, past=self.c)
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer) and layer.is_initialized:
                    layer.crop(-1)
            if step >= self.warm:
                out.append(t)
        self.warm = 0
        return out

    def close(self) -> None:
        self.model = self.cache = None


def _measure_many(req: dict[str, Any]) -> dict[str, Any]:
    """The worker task: time the models of ``req`` in this process."""
    from safetensors.torch import load_file

    from autocompress_nemo.costs.engines.worker import measurements_response, worker_engine, worker_log

    eng = worker_engine(TorchEagerEngine, req)
    out = eng.measure_many(
        [ArchSpec.from_dict(d) for d in req["specs"]],
        Workload(**req["workload"]),
        rounds=req.get("rounds"),
        weights=[load_file(f) if f else None for f in req["weights"]],
        timing=bool(req.get("timing", True)),
        log=worker_log,
        reference=ArchSpec.from_dict(req["reference"]) if req.get("reference") else None,
        scale=req.get("scale"),
    )
    return measurements_response(eng, out)


if __name__ == "__main__":  # the engine worker (costs/engines/worker.py): python -m ...torch_eager REQUEST RESPONSE
    from autocompress_nemo.costs.engines.workers._protocol import serve

    sys.exit(serve({"measure_many": _measure_many}))

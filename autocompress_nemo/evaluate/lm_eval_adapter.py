"""lm-evaluation-harness adapter: any lm-eval task on a student or the parent.

Legend: B batch, T tokens, V vocab.

``TorchLM(model, forward, tokenizer)`` is an ``lm_eval.api.model.LM`` over any
``torch.nn.Module`` with ``forward(model, input_ids_BT) -> logits_BTV`` (for Megatron models
``models.builder.forward_logits``). The three request types:

- ``loglikelihood(context, continuation)``: ``sum_t log q(c_t | context, c_<t)`` over the
  continuation tokens and whether every one of them is the argmax (greedy). The pair is
  encoded as lm-eval's HF model does: ``encode(context + continuation)`` split after
  ``len(encode(context))`` tokens, trailing spaces of the context moved to the
  continuation, an empty context replaced by the prefix token (BOS, else EOS).
- ``loglikelihood_rolling(text)``: the whole text scored in disjoint rolling windows of
  ``max_length`` tokens (``lm_eval.utils.get_rolling_token_windows``), each token predicted
  once, the first from the prefix token.
- ``generate_until(context, {until, max_gen_toks})``: greedy decoding (full recompute per
  token; no KV cache — meant for small models and short answers), cut at the first stop string.

Batches are right-padded: the models are causal, so padding after a sequence never changes
its logits. ``tokenizer``: a Hugging Face tokenizer, or any object with ``encode(str) ->
list[int]``, ``decode(list[int]) -> str`` and ``eos_token_id`` (``bos_token_id`` optional).

``run_lm_eval(...)`` runs tasks through ``lm_eval.simple_evaluate`` and returns the
``{task: {metric: value}}`` table plus versions and limits (for ``report.json``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


class _Progress:
    """``[label done/total] what`` with the time left at every quarter of ``total`` items (calls of at
    least 16 items; ``done`` never passes ``total``)."""

    def __init__(self, label: str, what: str, total: int, log: Callable[[str], None]) -> None:
        self.label, self.what, self.total, self.log = label, what, total, log
        self.t0, self.every, self.said = time.time(), max(1, total // 4), 0

    def __call__(self, done: int) -> None:
        done = min(done, self.total)
        if self.total < 16 or done // self.every <= self.said // self.every and done != self.total:
            return
        if done == self.said:
            return
        self.said = done
        el = time.time() - self.t0
        self.log(
            f"[{self.label} {done}/{self.total}] {self.what} ({el:.0f} s, ~{el / done * (self.total - done):.0f} s left)"
        )


class TorchLM(LM):
    """lm-eval ``LM`` over (model, forward, tokenizer); see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        forward: Forward,
        tokenizer: Any,
        *,
        max_length: int = 2048,
        batch_size: int = 8,
        max_gen_toks: int = 64,
        name: str = "model",
    ) -> None:
        super().__init__()
        self.model, self.forward, self.tokenizer = model, forward, tokenizer
        self.max_length, self.batch_size, self.max_gen_toks, self.name = max_length, batch_size, max_gen_toks, name
        eos = getattr(tokenizer, "eos_token_id", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        prefix = bos if bos is not None else eos
        if prefix is None:
            raise ValueError(
                "the tokenizer has neither bos_token_id nor eos_token_id: lm-eval needs a prefix "
                "token for empty contexts and rolling windows"
            )
        self.prefix_token_id: int = int(prefix)
        self.log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
        """Where progress lines go (``[lm-eval <name> done/total] ...`` at every quarter of a long call)."""
        self.eos_token_id = eos
        self.pad_token_id = int(getattr(tokenizer, "pad_token_id", None) or self.prefix_token_id)

    # -- tokenization ---------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # a minimal tokenizer without the HF keyword
            return list(self.tokenizer.encode(text))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    # -- scoring core -------------------------------------------------------------------------
    @torch.no_grad()
    def _logprobs(self, seqs: list[list[int]], tails: list[int] | None = None) -> list[torch.Tensor]:
        """Log-softmax ``[T_i, V]`` for each token sequence (right-padded batches); with ``tails``
        only the last ``tails[i]`` positions of each (what a continuation needs: the softmax over
        the vocabulary is the costly part)."""
        self.model.eval()
        out: list[torch.Tensor] = []
        progress = _Progress(f"lm-eval {self.name}", "sequences scored", len(seqs), self.log)
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i : i + self.batch_size]
            T = max(len(s) for s in chunk)
            ids_BT = torch.full((len(chunk), T), self.pad_token_id, dtype=torch.long)
            for b, s in enumerate(chunk):
                ids_BT[b, : len(s)] = torch.tensor(s, dtype=torch.long)
            logits_BTV = self.forward(self.model, ids_BT)
            for b, s in enumerate(chunk):
                keep = len(s) if tails is None else min(tails[i + b], len(s))
                out.append(F.log_softmax(logits_BTV[b, len(s) - keep : len(s)].float(), dim=-1).cpu())
            progress(len(out))
        return out

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), greedy?)`` for (context ids, continuation ids) pairs."""
        seqs = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("lm-eval request with an empty continuation cannot be scored")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens is longer than max_length={self.max_length}")
            full = (ctx + cont)[-(self.max_length + 1) :]  # left-truncate the context
            seqs.append(full[:-1])  # row j of the log-probs predicts full[j + 1]
        results = []
        for (_ctx, cont), logp_TV in zip(pairs, self._logprobs(seqs, [len(c) for _, c in pairs]), strict=True):
            n = len(cont)
            tail_TV = logp_TV[-n:]
            target = torch.tensor(cont, dtype=torch.long)
            lp = float(tail_TV.gather(1, target[:, None]).sum().double())
            greedy = bool((tail_TV.argmax(-1) == target).all())
            results.append((lp, greedy))
        return results

    # -- the LM interface ---------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs: list[tuple[list[int], list[int]]] = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                ctx, cont = [self.prefix_token_id], self.tok_encode(continuation)
            else:
                ctx, cont = self._encode_pair(context, continuation)
            pairs.append((ctx, cont))
        out = self._score(pairs)
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        progress = _Progress(f"lm-eval {self.name}", "texts scored", len(requests), self.log)
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            ]
            total = sum(lp for lp, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
            progress(len(out))
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context) or [self.prefix_token_id]
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                window = (ids + new)[-self.max_length :]
                nxt = int(self._logprobs([window])[0][-1].argmax())
                if self.eos_token_id is not None and nxt == self.eos_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(u and u in text for u in until):
                    break
            for u in until:
                if u:
                    text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out


def task_manager(include_path: str | None, tasks: list[str]) -> Any:
    """lm-eval's ``TaskManager`` for ``tasks``: indexing lm-eval's own task YAMLs (thousands of them)
    took ~10 s per run on this CPU (about half of a tiny model's evaluate stage), so when every one of
    ``tasks`` is a local task (a YAML in ``include_path``, as the generated stdlib task is) only that
    directory is indexed; otherwise lm-eval's tasks are indexed as well."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
        return TaskManager(include_path=include_path)
    return TaskManager()


def run_lm_eval(
    model: torch.nn.Module,
    forward: Forward,
    tokenizer: Any,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    max_length: int = 2048,
    batch_size: int = 8,
    seed: int = 1234,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``model``; returns ``{"results": {task: {metric: value}}, ...}``.

    ``include_path``: a directory of task YAMLs (local tasks); hub datasets need network access.
    """
    import lm_eval

    lm = TorchLM(model, forward, tokenizer, max_length=max_length, batch_size=batch_size)
    tm = task_manager(include_path, tasks)
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=tm,
        limit=limit,
        num_fewshot=num_fewshot,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        bootstrap_iters=0,
        log_samples=False,
    )
    if res is None:  # only on non-zero ranks of a multi-process lm-eval run
        return {}
    table = {
        task: {k: v for k, v in metrics.items() if isinstance(v, int | float) and k != "alias"}
        for task, metrics in res["results"].items()
    }
    try:
        from importlib.metadata import version

        lm_eval_version = version("lm_eval")
    except Exception:  # noqa: BLE001
        lm_eval_version = "unknown"
    return {
        "results": table,
        "n_samples": res.get("n-samples", {}),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "lm_eval_version": lm_eval_version,
    }

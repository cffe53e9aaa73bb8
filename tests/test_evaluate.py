"""Evaluation: perplexity against a hand computation, the lm-eval adapter on local tasks
(multiple choice + rolling log-likelihood, through ``lm_eval.simple_evaluate``), greedy
generation, and the engine check (llama.cpp measured vs budget; roofline labelled estimated).

Models are tiny Megatron ``GPTModel``s from the real builder; the tokenizer is byte-level
(id = byte + 2, 0 = BOS, 1 = EOS) so token counts are byte counts.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.evaluate import perplexity

SPEC = ArchSpec.llama(hidden=64, vocab=260, layers=2, heads=4, kv_groups=2, ffn=96, head_dim=16, name="byte_tiny")


class ByteTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, None

    def encode(self, text: str) -> list[int]:
        return [b + 2 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 2 for i in ids if i >= 2).decode(errors="replace")


@pytest.fixture(scope="module")
def model(megatron_tp1):
    from autocompress_nemo.models.builder import build_model

    return build_model(SPEC, init_seed=3, impl="local")


def _fwd():
    from autocompress_nemo.models.builder import forward_logits

    return forward_logits


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _fwd()(model, torch.tensor([ids]))[0].double()
    return logits - logits.exp().sum(-1, keepdim=True).log()  # log-softmax by hand


def test_perplexity_matches_exp_mean_ce_by_hand(model) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 260, (3, 12), generator=g), torch.randint(2, 260, (2, 7), generator=g)]
    nll, n = 0.0, 0
    for b in batches:
        for row in b.tolist():
            lp = _logprobs(model, row)
            for t in range(len(row) - 1):
                nll -= float(lp[t, row[t + 1]])
                n += 1
    assert n == 3 * 11 + 2 * 6
    assert perplexity(model, _fwd(), batches) == pytest.approx(math.exp(nll / n), rel=1e-6)
    with pytest.raises(ValueError, match="T >= 2"):
        perplexity(model, _fwd(), [torch.zeros(2, 1, dtype=torch.long)])


DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Fire is", "choices": ["cold", "hot", "wet"], "answer": 1},
    {"question": "A cat says", "choices": ["woof", "meow"], "answer": 1},
    {"question": "Ice is", "choices": ["hot", "cold"], "answer": 1},
]
TEXTS = [{"text": "def f(x):\n    return x + 1\n"}, {"text": "import os\nprint(os.getcwd())\n"}]


def _write_tasks(tmp: Path) -> Path:
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tmp / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp / "text.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXTS))
    (tasks / "acn_tiny_mc.yaml").write_text(f"""task: acn_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (tasks / "acn_tiny_text.yaml").write_text(f"""task: acn_tiny_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / "text.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: byte_perplexity
""")
    return tasks


def test_lm_eval_adapter_scores_local_tasks(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from autocompress_nemo.evaluate import run_lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = run_lm_eval(
        model,
        _fwd(),
        ByteTokenizer(),
        ["acn_tiny_mc", "acn_tiny_text"],
        include_path=str(_write_tasks(tmp_path)),
        max_length=128,
        batch_size=4,
    )
    res = out["results"]

    # multiple choice by hand: log p(" " + choice | question) summed over the choice's bytes
    tok = ByteTokenizer()
    correct = 0
    for d in DOCS:
        scores = []
        for c in d["choices"]:
            ctx, cont = tok.encode(d["question"]), tok.encode(" " + c)
            lp = _logprobs(model, ctx + cont)
            scores.append(sum(float(lp[len(ctx) + i - 1, t]) for i, t in enumerate(cont)))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert res["acn_tiny_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))

    # rolling log-likelihood: each text predicted from BOS, i.e. perplexity of [BOS] + bytes
    seqs = [torch.tensor([[0] + tok.encode(t["text"])]) for t in TEXTS]
    assert res["acn_tiny_text"]["byte_perplexity,none"] == pytest.approx(perplexity(model, _fwd(), seqs), rel=1e-5)
    assert out["n_samples"]["acn_tiny_mc"]["effective"] == len(DOCS)


def test_rolling_windows_predict_every_token_once(model) -> None:
    from autocompress_nemo.evaluate import TorchLM

    lm = TorchLM(model, _fwd(), ByteTokenizer(), max_length=8)
    text = "abcdefghijklmnopqrstu"  # 21 bytes -> three windows of at most 8 predictions
    (ll,) = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text,))])
    ids = [0] + ByteTokenizer().encode(text)
    by_hand, L = 0.0, 8
    # lm-eval's windows (context_len=1, as its HF model): predicted spans [s, e) of up to L ids,
    # each from the L ids before its last prediction, so the last window gets full context
    for s in range(1, len(ids), L):
        e = min(s + L, len(ids))
        lo = max(0, e - 1 - L)
        lp = _logprobs(model, ids[lo : e - 1])
        by_hand += sum(float(lp[t - lo - 1, ids[t]]) for t in range(s, e))
    assert ll == pytest.approx(by_hand, rel=1e-5)


def test_generate_until_is_greedy_and_stops(model) -> None:
    from autocompress_nemo.evaluate import TorchLM

    tok = ByteTokenizer()
    lm = TorchLM(model, _fwd(), tok, max_length=64)
    ids = tok.encode("Hello")
    new = []
    for _ in range(6):
        nxt = int(_logprobs(model, ids + new)[-1].argmax())
        if nxt == tok.eos_token_id:
            break
        new.append(nxt)
    expected = tok.decode(new)
    (got,) = lm.generate_until([types.SimpleNamespace(args=("Hello", {"until": [], "max_gen_toks": 6}))])
    assert got == expected
    if len(expected) > 2:  # a stop string cuts the text before it
        stop = expected[2]
        (cut,) = lm.generate_until([types.SimpleNamespace(args=("Hello", {"until": [stop], "max_gen_toks": 6}))])
        assert cut == expected.split(stop)[0]


@pytest.mark.engine
def test_engine_check_llama_cpp_against_budget(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines import get_engine
    from autocompress_nemo.evaluate import engine_check

    target = compose(["target=tiny_cpu"]).target  # budget: decode_ms <= 0.6x the parent's
    vocab = 49152  # the GGUF writer copies SmolLM2's tokenizer, so the vocabulary is its size
    parent = ArchSpec.llama(hidden=64, vocab=vocab, layers=4, heads=4, kv_groups=2, ffn=256, name="p")
    student = ArchSpec.llama(hidden=64, vocab=vocab, layers=2, heads=4, kv_groups=2, ffn=128, name="s")
    engine = get_engine(target, tmp_path)
    parent_res = engine_check(parent, target, engine=engine)
    assert parent_res["checks"][0]["pass"] is None and "cannot resolve" in parent_res["checks"][0]["note"]

    class FakePredictor:  # stands in for costs.Predictor: only predict() and the table provenance are read
        estimated = False
        table = types.SimpleNamespace(provenance={"engine_version": "llama-cpp-python x", "device": "cpu"})

        def predict(self, spec):
            return {"decode_ms": 1.0, "prefill_ms": 2.0, "memory_bytes": 1e6, "estimated": False}

    res = engine_check(
        student, target, engine=engine, parent_measured=parent_res["measured"], predictor=FakePredictor()
    )
    assert res["source"].startswith("measured in llama-cpp-python") and " on " in res["source"]
    (row,) = res["checks"]
    assert row["checked_as"] == "decode_ms"
    assert row["budget"] == pytest.approx(0.6 * parent_res["measured"]["decode_ms"])
    assert row["pass"] == (res["measured"]["decode_ms"] <= row["budget"]) and res["pass"] == row["pass"]
    assert row["predicted"] == 1.0 and res["predicted"]["source"].startswith("predicted from the cost table")
    m = res["measured"]
    assert m["response_latency_ms"] == pytest.approx(m["prefill_ms"] + 8 * m["decode_ms"])
    assert m["memory"]["weights"] > 0 and m["memory"]["kv"] > 0
    err = res["prediction_error_pct"]["decode_ms"]
    assert err == pytest.approx(100 * (1.0 - m["decode_ms"]) / m["decode_ms"])


def test_engine_check_roofline_is_labelled_estimated() -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.costs.engines.roofline import RooflineEngine
    from autocompress_nemo.evaluate import engine_check

    target = compose(["target=b200_128k"]).target
    engine = RooflineEngine(_roofline_cfg(), target.hardware)
    spec = ArchSpec.llama(hidden=256, vocab=512, layers=2, heads=4, kv_groups=2, ffn=512, name="s")
    res = engine_check(
        spec,
        target,
        engine=engine,
        parent_measured={"decode_ms": 10.0, "response_latency_ms": 1e4, "memory_bytes": 1e12, "prefill_ms": 1e3},
    )
    assert res["source"].startswith("estimated, not measured")
    assert all(r["pass"] is not None for r in res["checks"])


def _roofline_cfg():
    from omegaconf import OmegaConf

    path = Path(__import__("autocompress_nemo").__file__).parent / "conf" / "engine" / "roofline.yaml"
    return OmegaConf.load(path)

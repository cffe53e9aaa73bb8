"""Parity with a reference nobody here wrote: the Megatron model built from SmolLM2-135M-Instruct's
GGUF against transformers' own LlamaForCausalLM loaded from the same GGUF (dequantized to float32
by transformers' GGUF loader, independently of ours).

Tolerances: logits are float32 sums over 576-1536 terms through 30 layers; reordering such sums
moves results by ~1e-6 relative (measured: 4e-5 absolute on logits of magnitude ~30), so the
check is 1e-5 relative to the largest logit. Perplexity must agree to 3 significant digits
(asserted as a relative difference below 1e-4, which implies it).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytestmark = pytest.mark.slow

SENTENCE = "The capital of France is Paris. It is known for the Eiffel Tower and its museums, and"


@pytest.fixture(scope="module")
def smollm2_pair(megatron_tp1, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    from autocompress_nemo.models.builder import build_model
    from autocompress_nemo.models.llama import hf_to_megatron, load_gguf

    spec, hf_sd, tok = load_gguf(smollm2_gguf)
    assert (spec.hidden, spec.num_layers, spec.vocab, spec.tied_embeddings) == (576, 30, 49152, True)
    model = build_model(spec)
    hf_to_megatron(spec, hf_sd, model)
    del hf_sd
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    return model, ref, tok


def _heldout_ids(tok, n: int = 512) -> torch.Tensor:
    path = os.path.join(os.path.dirname(json.__file__), "decoder.py")
    with open(path, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def _ppl(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits_BTV[0, :-1].double(), ids_BT[0, 1:], reduction="mean")
    return math.exp(nll.item())


def test_next_token_logits_match_transformers(smollm2_pair):
    from autocompress_nemo.models.builder import forward_logits

    model, ref, tok = smollm2_pair
    ids = tok(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        got = forward_logits(model, ids)
        want = ref(ids).logits.float()
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    same_argmax = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(
        f"\nSmolLM2 logits on {ids.shape[1]} tokens: max |megatron - transformers| = {diff:.3e} "
        f"(max |logit| {scale:.1f}, relative {diff / scale:.2e}); argmax agreement {same_argmax:.3f}"
    )
    assert diff / scale < 1e-5
    assert same_argmax == 1.0


def test_heldout_perplexity_matches_transformers(smollm2_pair):
    from autocompress_nemo.models.builder import forward_logits

    model, ref, tok = smollm2_pair
    ids = _heldout_ids(tok)
    with torch.no_grad():
        p_meg = _ppl(forward_logits(model, ids), ids)
        p_ref = _ppl(ref(ids).logits.float(), ids)
    print(
        f"\nSmolLM2 perplexity on json/decoder.py (first {ids.shape[1]} tokens): "
        f"megatron {p_meg:.6f}, transformers {p_ref:.6f} (3 s.f.: {p_meg:.3g} vs {p_ref:.3g})"
    )
    assert 1.0 < p_ref < 100.0, "a sane model of Python source"
    assert abs(p_meg - p_ref) / p_ref < 1e-4

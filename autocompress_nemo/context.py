"""What every stage of one run shares: the config, the process groups, the parent, the
tokenizer, the token data and Megatron models built from HF-named state dicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from autocompress_nemo.arch.spec import ArchSpec
from autocompress_nemo.stages.layout import Weights


class ByteTokenizer:
    """Bytes as tokens (ids ``b % vocab``): the tokenizer of random test models, which ship none."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.eos_token_id = vocab - 1
        self.fingerprint = f"bytes-mod-{vocab - 1}"

    def encode(self, text: str) -> list[int]:
        return [b % (self.vocab - 1) for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_hf(self) -> Any:
        """The same tokenizer as a transformers ``PreTrainedTokenizerFast`` (byte-level BPE without
        merges: byte ``b`` is id ``b``, the ids above 255 are special tokens, the last one EOS), so an
        exported directory carries it; None where ``vocab <= 256`` (``b % (vocab - 1)`` folds bytes
        together, which no Hugging Face tokenizer does)."""
        if self.vocab <= 257:
            return None
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars, extra = {}, 0
        for b in range(256):
            if b in printable:
                chars[b] = chr(b)
            else:
                chars[b] = chr(256 + extra)
                extra += 1
        vocab = {chars[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        specials = [f"<|byte_extra_{i}|>" for i in range(256, self.vocab - 1)] + ["<|endoftext|>"]
        tok.add_special_tokens(specials)
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


class Context:
    def __init__(self, cfg: DictConfig, say: Any = print):
        import logging
        import warnings

        # Megatron's deprecation chatter (GPTModel, tp_group) would bury the stage lines
        logging.getLogger("megatron").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\..*")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
        self.cfg = cfg
        self.say = say
        # what stage views of this context share: the parent and the corpus (by the config they
        # came from), whether the process groups are up
        self._shared: dict[Any, Any] = {"dist_ready": False}

    def for_stage(self, reads: tuple[str, ...]) -> Context:
        """This context as one stage sees it: a config holding only ``reads`` (and ``run_dir``), so
        a read of anything else fails (``stages/__init__.py``); loaded parents and corpora are shared."""
        view = Context(config_view(self.cfg, reads), self.say)
        view._shared = self._shared
        return view

    # -- process groups ----------------------------------------------------------------
    def init_distributed(self) -> None:
        if self._shared["dist_ready"]:
            return
        from autocompress_nemo.distributed import init_distributed

        c = self.cfg.cluster
        init_distributed(tp=int(c.tp), pp=int(c.pp), ep=int(c.ep), backend=str(c.backend), seed=int(self.cfg.seed))
        torch.manual_seed(int(self.cfg.seed))
        self._shared["dist_ready"] = True

    # -- parent ---------------------------------------------------------------------------
    @property
    def parent(self) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
        """(spec, HF-named float32 state dict, tokenizer). Random parents get their weights
        from the Megatron initialization with the run's seed."""
        key = ("parent", _key(self.cfg, "model", "seed"))
        if key not in self._shared:
            self._shared[key] = self._load_parent()
        return self._shared[key]

    def _load_parent(self) -> tuple[ArchSpec, dict[str, torch.Tensor], Any]:
        from autocompress_nemo.models.parent import load_parent

        spec, sd, tok = load_parent(self.cfg.model)
        if sd is None and not spec.is_dense_layered():  # MoE / Mamba hybrids: Nemotron-H / Qwen3-MoE names
            from autocompress_nemo.models.hybrid.state_dict import random_hf_state_dict as random_hybrid

            sd = random_hybrid(spec, seed=int(self.cfg.seed))
        if sd is None:
            from autocompress_nemo.models.llama.reference import random_hf_state_dict

            sd = random_hf_state_dict(spec, seed=int(self.cfg.seed))
        if tok is None:
            tok = ByteTokenizer(spec.vocab)
        return spec, sd, tok

    @property
    def tokenizer(self) -> Any:
        return self.parent[2]

    def parent_gguf(self) -> str | None:
        """The parent's GGUF file when it came as one (its tokenizer metadata is reused on export)."""
        from autocompress_nemo.models.parent import resolve_source_path

        p = resolve_source_path(self.cfg.model)
        return str(p) if p is not None and str(p).endswith(".gguf") else None

    # -- models ------------------------------------------------------------------------------
    def model(self, spec: ArchSpec, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A Megatron model of ``spec`` on this rank holding ``sd`` (sharded as the TP layout asks)."""
        from autocompress_nemo.models.builder import build_model
        from autocompress_nemo.models.hybrid.state_dict import hf_to_megatron

        self.init_distributed()
        model = build_model(
            spec, sequence_parallel=bool(self.cfg.cluster.sequence_parallel), init_seed=int(self.cfg.seed)
        )
        hf_to_megatron(spec, sd, model)
        return model

    @staticmethod
    def to_hf(spec: ArchSpec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The HF-named state dict of a Megatron model (collective over TP/EP)."""
        from autocompress_nemo.models.hybrid.state_dict import megatron_to_hf

        return megatron_to_hf(spec, model)

    def export_hf(self, spec: ArchSpec, sd: dict[str, torch.Tensor], out_dir: Path, engine: str | None = None) -> Any:
        """A Hugging Face directory: Llama / DeciLM ``block_configs`` for dense models, Nemotron-H
        (Puzzle per-block when heterogeneous) for hybrids, its config written the way ``engine``'s
        loader reads it (default: the target engine, ``target.engine.name``; see
        ``export/hf_config.py``), with the configuration / modeling code its ``auto_map`` names."""
        loader: Any = engine
        if engine is None:
            from autocompress_nemo.costs.engines import engine_class  # 0.3 s: not on the command line's start

            name = str(OmegaConf.select(self.cfg, "target.engine.name", default="") or "")
            loader = engine_class(name).hf_loader if name else ""
        from autocompress_nemo.models.hf_dir import hf_tokenizer

        if spec.is_dense_layered():
            from autocompress_nemo.models.llama.hf_io import export_hf
        else:
            from autocompress_nemo.models.nemotron_h import export_hf
        return export_hf(spec, sd, out_dir, tokenizer=hf_tokenizer(self.tokenizer), engine=loader)

    @staticmethod
    def forward(model: torch.nn.Module, input_ids_BT: torch.Tensor) -> torch.Tensor:
        from autocompress_nemo.models.builder import forward_logits

        return forward_logits(model, input_ids_BT)

    # -- data -----------------------------------------------------------------------------------
    @property
    def data(self) -> Any:
        key = ("data", _key(self.cfg, "data", "model", "seed"))
        if key not in self._shared:
            from autocompress_nemo.data import build_corpus
            from autocompress_nemo.pipeline import cache_dir

            self._shared[key] = build_corpus(self.cfg.data, self.tokenizer, cache_dir=cache_dir(self.cfg) / "tokens")
        return self._shared[key]

    def _packed(self, split: str, seq_len: int) -> Any:
        key = ("packed", _key(self.cfg, "data", "model", "seed"), split, seq_len)
        if key not in self._shared:
            self._shared[key] = self.data.heldout(seq_len) if split == "heldout" else self.data.train(seq_len)
        return self._shared[key]

    def batch_at(self, split: str, step: int, batch: int, seq_len: int, seed_offset: int = 0) -> torch.Tensor:
        """Deterministic batch ``step`` of ``split`` (``train``/``calib`` read the training documents
        in different seeded orders; the same on every rank): ``[batch, seq_len]`` token ids."""
        ds = self._packed("train" if split == "calib" else split, seq_len)
        seed = int(self.cfg.data.seed) + seed_offset + (7919 if split == "calib" else 0)
        idx = ds.batch_indices(step, batch, seed)
        return torch.from_numpy(ds.sequences(idx)[:, :-1].copy())

    def heldout_batches(self, batch: int, seq_len: int, max_batches: int) -> list[torch.Tensor]:
        """The first held-out sequences in document order (no shuffling: every model sees the same text)."""
        ds = self._packed("heldout", seq_len)
        n = min(len(ds) // batch, max_batches)
        if n == 0:
            raise ValueError(f"held-out text has {len(ds)} sequences of {seq_len} tokens: not one batch of {batch}")
        return [torch.from_numpy(ds.sequences(range(i * batch, (i + 1) * batch))[:, :-1].copy()) for i in range(n)]


# -- config views -------------------------------------------------------------------------------
def _key(cfg: DictConfig, *keys: str) -> str:
    from autocompress_nemo.utils.artifacts import hash_obj

    missing = object()
    vals = {k: OmegaConf.select(cfg, k, default=missing) for k in keys}
    for k, v in vals.items():
        if v is missing:
            raise KeyError(f"{k!r} is not in this stage's config: declare it in the stage's reads (stages/)")
    return hash_obj({k: _plain(v) for k, v in vals.items()})


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def config_view(cfg: DictConfig, reads: tuple[str, ...]) -> DictConfig:
    """A read-only copy of ``cfg`` holding only the dotted keys ``reads`` (and ``run_dir``):
    reading any other key raises. Interpolations are resolved against the full config first."""
    from omegaconf.errors import ConfigKeyError

    from autocompress_nemo.stages.declare import ALWAYS

    out = OmegaConf.create({})
    for k in (*reads, *ALWAYS):
        parent, _, leaf = k.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if k in ALWAYS and k not in reads and (node is None or leaf not in node):
            continue  # where the run lives: a config without it (a hand-made one) has none
        if node is None or leaf not in node:
            raise ConfigKeyError(f"a stage declares it reads {k!r}, which the config does not have")
        OmegaConf.update(out, k, _plain(OmegaConf.select(cfg, k)), merge=False, force_add=True)
    OmegaConf.set_struct(out, True)
    OmegaConf.set_readonly(out, True)
    return out


# -- state dict / spec files ---------------------------------------------------------------------
def save_weights(path: Path, spec: ArchSpec, sd: dict[str, torch.Tensor]) -> None:
    w = Weights(path)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(w.weights))
    w.spec.write_text(spec.to_json())


def load_weights(path: Path) -> tuple[ArchSpec, dict[str, torch.Tensor]]:
    w = Weights(path)
    return ArchSpec.from_json(w.spec.read_text()), load_file(str(w.weights))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())

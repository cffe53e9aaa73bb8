"""``python -m autocompress_nemo.pretrain [model=stdlib_hybrid] [overrides]`` / ``autocompress-pretrain``:
build a parent the project pretrains itself (``model.source.kind=pretrained``) into the parent cache.

The overrides are the run config's (Hydra syntax, composed from ``conf/`` like every other command);
the model defaults to ``stdlib_hybrid``. A parent already built is not trained again; a killed run
started again resumes from its latest checkpoint. Bad input exits with status 2 and one message.
``--cfg job`` prints the composed config.
"""

from __future__ import annotations

import functools
import sys

HELP = (
    "autocompress-pretrain (python -m autocompress_nemo.pretrain): pretrains a parent whose "
    "model.source.kind is pretrained (default model=stdlib_hybrid) with the project's Megatron training "
    "loop until its held-out perplexity stops falling quickly, and writes it as a Hugging Face Nemotron-H "
    "directory to ~/.cache/autocompress-nemo/parents/<name>-<key>/ (or model.source.path=<dir>); "
    "then model=<name> finds it in every command. Resumes when restarted. Recipe: model.source.pretrain "
    "(docs/hybrid_parent.md).\n\n"
    "Usage: python -m autocompress_nemo.pretrain [model=stdlib_hybrid] [model.source.pretrain.<entry>=...] "
    "[model.<field>=...] [--cfg job]"
)


def main() -> None:
    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.config.validate import ConfigError, validate

    args = sys.argv[1:]
    if any(a in ("--help", "-h") for a in args):
        print(HELP)
        return
    show = "--cfg" in args
    if show:  # --cfg job (or --cfg all): print the composed config only
        i = args.index("--cfg")
        args = args[:i] + args[i + 2 :]
    if not any(a.lstrip("+").startswith("model=") for a in args):
        args = ["model=stdlib_hybrid", *args]
    try:
        cfg = compose(args)
        if show:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg, resolve=True))
            return
        validate(cfg, building_parent=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from autocompress_nemo.pretrain.run import PretrainError, pretrain

    try:
        pretrain(cfg, say=functools.partial(print, flush=True))
    except PretrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

"""``python -m autocompress_nemo.distill``: the pipeline's recovery-distillation stage on its own.

    python -m autocompress_nemo.distill +target=cpu_chat distill=quick

Runs ``python -m autocompress_nemo.search stages=[distill] ...``: the stages distillation
needs (profile, rank, search, extract) are reused when their artifacts are complete and
computed otherwise; a killed distillation resumes from ``<run_dir>/distill_<method>.ckpt``.
The recovery itself is ``autocompress_nemo.distill.recover.distill``.
"""

from __future__ import annotations

import sys


def with_stages(argv: list[str], stages: str) -> list[str]:
    """``argv`` with ``stages=<stages>`` added unless the user already chose stages."""
    if any(a.lstrip("+").startswith("stages=") for a in argv[1:]):
        return argv
    return [*argv, f"stages={stages}"]


def main() -> None:
    from autocompress_nemo.search.__main__ import main as pipeline_main

    sys.argv = with_stages(sys.argv, "[distill]")
    pipeline_main()


if __name__ == "__main__":
    main()

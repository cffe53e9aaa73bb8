"""``python -m autocompress_nemo.evaluate``: the pipeline's evaluation stage on its own.

    python -m autocompress_nemo.evaluate +target=cpu_chat

Runs ``python -m autocompress_nemo.search stages=[distill,evaluate] ...``: the recovered
students (and the stages before them, reused when complete) are scored — held-out
perplexity, the configured lm-eval tasks, costs measured in the target's engine against each
budget — and ``report.md`` / ``report.json`` are written in the run directory.
"""

from __future__ import annotations

import sys


def main() -> None:
    from autocompress_nemo.distill.__main__ import with_stages
    from autocompress_nemo.search.__main__ import main as pipeline_main

    sys.argv = with_stages(sys.argv, "[distill,evaluate]")
    pipeline_main()


if __name__ == "__main__":
    main()

"""``python -m autocompress_nemo.evaluate`` / ``autocompress-evaluate``: the pipeline's evaluation stage.

    python -m autocompress_nemo.evaluate +target=cpu_chat

Runs every stage (evaluate reads them all: the table and its validation, the extracted, recovered
and exported students), reusing each complete artifact (:mod:`autocompress_nemo.cli`). The students
are scored — held-out perplexity in PyTorch and on the exported file, the configured lm-eval tasks,
costs measured in the target's engine against each budget — and ``report.md`` / ``report.json`` are
written in the run directory.
"""

from autocompress_nemo.cli import evaluate_main as main

if __name__ == "__main__":
    main()

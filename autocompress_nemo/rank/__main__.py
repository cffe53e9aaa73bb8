"""``python -m autocompress_nemo.rank`` / ``autocompress-rank``: the pipeline's rank stage on its own.

    python -m autocompress_nemo.rank +target=cpu_chat model=smollm2_135m

Runs ``python -m autocompress_nemo.search stages=[rank] ...`` (:mod:`autocompress_nemo.cli`): the
importance-sorted parent lands in ``<run_dir>/rank`` with the manifest and config hash the full
pipeline checks, so a later full run reuses it.
"""

from autocompress_nemo.cli import rank_main as main

if __name__ == "__main__":
    main()

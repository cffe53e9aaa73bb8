"""``python -m autocompress_nemo.export`` / ``autocompress-export``: the pipeline's export stage on its own.

    python -m autocompress_nemo.export +target=cpu_chat distill=quick

Runs ``python -m autocompress_nemo.search stages=[profile,validate,rank,search,extract,distill,export] ...``
(:mod:`autocompress_nemo.cli`): the recovered student (and what it reads, reused when complete) is
written in the target engine's format with its parity check into ``<run_dir>/export_<method>``.
"""

from autocompress_nemo.cli import export_main as main

if __name__ == "__main__":
    main()

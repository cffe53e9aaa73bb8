"""``python -m autocompress_nemo.extract`` / ``autocompress-extract``: the pipeline's extract stage on its own.

    python -m autocompress_nemo.extract +target=cpu_chat search=quick

Runs ``python -m autocompress_nemo.search stages=[profile,validate,rank,search,extract] ...``
(:mod:`autocompress_nemo.cli`): the stages the sliced student reads are reused when complete and
computed otherwise; the student lands in ``<run_dir>/extract_<method>``, where the full pipeline
looks for it.
"""

from autocompress_nemo.cli import extract_main as main

if __name__ == "__main__":
    main()

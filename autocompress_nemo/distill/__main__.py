"""``python -m autocompress_nemo.distill`` / ``autocompress-distill``: the pipeline's recovery-distillation stage on its own.

    python -m autocompress_nemo.distill +target=cpu_chat distill=quick

Runs ``python -m autocompress_nemo.search stages=[profile,validate,rank,search,extract,distill] ...``
(:mod:`autocompress_nemo.cli`): the stages distillation needs are reused when their artifacts are
complete and computed otherwise; a killed distillation resumes from ``<run_dir>/distill_<method>.ckpt``.
The recovery itself is ``autocompress_nemo.distill.recover.distill``.
"""

from autocompress_nemo.cli import distill_main as main

if __name__ == "__main__":
    main()

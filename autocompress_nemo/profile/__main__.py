"""``python -m autocompress_nemo.profile`` / ``autocompress-profile``: build (or reuse) the target's cost table; validate it.

    python -m autocompress_nemo.profile +target=cpu_chat                 # stages=[profile]
    python -m autocompress_nemo.profile validate +target=cpu_chat        # stages=[profile,validate]
    python -m autocompress_nemo.profile +target=cpu_chat mode=validate   # the same, as an override

The pipeline restricted to these stages (:mod:`autocompress_nemo.cli`), so the artifacts are the
ones a full run reuses: the table in ``<run_dir>/profile/cost_table/cost_table.json``, the validation
(predicted vs measured CSV/JSON and a PNG scatter plot) in ``<run_dir>/validate/validation/``.
``validate`` / ``mode=validate`` is taken off the command line before Hydra composes the config.
"""

from autocompress_nemo.cli import profile_main as main

if __name__ == "__main__":
    main()

"""``python -m autocompress_nemo.profile``: build (or reuse) the target's cost table; validate it.

    python -m autocompress_nemo.profile +target=cpu_chat                 # build or reuse the table
    python -m autocompress_nemo.profile validate +target=cpu_chat        # + measure >= 12 full models
    python -m autocompress_nemo.profile +target=cpu_chat mode=validate   # the same, as an override

The table goes to ``<run_dir>/profile/cost_table/cost_table.json``; validation (predicted vs
measured CSV/JSON and a PNG scatter plot) to ``<run_dir>/profile/validation/``.
``validate`` / ``mode=validate`` is taken off the command line before Hydra composes the config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from autocompress_nemo.config.entry import hydra_entry
from autocompress_nemo.profile.stage import run_profile, run_validate

_VALIDATE_ARGS = ("validate", "mode=validate", "+mode=validate", "++mode=validate")


def _take_validate_flag() -> bool:
    found = any(a in _VALIDATE_ARGS for a in sys.argv[1:])
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in _VALIDATE_ARGS)]
    return found


VALIDATE = _take_validate_flag() if __name__ == "__main__" else False


def profile(cfg: DictConfig) -> dict[str, Any]:
    out = Path(cfg.run_dir) / "profile"
    table = run_profile(cfg, out)
    result: dict[str, Any] = {"table": str(table)}
    if VALIDATE:
        result["validation"] = run_validate(cfg, table, out)
    print(json.dumps(result, indent=1, default=str))
    return result


main = hydra_entry(profile)

if __name__ == "__main__":
    main()

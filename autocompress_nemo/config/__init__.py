"""Typed Hydra configuration: schema, composition, validation and derived values.

- ``schema``   — the structured-config dataclasses (``RunConfig`` and its sections);
- ``store``    — their registration in Hydra's ConfigStore (``run_schema``);
- ``entry``    — ``compose(overrides)`` and ``hydra_entry(task_fn)`` for stage ``__main__``s;
- ``validate`` — ``validate(cfg)``: every problem at once, as one ``ConfigError``;
- ``resolve``  — derived values: budgets, the model's weight file, world size, dtype sizes.
"""

from autocompress_nemo.config.validate import ConfigError, validate

__all__ = ["ConfigError", "validate"]

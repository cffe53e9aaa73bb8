"""Register the typed schema in Hydra's ConfigStore.

``run.yaml`` starts its defaults list with ``run_schema`` (the :class:`RunConfig` dataclass),
so every group merged below it — ``model``, ``target`` (and the ``hardware``, ``engine``,
``workload``, ``budget`` it composes), ``search``, ``distill``, ``data``, ``cluster`` — is
checked against its dataclass: an unknown key or a value of the wrong type is an error at
composition time. Struct mode stays on; nothing here switches it off.

One registration covers every section: ``RunConfig`` nests ``ModelConfig``, ``TargetConfig``
(with ``HardwareConfig``, ``EngineConfig``, ``WorkloadConfig``, ``BudgetConfig``),
``SearchConfig``, ``DistillConfig``, ``DataConfig`` and ``ClusterConfig``, and Hydra merges each
group's yaml into its typed node. (Storing the sections again as groups of their own would
list them as choices in ``--help`` and in "available options" messages.)
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from autocompress_nemo.config.schema import RunConfig

RUN_SCHEMA = "run_schema"
_registered = False


def register_configs() -> None:
    """Store ``run_schema`` and register the config resolvers (idempotent)."""
    global _registered
    from autocompress_nemo.config.own_model import register_resolvers

    register_resolvers()
    if _registered:
        return
    ConfigStore.instance().store(name=RUN_SCHEMA, node=RunConfig)
    _registered = True

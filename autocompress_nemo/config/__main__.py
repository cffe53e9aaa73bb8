"""``python -m autocompress_nemo.config [overrides]``: compose, validate and show a run config.

Prints the composed config, then the derived values every stage will use (parsed budgets,
the model's weight file, the world size, the parent's parameter counts). Exit status 2 with
one message when the config is invalid. Runs no stage.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from autocompress_nemo.config import resolve
from autocompress_nemo.config.entry import hydra_entry


@hydra_entry
def main(cfg: DictConfig) -> None:
    from autocompress_nemo.arch.counts import active_param_count, kv_bytes_per_token, param_count
    from autocompress_nemo.arch.from_config import spec_from_model_config

    print(OmegaConf.to_yaml(cfg, resolve=True))
    spec = spec_from_model_config(cfg.model)
    kv_bytes = resolve.dtype_bytes(cfg.target.engine.kv_dtype)
    print("# derived")
    print(f"model: {cfg.model.name}  blocks: {spec.pattern}")
    print(
        f"parameters: {param_count(spec):,}  active: {active_param_count(spec):,}  "
        f"KV bytes/token ({cfg.target.engine.kv_dtype}): {kv_bytes_per_token(spec, kv_bytes):,.0f}"
    )
    path = resolve.model_file(cfg.model) if not cfg.dry_run else None
    print(f"weights: {path if path else cfg.model.source.kind}")
    for b in resolve.budgets(cfg.target):
        what = f"{b.relative}x the parent's" if b.is_relative else f"{b.absolute:,.6g} {b.info.unit}"
        print(f"budget: {b.metric} <= {what}" if b.info.lower_is_better else f"budget: {b.metric} >= {what}")
    print(f"world size: {resolve.world_size(cfg.cluster)}  data parallel: {resolve.data_parallel_size(cfg.cluster)}")


if __name__ == "__main__":
    main()

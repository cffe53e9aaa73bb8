"""Progress of a distillation run: tqdm bar, TensorBoard, Weights & Biases — rank 0 only.

The bar shows step / total, ETA (tqdm's own estimate from this session's rate), loss,
tokens/s and the learning rate. TensorBoard scalars go to ``<out_dir>/tensorboard``; a
resumed run purges events past its start step so curves are not doubled. W&B is imported
only when ``cfg.wandb_project`` is set; the run id is kept in ``<out_dir>/wandb_run_id``
so a resumed job continues the same W&B run.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from autocompress_nemo.distill.optim import opt_field


def _config_dict(cfg: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)  # type: ignore[arg-type]
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - any mapping-like config
        return dict(cfg) if hasattr(cfg, "items") else {}


class Monitor:
    def __init__(
        self, out_dir: Path, cfg: Any, total_steps: int, start_step: int, enabled: bool, name: str = "distill"
    ) -> None:
        self.enabled, self.name = enabled, name
        self.log_every = max(1, int(opt_field(cfg, "log_every", 10)))
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar: Any = None
        self.tb: Any = None
        self.wandb: Any = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=name,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=1.0,
        )
        from torch.utils.tensorboard import SummaryWriter

        self.tb_dir = out_dir / "tensorboard"
        self.tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=start_step if start_step else None)
        project = str(opt_field(cfg, "wandb_project", "") or "")
        if project:
            self.wandb = _wandb_init(project, out_dir, name, _config_dict(cfg))

    @property
    def tokens_per_s(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def update(self, row: dict[str, Any], tokens: int) -> None:
        """One finished step; ``row`` holds step, loss, kd, hidden, lr, grad_norm, tokens."""
        self.tokens += tokens
        if not self.enabled:
            return
        tps = self.tokens_per_s
        assert self.bar is not None
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{tps:.0f}", lr=f"{row['lr']:.2e}", refresh=False)
        self.bar.update(1)
        step = int(row["step"]) + 1
        if step % self.log_every == 0 or step == self.bar.total:
            scalars = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}
            scalars["tokens_per_s"] = tps
            for k, v in scalars.items():
                self.tb.add_scalar(f"{self.name}/{k}", v, step)
            if self.wandb is not None:
                self.wandb.log({f"{self.name}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_init(project: str, out_dir: Path, name: str, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            f"distill.wandb_project={project!r} is set but wandb is not installed: `pip install wandb`, "
            "or set distill.wandb_project='' to log to TensorBoard only"
        ) from None
    id_file = out_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id)
    return wandb.init(project=project, id=run_id, resume="allow", dir=str(out_dir), name=name, config=config)

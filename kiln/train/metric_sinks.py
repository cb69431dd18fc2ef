"""Where metric rows go besides metrics.jsonl: TensorBoard and Weights & Biases (offline).

Both are fed the same rows as metrics.jsonl, in the batches the trainer fetches them in (every
`metrics.log_every` steps), so neither adds a host sync to the step. Numbers become scalars named
`KIND/KEY` (e.g. `train/loss`, `eval/val_loss`) at the row's step; the `run` row becomes the W&B
run's config. W&B runs offline only (`wandb sync RUN_DIR/wandb/offline-run-*` uploads later):
kiln never opens a network connection on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

SKIP_KEYS = ("step", "time", "kind")


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in SKIP_KEYS}


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        kind, step = row.get("kind"), row.get("step", 0)
        for key, value in _scalars(row).items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="kiln", name=run_dir.name,
                              settings=wandb.Settings(console="off", silent=True))
        self.step = -1

    def write(self, row: dict[str, Any]) -> None:
        kind, step = row.get("kind"), int(row.get("step", 0))
        if kind == "run":
            self.run.config.update({k: v for k, v in row.items() if k not in SKIP_KEYS}, allow_val_change=True)
            return
        values = {f"{kind}/{k}": v for k, v in _scalars(row).items()}
        if values:  # W&B steps only move forward; a resumed run's rows start where it left off
            self.step = max(self.step, step)
            self.run.log(values, step=self.step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg, run_dir: Path, say: Callable[[str], None]) -> list:
    """The sinks `[metrics]` asks for; a missing package is said once and skipped, never fatal."""
    sinks: list = []
    if cfg.tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        except ImportError:
            say("tensorboard is not installed (pip install tensorboard); metrics.tensorboard ignored")
    if cfg.wandb:
        try:
            sinks.append(WandbSink(run_dir))
        except ImportError:
            say("wandb is not installed (pip install 'kiln-lm[wandb]'); metrics.wandb ignored")
    return sinks

"""Learning-rate schedules: linear warmup, then cosine / linear / step / wsd / constant / plateau.

`lr_factor` is the pure closed form (a multiplier of the peak lr at a step); `LRSchedule` applies
it to an optimizer's param groups as `base_lr * group["lr_scale"] * factor`, so groups that run at
a fixed fraction of the main lr (muon's AdamW part) follow the same curve.

Steps count from 0: the lr of training step `s` is set before that step runs. Warmup uses
(step + 1) / warmup_steps so the first step does not waste a batch at lr 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.config import ScheduleConfig
from kiln.errors import ConfigError

SCHEDULES = ("cosine", "linear", "step", "wsd", "constant", "plateau")


def lr_factor(name: str, step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based) for schedule `name`, in [0, 1].

    `plateau` returns the warmup-then-constant part; its decays come from `LRSchedule.observe`.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"schedule.name={name!r} is not one of {', '.join(SCHEDULES)}")
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if name in ("constant", "plateau"):
        return 1.0
    if name == "step":
        return cfg.gamma ** ((step - warmup) // cfg.step_size)
    floor = cfg.min_lr_ratio
    if name == "wsd":
        # Stable at the peak, then the last decay_fraction of all steps decays linearly (MiniCPM).
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - floor) * progress  # linear


class LRSchedule:
    """Sets every param group's lr each step; call `step()` after each `optimizer.step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, base_lr: float,
                 total_steps: int):
        if cfg.name not in SCHEDULES:
            raise ConfigError(f"schedule.name={cfg.name!r} is not one of {', '.join(SCHEDULES)}")
        if total_steps <= 0:
            raise ConfigError(f"train.steps={total_steps} must be > 0 for an lr schedule")
        if base_lr <= 0:
            raise ConfigError(f"optim.lr={base_lr} must be > 0")
        self.optimizer = optimizer
        self.cfg = cfg
        self.base_lr = float(base_lr)
        self.total_steps = int(total_steps)
        self.step_count = 0
        # Plateau state: product of the decays so far, best loss seen, evaluations since it.
        self.plateau_scale = 1.0
        self.best_loss = math.inf
        self.bad_evals = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The current lr before any per-group lr_scale."""
        factor = lr_factor(self.cfg.name, self.step_count, self.cfg, self.total_steps)
        return self.base_lr * factor * self.plateau_scale

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def observe(self, val_loss: float) -> bool:
        """Feed an evaluation loss; for `plateau`, decay the lr by gamma after `plateau_patience`
        evaluations in a row without a relative improvement over the best of more than
        `plateau_threshold`. Returns True when it decayed. Other schedules ignore it."""
        if self.cfg.name != "plateau":
            return False
        val_loss = float(val_loss)
        # NaN compares False, so a non-finite loss counts as no improvement.
        if self.best_loss == math.inf and math.isfinite(val_loss):
            improved = True
        else:
            improved = val_loss < self.best_loss - self.cfg.plateau_threshold * abs(self.best_loss)
        if improved:
            self.best_loss = val_loss
            self.bad_evals = 0
            return False
        self.bad_evals += 1
        if self.bad_evals < self.cfg.plateau_patience:
            return False
        self.plateau_scale *= self.cfg.gamma
        self.bad_evals = 0
        self._apply()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "plateau_scale": self.plateau_scale,
            "best_loss": self.best_loss,
            "bad_evals": self.bad_evals,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"step", "plateau_scale", "best_loss", "bad_evals"} - set(state)
        if missing:
            raise ConfigError(f"lr schedule state is missing {sorted(missing)}; is it from another kiln version?")
        self.step_count = int(state["step"])
        self.plateau_scale = float(state["plateau_scale"])
        self.best_loss = float(state["best_loss"])
        self.bad_evals = int(state["bad_evals"])
        self._apply()

    def _apply(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            value = lr * group.get("lr_scale", 1.0)
            if isinstance(group["lr"], torch.Tensor):  # tensor lr (capturable/fused): keep the object
                group["lr"].fill_(value)
            else:
                group["lr"] = value

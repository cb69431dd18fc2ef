"""Learning-rate schedules: linear warmup, then cosine / linear / step / wsd / constant / plateau.

`lr_factor` is the pure closed form (a multiplier of the peak lr at a step); `LRSchedule` applies
it to an optimizer's param groups as `group["initial_lr"] * factor` (torch's convention: the peak
lr per group lives in `initial_lr`, which `build_optimizer` sets), so groups with their own peak
(muon's AdamW part) follow the same curve. `LRSchedule` is the only writer of `group["lr"]`; the
schedule names (`SCHEDULES`) and ranges are kiln.config's, checked once when the config loads.

Steps count from 0: the lr of training step `s` is set before that step runs. Warmup uses
(step + 1) / warmup_steps so the first step does not waste a batch at lr 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.config import SCHEDULES, ScheduleConfig
from kiln.errors import KilnError

__all__ = ["SCHEDULES", "LRSchedule", "lr_factor"]


def lr_factor(name: str, step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based) for schedule `name`, in [0, 1].

    `plateau` returns the warmup-then-constant part; its decays come from `LRSchedule.observe`.
    """
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
    if name == "linear":
        return 1.0 - (1.0 - floor) * progress
    raise ValueError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}; validate the config first")


class LRSchedule:
    """Sets every param group's lr each step from its `initial_lr`; call `step()` after each
    `optimizer.step()`. Groups without `initial_lr` get their current lr as it, as torch's
    LRScheduler does on its first use."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int):
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", float(group["lr"]))
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.step_count = 0
        # Plateau state: product of the decays so far, best loss seen, evaluations since it.
        self.plateau_scale = 1.0
        self.best_loss = math.inf
        self.bad_evals = 0
        self._apply()

    @property
    def factor(self) -> float:
        """The current multiplier of every group's `initial_lr` (schedule and plateau decays)."""
        return lr_factor(self.cfg.name, self.step_count, self.cfg, self.total_steps) * self.plateau_scale

    @property
    def lr(self) -> float:
        """The current lr of the first param group (optim.lr's curve for kiln's optimizers)."""
        return float(self.optimizer.param_groups[0]["initial_lr"]) * self.factor

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
            raise KilnError(f"lr schedule state is missing {sorted(missing)}; is it from another kiln version?")
        self.step_count = int(state["step"])
        self.plateau_scale = float(state["plateau_scale"])
        self.best_loss = float(state["best_loss"])
        self.bad_evals = int(state["bad_evals"])
        self._apply()

    def _apply(self) -> None:
        factor = self.factor
        for i, group in enumerate(self.optimizer.param_groups):
            if "initial_lr" not in group:  # an optimizer state loaded from an older checkpoint
                raise KilnError(f"optimizer param group {i} has no initial_lr; the checkpoint is from an "
                                f"older kiln (before the peak lr moved to initial_lr)")
            value = float(group["initial_lr"]) * factor
            if isinstance(group["lr"], torch.Tensor):  # tensor lr (capturable/fused): keep the object
                group["lr"].fill_(value)
            else:
                group["lr"] = value

"""Checkpoints with torch.distributed.checkpoint (DCP): the only writer of training state.

Everything that must survive a crash is Stateful (state_dict / load_state_dict) and saved as one
dict. DCP writes each rank's shards in parallel and can load into a different sharding later.
A checkpoint is written to `checkpoints/.step-N.tmp` and renamed to `step-N` once complete, so
a crash mid-save never leaves a checkpoint that looks whole; the newest K are kept.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from kiln.errors import KilnError

# DCP warns on every single-process save/load that it "assumes" single-process intent; we pass
# no_dist explicitly, so the warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_DIR = re.compile(r"^step-(\d+)$")
# A checkpoint holding model weights only (written by `kiln import-hf`): resuming from it loads the
# weights and starts the optimizer, schedule, data position and counters fresh.
WEIGHTS_ONLY_MARKER = "weights-only.json"


class ModelOptimizerState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (FQN-keyed, sharding-aware)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))


class RNGState(Stateful):
    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_last: int = 2, is_main: bool = True):
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.is_main = is_main

    def latest_step(self) -> int | None:
        found = list_checkpoints(self.dir)
        return found[-1][0] if found else None

    def save(self, step: int, states: dict[str, Any], extra_files: dict[str, str] | None = None) -> tuple[Path, float]:
        t0 = time.perf_counter()
        final = self.dir / f"step-{step}"
        tmp = self.dir / f".step-{step}.tmp"
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        dcp.save(states, checkpoint_id=str(tmp), no_dist=not _distributed())
        if self.is_main:
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.dir)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final, time.perf_counter() - t0

    def load(self, states: dict[str, Any], step: int | None = None) -> int:
        found = dict(list_checkpoints(self.dir))
        if not found:
            raise KilnError(f"{self.dir}: no checkpoint to load (expected step-N directories)")
        step = max(found) if step is None else step
        if step not in found:
            raise KilnError(f"{self.dir}: no checkpoint for step {step}; have {sorted(found)}")
        dcp.load(states, checkpoint_id=str(found[step]), no_dist=not _distributed())
        return step


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()

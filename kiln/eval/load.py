"""Load a trained run (config, tokenizer, model weights from a checkpoint) for eval/generate/export."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState, list_checkpoints
from kiln.config import JobConfig, load_config
from kiln.data.raw_to_shards import TOKENIZER_FILE
from kiln.data.tokenizer import Tokenizer, load_tokenizer
from kiln.errors import KilnError
from kiln.model.transformer import Transformer


@dataclass
class LoadedRun:
    model: nn.Module
    tokenizer: Tokenizer
    config: JobConfig
    step: int
    run_dir: Path


def read_trained_run(run_dir: Path) -> tuple[JobConfig, Tokenizer]:
    """The resolved config and tokenizer of a run directory that has checkpoints, or one line
    saying what is missing (every command that opens a trained run goes through here)."""
    if not run_dir.is_dir():
        raise KilnError(f"run directory {run_dir} not found")
    if not list_checkpoints(run_dir / "checkpoints"):
        raise KilnError(f"{run_dir} has no checkpoints (expected {run_dir}/checkpoints/step-N); train it first")
    if not (run_dir / "config.toml").is_file():
        raise KilnError(f"{run_dir} has no config.toml; is it a kiln run directory?")
    cfg = load_config(run_dir / "config.toml")
    tokenizer = load_tokenizer(run_dir / TOKENIZER_FILE)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    return cfg, tokenizer


def load_run(run_dir: str | Path, step: int | None = None, device: str = "cpu") -> LoadedRun:
    run_dir = Path(run_dir)
    cfg, tokenizer = read_trained_run(run_dir)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    model.init_weights()  # also fills the RoPE tables; the weights are overwritten next
    step = CheckpointManager(run_dir / "checkpoints").load({"app": ModelOptimizerState(model)}, step)
    model.eval()
    return LoadedRun(model, tokenizer, cfg, step, run_dir)

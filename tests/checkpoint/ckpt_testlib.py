"""Shared helpers for the checkpoint tests: one tiny trained run, copied per test."""

import json
import shutil
from pathlib import Path

from kiln.config import load_config
from kiln.train.trainer import train

from conftest import tiny_overrides

# 4 steps, a checkpoint every 2: checkpoints/step-2 and step-4, both complete.
RUN = {"train.steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 3, "train.eval_every": 0,
       "metrics.progress": "none", "metrics.peak_flops": 1e12}


def make_run(root: Path, text_file: Path, **extra) -> Path:
    run = root / "run"
    train(load_config(None, tiny_overrides(text_file, **{**RUN, **extra})), run)
    return run


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rows(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def distcp_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("*.distcp"))

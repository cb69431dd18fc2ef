"""The run directory's own files (config.toml, tokenizer.json, metrics.jsonl) around a train start.

Two rules keep a run usable after a failed command:

* `check_resume_settings` runs before anything is written: a resumed run keeps the [model] and
  [data] settings its checkpoint was trained with, so a conflicting `--set model.dim=...` fails in
  one line naming the key, instead of overwriting config.toml and then failing to load the weights.
* `write_run_files` runs only once the model is built and the checkpoint (if any) loaded, and
  writes through `kiln.io`, so a command that fails before training starts leaves the files of the
  run that was there unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kiln.config import JobConfig, load_config, to_toml
from kiln.data.raw_to_shards import TOKENIZER_FILE
from kiln.errors import KilnError
from kiln.io import atomic_path, atomic_write_text

CONFIG_FILE = "config.toml"

# Settings a resumed run may change: they shape neither the weights nor the token stream
# (fused_projections: the same parameters and function, saved resolved for the device it ran on).
RESUMABLE = {"model.name", "model.dropout", "model.init", "model.init_std", "model.fused_projections",
             "data.seq_len", "data.prefetch", "data.shards_dir"}


def saved_config_path(run_dir: Path, step: int) -> Path | None:
    """The config the checkpoint of `step` was saved with, else the run's config.toml, else None."""
    for path in (run_dir / "checkpoints" / f"step-{step}" / CONFIG_FILE, run_dir / CONFIG_FILE):
        if path.is_file():
            return path
    return None


def check_resume_settings(cfg: JobConfig, run_dir: Path, step: int) -> None:
    """Raise KilnError naming the first [model]/[data] key where `cfg` differs from the run's saved
    config (a requested model.vocab_size of 0 means 'from the tokenizer' and matches any)."""
    path = saved_config_path(run_dir, step)
    if path is None:
        return
    saved = load_config(path).to_dict()  # parsed and validated like any config: the file may be damaged
    wanted = cfg.to_dict()
    from kiln.checkpoint.manager import WEIGHTS_ONLY_MARKER

    # Imported weights (kiln import-hf) start a new training run: only the architecture is fixed.
    weights_only = (run_dir / "checkpoints" / f"step-{step}" / WEIGHTS_ONLY_MARKER).is_file()
    for section in ("model",) if weights_only else ("model", "data"):
        for key, value in wanted[section].items():
            dotted = f"{section}.{key}"
            if dotted in RESUMABLE or (dotted == "model.vocab_size" and value == 0):
                continue
            if saved[section].get(key) != value:
                raise KilnError(f"{dotted}={_show(value)} conflicts with {run_dir}, which was trained with "
                                f"{dotted}={_show(saved[section].get(key))} ({path}); a resumed run keeps its "
                                f"[model] and [data] settings: drop the override or use a new --run-dir")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def write_run_files(run_dir: Path, cfg: JobConfig, tokenizer: Any, fresh: bool) -> None:
    """Write config.toml and tokenizer.json atomically; a fresh start in a directory whose earlier
    run never checkpointed first moves that run's metrics.jsonl aside."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    if fresh and metrics.exists():
        metrics.rename(run_dir / f"metrics.{int(time.time())}.jsonl.old")
    with atomic_path(run_dir / TOKENIZER_FILE) as tmp:
        tokenizer.save(tmp)
    atomic_write_text(run_dir / CONFIG_FILE, to_toml(cfg))

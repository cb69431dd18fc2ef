"""kiln train [CONFIG.toml] [--set section.key=value ...] [--run-dir DIR] [--steps N] [--resume]"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from kiln.checkpoint.manager import list_checkpoints
from kiln.config import load_config
from kiln.errors import ConfigError, KilnError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML (default: the embedded default job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key; repeatable")
    p.add_argument("--run-dir", help="run directory (default: runs/<model.name>)")
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--resume", metavar="RUN_DIR", nargs="?", const=True, default=None,
                   help="continue the run in RUN_DIR (or --run-dir) from its latest checkpoint, "
                        "with the config it was started with")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="leave after STEP with a checkpoint (the schedule still spans train.steps)")


def run(args: argparse.Namespace) -> int:
    from kiln.train.trainer import train

    if args.stop_at is not None and args.stop_at <= 0:
        raise ConfigError(f"--stop-at={args.stop_at} must be > 0 (a training step to pause after)")
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    run_dir = Path(args.resume) if isinstance(args.resume, str) else (Path(args.run_dir) if args.run_dir else None)
    config_path = args.config
    if args.resume:
        if run_dir is None:
            raise KilnError("--resume needs a run directory: --resume RUN_DIR or --run-dir RUN_DIR")
        if not list_checkpoints(run_dir / "checkpoints"):
            raise KilnError(f"--resume: {run_dir} has no checkpoints/step-N to resume from")
        if config_path is None:  # resume with the resolved config the run was started with
            config_path = run_dir / "config.toml"
    cfg = load_config(config_path, overrides)
    if run_dir is None:
        run_dir = Path("runs") / cfg.model.name
    resume = True if args.resume else None  # None: continue automatically when checkpoints exist
    try:
        result = train(cfg, run_dir, resume=resume, stop_at=args.stop_at)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.is_main:  # under torchrun, one summary line
        val = "" if result.last_val_loss != result.last_val_loss else f", val loss {result.last_val_loss:.4f}"
        print(f"done: {result.steps_done} steps in {run_dir} ({result.stop_reason}); "
              f"final loss {result.final_loss:.4f}{val}")
    return 0

"""kiln loader-bench [CONFIG.toml] [--set section.key=value ...] [--run-dir DIR] [--steps N]

Measures compute, warm and cold loading (kiln/data/stall.py) and writes
RUN_DIR/reports/loader-bench.json, which `kiln report` charts."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.config import load_config

REPORT_NAME = "loader-bench.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML (default: the embedded default job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key; repeatable")
    p.add_argument("--run-dir", help="run directory (default: runs/<model.name>)")
    p.add_argument("--steps", type=int, default=10, help="training steps' worth of batches to time (default 10)")


def run(args: argparse.Namespace) -> int:
    from kiln.data.stall import analyze
    from kiln.io import atomic_write_json

    cfg = load_config(args.config, list(args.overrides))
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.model.name
    report = analyze(cfg, run_dir, steps=args.steps, log=lambda m: print(m, flush=True))
    out = atomic_write_json(run_dir / "reports" / REPORT_NAME, report, indent=1)
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    print(f"compute {ms(report['compute_s_per_step'])}/step, preprocessing {ms(report['prep_s_per_step'])}/step, "
          f"fetch {ms(report['fetch_s_per_step'])}/step ({report['storage']} shards, cold: {report['cold']})")
    print(f"stall {report['stall_fraction']:.1%} of the step (fetch {report['fetch_stall_fraction']:.1%}, "
          f"preprocessing {report['prep_stall_fraction']:.1%})")
    live = report["live"]
    print(f"live training (threaded loader, data wait / step time): cold {live['cold']['stall_fraction']:.2%} "
          f"(after the first step {live['cold']['steady_stall_fraction']:.2%}), warm {live['warm']['stall_fraction']:.2%}")
    rec = report["recommended"]
    print("recommended: " + ", ".join(f"data.{k}={rec[k]}" for k in ("prefetch", "fetch_workers", "lookahead",
                                                                      "cache_gb")))
    if "note" in rec:
        print(f"note: {rec['note']}")
    print(f"report: {out}")
    return 0

"""`kiln prep CONFIG.toml`: raw documents -> filtered, deduplicated, redacted token shards."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="prep pipeline TOML ([input], [output], [tokenize], [run], [[step]])")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys: section.key=value or step.N.key=value (N from 1, or a step name)")
    parser.add_argument("--workers", type=int, default=None, help="parallel shards (default: run.workers, 0 = all CPUs)")
    parser.add_argument("--executor", choices=("local", "ray"), default=None, help="default: run.executor")
    parser.add_argument("--no-resume", action="store_true", help="start over even if a previous run can be resumed")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(f"run.workers={args.workers}")
    if args.executor is not None:
        overrides.append(f"run.executor={args.executor!r}".replace("'", '"'))
    if args.no_resume:
        overrides.append("run.resume=false")
    cfg = load_prep_config(args.config, overrides)
    # Logs and pipes get 120 columns rather than rich's 80, so the step table stays readable.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    report = run_prep(cfg, console=console)
    out = cfg.output.dir
    console.print(f"report: {out}/prep_report.json, {out}/prep_report.html; rejects: {out}/rejects.jsonl",
                  soft_wrap=True)
    if report["tokens"] and report["tokens"]["docs"]["train"]:
        console.print(f"train on it: kiln train --set data.source={report['tokens']['dir']}", soft_wrap=True)
    return 0

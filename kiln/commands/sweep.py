"""kiln sweep [CONFIG] (--grid KEY=V1,V2 ... | --random N --space KEY=LO:HI[:log] ...) [--steps N] [--name NAME]"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kiln.errors import KilnError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML (default: the embedded default job)")
    p.add_argument("--grid", nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                   help="try every combination of these values, e.g. --grid optim.lr=1e-3,3e-3 train.batch_size=8,16")
    p.add_argument("--random", type=int, metavar="N", help="N trials sampled from the --space ranges")
    p.add_argument("--space", nargs="+", action="extend", default=[], metavar="KEY=LO:HI[:log]",
                   help="random-search range; integers when LO and HI are, log-uniform with :log")
    p.add_argument("--seed", type=int, default=0, help="random search seed (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key for every trial; repeatable")
    p.add_argument("--steps", type=int, help="train.steps for each trial (short runs)")
    p.add_argument("--name", help="sweep name: trials go to RUNS_DIR/NAME/trial-NNN (default: sweep-<config name>)")
    p.add_argument("--runs-dir", default="runs", help="parent directory of the sweep (default: runs)")
    p.add_argument("--retry-failed", action="store_true",
                   help="rerun failed/diverged trials of an earlier run of this sweep (their dirs are kept aside)")


def run(args: argparse.Namespace) -> int:
    from kiln.train.sweep import (SweepPlan, grid_trials, parse_grid, parse_space, random_trials, run_sweep,
                                 sweep_page)

    if args.grid and (args.random is not None or args.space):
        raise KilnError("use either --grid or --random N with --space, not both")
    if args.grid:
        trials = grid_trials(parse_grid(args.grid))
    elif args.random is not None:
        if args.random <= 0:
            raise KilnError(f"--random {args.random}: the number of trials must be > 0")
        if not args.space:
            raise KilnError("--random N needs at least one --space KEY=LO:HI[:log]")
        trials = random_trials(parse_space(args.space), args.random, args.seed)
    else:
        raise KilnError("nothing to sweep: give --grid KEY=V1,V2 ... or --random N --space KEY=LO:HI[:log] ...")
    if args.steps is not None and args.steps <= 0:
        raise KilnError(f"--steps={args.steps} must be > 0")
    name = args.name or "sweep-" + (Path(args.config).stem if args.config else "default")
    if not re.fullmatch(r"[\w.-]+", name):
        raise KilnError(f"--name {name!r}: use letters, digits, '.', '-' and '_' only")
    sweep_dir = Path(args.runs_dir) / name
    plan = SweepPlan(args.config, list(args.overrides), trials, args.steps)
    records = run_sweep(plan, sweep_dir, retry_failed=args.retry_failed)
    keys = list(dict.fromkeys(k for t in trials for k in t))
    page = sweep_dir / "sweep.html"
    page.write_text(sweep_page(name, records, keys), encoding="utf-8")
    _print_table(records, keys)
    print(f"results: {sweep_dir / 'sweep.json'}  plot: {page}")
    return 0 if any(r["status"] == "completed" for r in records) else 1


def _print_table(records: list[dict], keys: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from kiln.train.sweep import format_cell, rank

    table = Table(title="sweep results (best validation loss first)")
    for col in ("#", "trial", "status", *keys, "best val", "final val", "tokens/s", "wall s"):
        table.add_column(col, justify="left" if col in ("trial", "status") else "right")
    for n, r in enumerate(rank(records), start=1):
        table.add_row(str(n) if r["status"] == "completed" else "-", r["trial"], r["status"],
                      *(format_cell(r["params"].get(k)) for k in keys), format_cell(r.get("best_val_loss")),
                      format_cell(r.get("final_val_loss")), format_cell(r.get("tokens_per_s")), format_cell(r.get("wall_s")))
    Console(width=max(120, Console().width)).print(table)

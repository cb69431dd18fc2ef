"""kiln report RUN_DIR [--out FILE] [--max-points N]: an HTML report and a terminal summary."""

from __future__ import annotations

import argparse

from kiln.errors import KilnError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory (with metrics.jsonl)")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/reports/report.html)")
    p.add_argument("--max-points", type=int, default=2000,
                   help="most points per plotted series; longer runs are decimated keeping min/max (default 2000)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kiln.report.run_page import SUMMARY_LABELS, format_summary_value, write_report

    if args.max_points < 2:
        raise KilnError(f"--max-points={args.max_points} must be >= 2")
    out, summary, warnings = write_report(args.run_dir, args.out, args.max_points)
    console = Console()
    table = Table(title=f"run {args.run_dir}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label in SUMMARY_LABELS.items():
        table.add_row(label, format_summary_value(key, summary[key]))
    console.print(table)
    for w in warnings:
        console.print(f"warning: {w}", style="yellow", markup=False, highlight=False)
    console.print(f"report: {out}", highlight=False)
    return 0

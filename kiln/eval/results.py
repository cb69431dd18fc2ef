"""The eval report file (`RUN_DIR/reports/eval-step-N.json`): reading what an earlier `kiln eval`
of the same checkpoint left, writing it atomically after each part, and its headline numbers.

Layout: {"run_dir", "step", "time", "parts": {name: {... , "evaluated_at"}}, "failed": null or
{"part", "error"}}. `kiln report` shows these files next to the training curves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.io import atomic_write_text


def earlier_parts(path: Path, step: int) -> dict:
    """Parts of an earlier report for the same checkpoint; parts run now replace their namesakes.

    A report that cannot be read is moved aside (FILE.unreadable), never overwritten.
    """
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        earlier = None
    if isinstance(earlier, dict) and isinstance(earlier.get("parts") or {}, dict):
        return dict(earlier.get("parts") or {}) if earlier.get("step") == step else {}
    aside = path.with_name(path.name + ".unreadable")
    os.replace(path, aside)
    print(f"{path} was not a readable report; moved it to {aside}")
    return {}


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=1, default=str))


def summary_rows(report: dict) -> list[tuple[str, str, str]]:
    """(part, metric, value) rows of the headline numbers."""
    rows: list[tuple[str, str, str]] = []
    parts = report["parts"]
    if "perplexity" in parts:
        p = parts["perplexity"]
        rows += [("perplexity", "loss (nats/token)", f"{p['loss']:.4f}"), ("perplexity", "ppl", f"{p['ppl']:.3f}"),
                 ("perplexity", "bits/byte", f"{p['bpb']:.4f}"), ("perplexity", "tokens", str(p["tokens"]))]
    if "generation" in parts:
        g = parts["generation"]
        rows += [("generation", key, f"{g[key]:.4f}") for key in ("bleu", "chrf", "rouge1", "rouge2", "rougeL",
                                                                   "exact_match")]
    if "passk" in parts:
        rows += [("pass@k", key, f"{value:.4f}") for key, value in parts["passk"]["pass_at_k"].items()]
    if "robustness" in parts:
        rows += [("robustness", f"{name} delta loss", f"{r['delta_loss']:+.4f}")
                 for name, r in parts["robustness"].items() if isinstance(r, dict) and "delta_loss" in r]
    if "lm_eval" in parts:
        for task, metrics in parts["lm_eval"]["results"].items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and "stderr" not in key and key != "alias":
                    rows.append((f"lm-eval {task}", key, f"{value:.4f}"))
    return rows


def print_summary(report: dict) -> None:
    """The headline numbers as a terminal table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kiln eval: {report['run_dir']} (step {report['step']})")
    for column in ("part", "metric", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for row in summary_rows(report):
        table.add_row(*row)
    Console().print(table)

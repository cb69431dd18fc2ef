"""The HTML page of a *training run* (`kiln report`): its metrics.jsonl (read by
kiln.report.run_metrics) as a self-contained page.

Named for what it reports (a run's curves), not for `kiln eval`, whose report files it only shows.
The page has inline-SVG charts (kiln.report.charts), the summary numbers, eval tables (from `eval`
rows and `reports/eval-*.json`), events and the resolved config. Every plotted series is also
embedded as `<script type="application/json" id="data-CHART">` so tools (and tests) can read the
exact values behind a chart. Nothing is loaded from outside the file.
"""

from __future__ import annotations

import json
import math
import time
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import DataError
from kiln.io import atomic_write_text
from kiln.report.charts import (CHART_CSS, PAGE_CSS, Chart, Marker, Series, downsample, html_table, json_script,
                                render_chart, table_cell)
from kiln.report.loader_bench import image_section as loader_bench_image_section
from kiln.report.loader_bench import text_section as loader_bench_text_section
from kiln.report.run_metrics import RunMetrics, finite_number, read_metrics, summarize

EVAL_COLORS = ("#d62728", "#2ca02c", "#ff7f0e", "#9467bd")
MAX_POINTS = 2000  # per plotted series; min/max decimation keeps spikes

SUMMARY_LABELS = {
    "steps": "steps", "tokens": "tokens", "final_loss": "final train loss", "best_loss": "best train loss",
    "final_val_loss": "final val loss", "best_val_loss": "best val loss",
    "tokens_per_s_median": "tokens/s (median)", "mfu_median": "MFU (median)", "peak_memory_mb": "peak memory (MB)",
    "wall_time_s": "wall time", "skipped_steps": "skipped (non-finite) steps", "checkpoints": "checkpoints",
    "malformed_lines": "malformed metrics lines",
}


def format_summary_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "mfu_median":
        return f"{100 * value:.2f}%"
    if key == "wall_time_s":
        return format_duration(value)
    if key in ("steps", "tokens", "skipped_steps", "checkpoints", "malformed_lines"):
        return f"{int(value):,}"
    if key in ("tokens_per_s_median", "peak_memory_mb"):
        return f"{value:,.0f}"
    return f"{value:.4f}"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def ema(values: list[float], span: float) -> list[float]:
    """Debiased exponential moving average (as TensorBoard's smoothing); non-finite inputs are
    passed over, keeping their slot as NaN so x positions still line up."""
    alpha = 2.0 / (span + 1.0)
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        if not finite_number(v):
            out.append(math.nan)
            continue
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


# ------------------------------------------------------------------------------------ charts


def build_charts(m: RunMetrics, max_points: int = MAX_POINTS) -> list[Chart]:
    t = m.train
    steps = t["step"].astype(np.int64).tolist()
    markers = [Marker(r["step"], f"checkpoint step {r['step']}: {r.get('path', '')}") for r in m.of("checkpoint")
               if r.get("ok", True)]

    def col(key: str, scale: float = 1.0) -> list[float]:
        return (t[key] * scale).tolist()

    def series(name: str, xs, ys, **kw) -> Series:
        xs, ys = downsample(list(xs), list(ys), max_points)
        return Series(name, xs, ys, **kw)

    loss = col("loss")
    smooth = ema(loss, span=min(200.0, max(4.0, len(loss) / 60)))
    loss_series = [series("train loss", steps, loss, style="points", width=1.3, opacity=0.35, color="#1f77b4"),
                   series("train loss (EMA)", steps, smooth, color="#1f77b4", width=2.0)]
    evals = m.of("eval")
    eval_keys = sorted({k for r in evals for k in r if k.endswith("_loss")}, key=lambda k: (k != "val_loss", k))
    for i, key in enumerate(eval_keys):
        loss_series.append(series(key.replace("_", " "), [r["step"] for r in evals],
                                  [r[key] if finite_number(r.get(key)) else math.nan for r in evals],
                                  style="line+points", width=2.0, color=EVAL_COLORS[i % len(EVAL_COLORS)]))
    grad = col("grad_norm")
    finite_grad = [g for g in grad if finite_number(g) and g > 0]
    charts = [
        Chart("chart-loss", "Loss (train and validation)", loss_series, y_label="loss (nats/token)"),
        Chart("chart-lr", "Learning rate", [series("lr", steps, col("lr"))], y_label="lr"),
        Chart("chart-grad-norm", "Gradient norm (before clipping)", [series("grad norm", steps, grad)],
              y_label="grad norm", log_y=bool(finite_grad) and max(finite_grad) / min(finite_grad) > 100),
        Chart("chart-tokens-per-s", "Throughput", [series("tokens/s", steps, col("tokens_per_s"))], y_label="tokens/s"),
        Chart("chart-mfu", "Model FLOPs utilization", [series("MFU %", steps, col("mfu", 100.0))], y_label="MFU (%)"),
        Chart("chart-memory", "Memory", [series("memory MB", steps, col("memory_mb"))], y_label="MB"),
        Chart("chart-data-wait", "Data wait per step", [series("data wait ms", steps, col("data_wait_ms"))],
              y_label="ms"),
    ]
    if any(finite_number(v) for v in col("moe_max_load")):  # mixture-of-experts runs: how evenly tokens spread
        charts.append(Chart("chart-moe-load", "MoE load balance (1 = even)",
                            [series("max expert load / mean", steps, col("moe_max_load")),
                             series("balancing loss (unweighted)", steps, col("moe_aux_loss"))],
                            y_label="ratio"))
    for c in charts:
        c.markers = markers
    return charts


def chart_data(chart: Chart) -> dict[str, dict[str, list]]:
    return {s.name: {"x": [_json_number(x) for x in s.xs], "y": [_json_number(y) for y in s.ys]} for s in chart.series}


def _json_number(v: Any) -> Any:
    return v if finite_number(v) else None  # strict JSON has no NaN/Infinity


# ------------------------------------------------------------------------------------ eval files


def read_eval_files(run_dir: Path) -> tuple[list[tuple[str, list[tuple[str, Any]]]], list[str]]:
    """(file name, flattened metrics) for each reports/eval-*.json, and warnings for unreadable ones."""
    tables, warnings = [], []
    for path in sorted((run_dir / "reports").glob("eval-*.json")):
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            warnings.append(f"{path}: not readable JSON ({e}); left out")
            continue
        tables.append((path.name, flatten(obj)))
    return tables, warnings


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys; long lists are summarized by their length."""
    if isinstance(obj, dict):
        out = []
        for key, value in obj.items():
            out += flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(obj, list):
        if len(obj) <= 8 and all(isinstance(v, (int, float, str, bool)) or v is None for v in obj):
            return [(prefix, ", ".join(table_cell(v) for v in obj))]
        return [(prefix, f"[{len(obj)} items]")]
    return [(prefix or "value", obj)]


# ------------------------------------------------------------------------------------ page


def build_report(run_dir: str | Path, max_points: int = MAX_POINTS) -> tuple[str, dict[str, Any], list[str]]:
    """(HTML page, summary, warnings) for a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory {run_dir} not found")
    m = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(m)
    eval_tables, warnings = read_eval_files(run_dir)
    if m.skipped:
        more = " ..." if len(m.skipped) > 5 else ""
        warnings.insert(0, f"{len(m.skipped)} malformed line(s) in metrics.jsonl skipped: "
                           + "; ".join(m.skipped[:5]) + more)
    charts = build_charts(m, max_points)
    config_path = run_dir / "config.toml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None

    body = [f"<h1>kiln run: {escape(run_dir.resolve().name)}</h1>",
            f'<p class="meta">{escape(str(run_dir.resolve()))} &middot; report written '
            f'{time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}</p>']
    if warnings:
        body.append('<ul id="warnings" class="warnings">' + "".join(f"<li>{escape(w)}</li>" for w in warnings) + "</ul>")
    body.append('<h2>Summary</h2><table id="summary"><tbody>')
    for key, label in SUMMARY_LABELS.items():
        value = summary[key]
        raw = "" if value is None else repr(value)
        body.append(f'<tr data-key="{key}" data-value="{escape(raw)}"><th>{escape(label)}</th>'
                    f'<td>{escape(format_summary_value(key, value))}</td></tr>')
    body.append("</tbody></table>")
    body.append(_run_info(m))
    body.append('<h2>Training curves</h2><p class="note">Dashed vertical lines: checkpoints. Train loss: raw '
                'steps as faint points, EMA as a line.</p><div class="charts">')
    for chart in charts:
        body.append(f'<figure>{render_chart(chart)}{json_script("data-" + chart.chart_id, chart_data(chart))}</figure>')
    body.append("</div>")
    body.append(_eval_section(m, eval_tables))
    body.append(loader_bench_text_section(run_dir, warnings))
    body.append(loader_bench_image_section(run_dir, warnings))
    body.append(_events_section(m))
    body.append('<h2>Resolved config</h2>')
    body.append(f'<pre id="config">{escape(config_text)}</pre>' if config_text is not None
                else f'<p id="config">{escape(str(config_path))} not found.</p>')
    html = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kiln report: {escape(run_dir.resolve().name)}</title><style>{PAGE_CSS}{CHART_CSS}</style>"
            f"</head><body>{''.join(body)}</body></html>\n")
    return html, summary, warnings


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 max_points: int = MAX_POINTS) -> tuple[Path, dict[str, Any], list[str]]:
    """Write the page (default RUN_DIR/reports/report.html) atomically; returns (path, summary, warnings)."""
    html, summary, warnings = build_report(run_dir, max_points)
    out = Path(out) if out else Path(run_dir) / "reports" / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, html)
    return out, summary, warnings


def _run_info(m: RunMetrics) -> str:
    runs = m.of("run")
    if not runs:
        return ""
    merged: dict[str, Any] = {}
    for r in runs:  # later segments (resumes) override, e.g. resumed_from
        merged.update(r)
    rows = [[k, v] for k, v in merged.items() if k not in ("kind", "step", "time")]
    if len(runs) > 1:
        rows.append(["segments (resumes)", len(runs)])
    return "<h2>Run</h2>" + html_table("run-info", ["field", "value"], rows)


def _eval_section(m: RunMetrics, eval_tables: list[tuple[str, list[tuple[str, Any]]]]) -> str:
    out = ["<h2>Evaluation</h2>"]
    evals = m.of("eval")
    if evals:
        keys = [k for k in dict.fromkeys(k for r in evals for k in r) if k not in ("kind", "step", "time")]
        out.append(html_table("eval-table", ["step", *keys], [[r["step"], *(r.get(k) for k in keys)] for r in evals]))
    else:
        out.append('<p>No periodic evaluations in metrics.jsonl (train.eval_every = 0?).</p>')
    for i, (name, items) in enumerate(eval_tables):
        out.append(f"<h3>{escape(name)}</h3>")
        out.append(html_table(f"eval-file-{i}", ["metric", "value"], [[k, _maybe_timestamp(k, v)] for k, v in items]))
    return "".join(out)


def _maybe_timestamp(key: str, value: Any) -> Any:
    """Unix times (keys `time`, `*.time`, `*_at`) as readable UTC dates."""
    leaf = key.rsplit(".", 1)[-1]
    if (leaf == "time" or leaf.endswith("_at")) and finite_number(value) and value > 1e8:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    return value


def _events_section(m: RunMetrics) -> str:
    events = m.of("event")
    rows = [[r["step"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])) if finite_number(r.get("time")) else "-",
             r.get("message", "")] for r in events]
    if not rows:
        return '<h2>Events</h2><p id="events">No events.</p>'
    return "<h2>Events</h2>" + html_table("events", ["step", "time (UTC)", "message"], rows)

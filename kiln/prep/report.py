"""The prep report: `prep_report.json`, a terminal table, and a self-contained HTML page
(inline SVG drawn by kiln.report.charts, no external assets): funnel of documents and bytes per
step, length histograms before and after, top removal reasons, and example removed documents
(HTML-escaped), and the composition (source, language, URL host, length bucket) before and
after every step (kiln.prep.composition)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from kiln.io import atomic_write_text
from kiln.prep.composition import DIMENSIONS, composition_table
from kiln.prep.pipeline import PrepConfig
from kiln.report.charts import bar_chart, column_chart


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt_pow2(k: int) -> str:
    """2**k bytes in binary units: 512 B, 1 KiB, 64 MiB."""
    unit = min(k // 10, 4)
    return f"{1 << (k - 10 * unit)} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


def build_report(cfg: PrepConfig, order: list[str], stats: dict[str, dict[str, Any]], hist_in: list[int],
                 hist_out: list[int], tokens: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    types = {s.name: s.type for s in cfg.steps}
    funnel, reasons = [], []
    for name in order:
        s = stats.get(name)
        if s is None:
            continue
        funnel.append({"step": name, "type": types.get(name, "reader"), "docs_in": s["docs_in"],
                       "docs_kept": s["docs_kept"], "bytes_in": s["bytes_in"], "bytes_kept": s["bytes_kept"],
                       "docs_dropped": sum(s["dropped"].values()), "docs_modified": s["docs_modified"],
                       "bytes_dropped": sum(s["dropped_bytes"].values())})
        for reason, n in s["dropped"].items():
            reasons.append({"step": name, "reason": reason, "docs": n, "bytes": s["dropped_bytes"].get(reason, 0)})
    reasons.sort(key=lambda r: (-r["docs"], r["step"], r["reason"]))
    # per step: what went in and what was kept, by dimension; the raw maps stay out of "steps"
    composition = {name: composition_table(stats[name]) for name in order if name in stats}
    stats = {name: {k: v for k, v in s.items() if not k.startswith("comp_")} for name, s in stats.items()}
    warnings = []
    first, last = (funnel[0], funnel[-1]) if funnel else ({}, {})
    if not last.get("docs_kept"):
        warnings.append("no document survived the pipeline; see the removal reasons")
    elif tokens and tokens["docs"]["train"] == 0:
        warnings.append("the train split is empty: every kept document went to val (lower tokenize.val_fraction)")
    elif tokens and tokens["docs"]["val"] == 0:
        warnings.append("the val split is empty: too few documents for tokenize.val_fraction (raise it)")
    return {
        "totals": {"docs_in": first.get("docs_in", 0), "bytes_in": first.get("bytes_in", 0),
                   "docs_out": last.get("docs_kept", 0), "bytes_out": last.get("bytes_kept", 0)},
        "funnel": funnel,
        "top_reasons": reasons,
        "composition": composition,
        "steps": stats,
        "histograms": {"bin_lower_bytes": [0] + [1 << (i - 1) for i in range(1, len(hist_in))],
                       "before": hist_in, "after": hist_out},
        "tokens": tokens,
        "run": run,
        "warnings": warnings,
        "config": cfg.describe(),
    }


def print_report(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="kiln prep", show_lines=False)
    for col in ("step", "docs in", "kept", "dropped", "kept %", "bytes kept", "modified", "top reason"):
        table.add_column(col, justify="left" if col in ("step", "top reason") else "right")
    for row in report["funnel"]:
        dropped = report["steps"][row["step"]]["dropped"]
        top = max(dropped.items(), key=lambda kv: kv[1]) if dropped else None
        pct = 100.0 * row["docs_kept"] / row["docs_in"] if row["docs_in"] else 100.0
        table.add_row(row["step"], f"{row['docs_in']:,}", f"{row['docs_kept']:,}", f"{row['docs_dropped']:,}",
                      f"{pct:.1f}", _fmt_bytes(row["bytes_kept"]), f"{row['docs_modified']:,}",
                      f"{top[0]} ({top[1]:,})" if top else "")
    console.print(table)
    t = report["tokens"]
    if t:
        console.print(f"tokens: train {t['tokens']['train']:,} ({t['docs']['train']:,} docs), "
                      f"val {t['tokens']['val']:,} ({t['docs']['val']:,} docs) -> {t['dir']}")
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")


# ---------------------------------------------------------------------------- HTML


def _histogram_svg(before: list[int], after: list[int]) -> str:
    """Document lengths before and after the pipeline, by power-of-two byte bins (empty ends trimmed)."""
    used = [i for i in range(len(before)) if before[i] or after[i]]
    if not used:
        return "<p>no documents</p>"
    bins = range(used[0], used[-1] + 1)
    labels = [f"≥{_fmt_pow2(i - 1)}" if i else "0 B" for i in bins]
    return column_chart(labels, [("before the pipeline", [before[i] for i in bins], "#9ecae1"),
                                 ("kept", [after[i] for i in bins], "#3182bd")], unit="documents")


def _composition_html(composition: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Per dimension: a chart of the corpus before the first step and after the last (bytes), then
    every step's table (documents and bytes in and kept per value) under a fold."""
    esc = html.escape
    steps = list(composition)
    if not steps:
        return "<p>no documents</p>"
    first, last = composition[steps[0]], composition[steps[-1]]
    parts = []
    for dim in DIMENSIONS:
        kept = {r["value"]: r["bytes_kept"] for r in last[dim]}
        labels = [r["value"] for r in first[dim]] + [v for v in kept if v not in {r["value"] for r in first[dim]}]
        before = {r["value"]: r["bytes_in"] for r in first[dim]}
        chart = column_chart(labels, [("before the pipeline", [before.get(v, 0) for v in labels], "#9ecae1"),
                                      ("kept", [kept.get(v, 0) for v in labels], "#3182bd")],
                             unit="bytes") if labels else "<p>no documents</p>"
        tables = []
        for step in steps:
            rows = "".join(f"<tr><td>{esc(r['value'])}</td><td>{r['docs_in']:,}</td><td>{_fmt_bytes(r['bytes_in'])}</td>"
                           f"<td>{r['docs_kept']:,}</td><td>{_fmt_bytes(r['bytes_kept'])}</td></tr>"
                           for r in composition[step][dim])
            tables.append(f"<details><summary>{esc(step)}</summary><table><tr><th>{esc(dim)}</th><th>docs in</th>"
                          f"<th>bytes in</th><th>docs kept</th><th>bytes kept</th></tr>{rows}</table></details>")
        parts.append(f"<h3>By {esc(dim)}</h3>{chart}{''.join(tables)}")
    return "".join(parts)


def render_html(report: dict[str, Any]) -> str:
    esc = html.escape
    funnel = report["funnel"]
    docs_rows = [(f["step"], f["docs_kept"], f"{f['docs_kept']:,} docs") for f in funnel]
    bytes_rows = [(f["step"], f["bytes_kept"], _fmt_bytes(f["bytes_kept"])) for f in funnel]
    if funnel:
        docs_rows.insert(0, ("input", funnel[0]["docs_in"], f"{funnel[0]['docs_in']:,} docs"))
        bytes_rows.insert(0, ("input", funnel[0]["bytes_in"], _fmt_bytes(funnel[0]["bytes_in"])))
    reasons = "".join(f"<tr><td>{esc(r['step'])}</td><td>{esc(r['reason'])}</td><td>{r['docs']:,}</td>"
                      f"<td>{_fmt_bytes(r['bytes'])}</td></tr>" for r in report["top_reasons"][:50])
    modified = "".join(f"<tr><td>{esc(step)}</td><td>{esc(kind)}</td><td>{n:,}</td></tr>"
                       for step, s in report["steps"].items() for kind, n in sorted(s["modified"].items()))
    examples = []
    for step, s in report["steps"].items():
        for reason, docs in s["examples"].items():
            items = "".join(f"<div class='ex'><div class='id'>{esc(str(d['id']))}</div><pre>{esc(d['text'])}</pre></div>"
                            for d in docs)
            examples.append(f"<details><summary>{esc(step)} — {esc(reason)} ({s['dropped'].get(reason, 0):,})</summary>"
                            f"{items}</details>")
    t, tot, run = report["tokens"], report["totals"], report["run"]
    token_line = (f"<p>Token shards: <code>{esc(t['dir'])}</code> — train {t['tokens']['train']:,} tokens "
                  f"({t['docs']['train']:,} docs), val {t['tokens']['val']:,} tokens ({t['docs']['val']:,} docs), "
                  f"vocabulary {t['vocab_size']:,} ({esc(str(t['tokenizer']))})</p>") if t else ""
    warnings = "".join(f"<p class='warn'>warning: {esc(w)}</p>" for w in report["warnings"])
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>kiln prep report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}
th{{background:#f3f3f3}}pre{{white-space:pre-wrap;background:#f7f7f7;padding:6px;font-size:12px;max-height:14em;overflow:auto}}
.id{{font-size:11px;color:#666}}.warn{{color:#b35900}}summary{{cursor:pointer;margin:4px 0}}
</style></head><body>
<h1>kiln prep report</h1>
<p>{tot['docs_in']:,} documents ({_fmt_bytes(tot['bytes_in'])}) in, {tot['docs_out']:,} documents
({_fmt_bytes(tot['bytes_out'])}) kept; {run['shards']} shards, {run['rejects']:,} rejected records,
{run['seconds']:.1f} s on {esc(str(run['executor']))} with {run['workers']} workers.</p>
{token_line}{warnings}
<h2>Funnel: documents</h2>{bar_chart(docs_rows, "#3182bd")}
<h2>Funnel: bytes</h2>{bar_chart(bytes_rows, "#31a354")}
<h2>Document length (UTF-8 bytes)</h2>{_histogram_svg(report["histograms"]["before"], report["histograms"]["after"])}
<h2>Composition (bytes before the first step and after the last; per step below)</h2>
{_composition_html(report.get("composition", {}))}
<h2>Removal reasons</h2><table><tr><th>step</th><th>reason</th><th>documents</th><th>bytes</th></tr>{reasons}</table>
<h2>Modifications</h2><table><tr><th>step</th><th>kind</th><th>count</th></tr>{modified}</table>
<h2>Examples of removed documents</h2>{''.join(examples)}
</body></html>
"""


def write_html(report: dict[str, Any], path: Path) -> None:
    atomic_write_text(path, render_html(report))

"""The one chart module behind kiln's self-contained HTML reports (run page, prep report, sweep page).

No matplotlib and no JavaScript: each chart is one inline `<svg>` element, so a report opens
anywhere, offline. Three kinds, all hand-written here (plotting libraries either need a browser
runtime or write files that are not inline SVG):

- `render_chart(Chart)`: line/scatter with axes, 1-2-5 or log ticks, a legend and optional vertical
  markers (checkpoints); non-finite values leave gaps in lines instead of breaking the scale.
- `bar_chart(rows)`: labelled horizontal bars (the prep funnel).
- `column_chart(labels, groups)`: grouped vertical columns over categories (length histograms).

Also the pieces the report pages share: `PAGE_CSS`, `CHART_CSS`, `json_script` (a chart's values
embedded as JSON for tools and tests) and `html_table`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from html import escape
from typing import Any

import numpy as np

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    color: str = ""  # "" picks the next palette color
    style: str = "line"  # line | points | line+points
    width: float = 1.6
    opacity: float = 1.0
    radius: float = 0.0  # of points; 0: the line width


@dataclass
class Marker:
    """A vertical line at x (e.g. a checkpoint), with a hover title."""

    x: float
    title: str


@dataclass
class Chart:
    chart_id: str
    title: str
    series: list[Series]
    x_label: str = "step"
    y_label: str = ""
    markers: list[Marker] = field(default_factory=list)
    log_x: bool = False
    log_y: bool = False
    x_ticks: list[tuple[float, str]] | None = None  # fixed ticks (categorical axes, few distinct values)
    x_pad: float = 0.0  # margin as a fraction of the x range (keeps edge points off the frame)
    width: int = 640
    height: int = 300


def downsample(xs: list[float], ys: list[float], max_points: int) -> tuple[list[float], list[float]]:
    """Keep at most `max_points` points: per x-bucket, the minimum and maximum y in x order.

    Unlike striding, this keeps spikes (a loss blow-up stays visible in a 1M-step run).
    """
    n = len(xs)
    if n <= max_points:
        return list(xs), list(ys)
    buckets = max(1, max_points // 2)
    y = np.asarray(ys, dtype=np.float64)
    finite_y = np.where(np.isfinite(y), y, np.nan)
    keep: list[int] = []
    for idx in np.array_split(np.arange(n), buckets):
        chunk = finite_y[idx]
        if np.all(np.isnan(chunk)):
            keep.append(int(idx[0]))
            continue
        lo, hi = int(idx[np.nanargmin(chunk)]), int(idx[np.nanargmax(chunk)])
        keep.extend(sorted({lo, hi}))
    return [xs[i] for i in keep], [ys[i] for i in keep]


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 x 10^k apart) covering [lo, hi], about `target` of them."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    magnitude = 10 ** math.floor(math.log10((hi - lo) / max(target - 1, 1)))

    def span(step: float) -> tuple[int, int]:
        return math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)

    candidates = [m * magnitude for m in (0.5, 1, 2, 2.5, 5, 10)]
    step = min(candidates, key=lambda st: (abs(span(st)[1] - span(st)[0] + 1 - target), -st))
    first, last = span(step)
    return [float(f"{k * step:.12g}") for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten in [lo, hi]; with fewer than two, also 2x and 5x of them."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks = [10.0 ** k for k in range(a, b + 1) if lo <= 10.0 ** k <= hi]
    if len(ticks) < 3:
        ticks = sorted(m * 10.0 ** k for k in range(a, b + 1) for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi)
    return ticks or [lo, hi]


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e6 or magnitude < 1e-3:
        return f"{value:.3g}"
    if magnitude >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def render_chart(chart: Chart) -> str:
    """The chart as an `<svg id=chart_id>` string."""
    left, right, top, bottom = 64, 16, 28, 44
    legend_h = 18 * ((len(chart.series) + 2) // 3) if len(chart.series) > 1 else 0
    w, h = chart.width, chart.height + legend_h
    pw, ph = w - left - right, chart.height - top - bottom
    parts = [f'<svg id="{escape(chart.chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
             f'width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{escape(chart.title)}">',
             f'<text x="{left}" y="18" class="title">{escape(chart.title)}</text>']

    points = [(x, y) for s in chart.series for x, y in zip(s.xs, s.ys)
              if _usable(x, chart.log_x) and _usable(y, chart.log_y)]
    if not points:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="empty">no data</text></svg>')
        return "".join(parts)
    xs = [x for x, _ in points] + [m.x for m in chart.markers if _usable(m.x, chart.log_x)]
    ys = [y for _, y in points]
    xs += [t for t, _ in chart.x_ticks or [] if _usable(t, chart.log_x)]
    x_lo, x_hi = _padded_range(min(xs), max(xs), chart.log_x, pad=chart.x_pad)
    y_lo, y_hi = _padded_range(min(ys), max(ys), chart.log_y, pad=0.05)
    fx = _scale(x_lo, x_hi, left, left + pw, chart.log_x)
    fy = _scale(y_lo, y_hi, top + ph, top, chart.log_y)

    # grid and ticks
    y_ticks = log_ticks(y_lo, y_hi) if chart.log_y else nice_ticks(y_lo, y_hi)
    for t in y_ticks:
        y = fy(t)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{format_number(t)}</text>')
    x_ticks = chart.x_ticks or [(t, format_number(t)) for t in
                                (log_ticks(x_lo, x_hi) if chart.log_x else nice_ticks(x_lo, x_hi, 8))]
    for t, label in x_ticks:
        x = fx(t)
        parts.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 4}" class="axis"/>'
                     f'<text x="{x:.1f}" y="{top + ph + 17}" text-anchor="middle" class="tick">{escape(label)}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    parts.append(f'<text x="{left + pw / 2}" y="{top + ph + 34}" text-anchor="middle" class="label">'
                 f'{escape(chart.x_label)}</text>')
    if chart.y_label:
        parts.append(f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" text-anchor="middle" '
                     f'class="label">{escape(chart.y_label)}</text>')

    for m in chart.markers:
        if _usable(m.x, chart.log_x) and x_lo <= m.x <= x_hi:
            x = fx(m.x)
            parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" class="marker">'
                         f'<title>{escape(m.title)}</title></line>')

    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        parts.append(_series_svg(s, color, fx, fy, chart.log_x, chart.log_y))

    if len(chart.series) > 1:
        for i, s in enumerate(chart.series):
            color = s.color or PALETTE[i % len(PALETTE)]
            lx, ly = left + (i % 3) * (pw / 3), chart.height + 4 + 18 * (i // 3)
            parts.append(f'<rect x="{lx:.1f}" y="{ly:.1f}" width="14" height="4" fill="{color}" '
                         f'fill-opacity="{max(s.opacity, 0.5)}"/>'
                         f'<text x="{lx + 20:.1f}" y="{ly + 6:.1f}" class="legend">{escape(s.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _series_svg(s: Series, color: str, fx, fy, log_x: bool, log_y: bool) -> str:
    out = []
    name = escape(s.name)
    if "line" in s.style:
        runs: list[list[str]] = [[]]
        for x, y in zip(s.xs, s.ys):
            if _usable(x, log_x) and _usable(y, log_y):
                runs[-1].append(f"{fx(x):.1f},{fy(y):.1f}")
            elif runs[-1]:
                runs.append([])  # a gap where the value is missing or non-finite
        d = " ".join("M" + " L".join(r) for r in runs if r)
        if d:
            out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{s.width}" '
                       f'stroke-opacity="{s.opacity}" stroke-linejoin="round"><title>{name}</title></path>')
    if "points" in s.style:
        dots = "".join(f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="{s.radius or max(s.width, 1.2):.1f}"/>'
                       for x, y in zip(s.xs, s.ys) if _usable(x, log_x) and _usable(y, log_y))
        out.append(f'<g fill="{color}" fill-opacity="{s.opacity}"><title>{name}</title>{dots}</g>')
    return "".join(out)


def _usable(v, log: bool) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or not log)


def _padded_range(lo: float, hi: float, log: bool, pad: float) -> tuple[float, float]:
    if log:
        a, b = math.log10(lo), math.log10(hi)
        if a == b:
            a, b = a - 0.5, b + 0.5
        span = b - a
        return 10 ** (a - pad * span), 10 ** (b + pad * span)
    if lo == hi:
        delta = abs(lo) * 0.1 or 1.0
        return lo - delta, hi + delta
    span = hi - lo
    return lo - pad * span, hi + pad * span


def _scale(lo: float, hi: float, out_lo: float, out_hi: float, log: bool):
    if log:
        a, b = math.log10(lo), math.log10(hi)
        return lambda v: out_lo + (math.log10(v) - a) / (b - a) * (out_hi - out_lo)
    return lambda v: out_lo + (v - lo) / (hi - lo) * (out_hi - out_lo)


CHART_CSS = """
svg.chart { background: #fff; border: 1px solid #ddd; border-radius: 4px; margin: 6px; font-family: sans-serif; }
svg.chart .title { font-size: 14px; font-weight: 600; fill: #222; }
svg.chart .tick { font-size: 11px; fill: #555; }
svg.chart .label { font-size: 12px; fill: #333; }
svg.chart .legend { font-size: 12px; fill: #333; }
svg.chart .empty { font-size: 13px; fill: #999; }
svg.chart .grid { stroke: #eee; stroke-width: 1; }
svg.chart .axis { stroke: #888; stroke-width: 1; }
svg.chart .frame { fill: none; stroke: #bbb; stroke-width: 1; }
svg.chart .marker { stroke: #999; stroke-width: 1; stroke-dasharray: 3 3; }
"""


def bar_chart(rows: list[tuple[str, float, str]], color: str, width: int = 640) -> str:
    """Horizontal bars, one per (label, value, value text), scaled to the largest value."""
    top = max((v for _, v, _ in rows), default=0) or 1
    h, label_w = 22, 170
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + label_w + 120}" height="{h * len(rows) + 6}">']
    for i, (label, value, text) in enumerate(rows):
        y = i * h + 3
        w = max(1.0, width * value / top)
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" font-size="12">{escape(label)}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{h - 5}" fill="{escape(color)}"/>'
                     f'<text x="{label_w + w + 5:.1f}" y="{y + 15}" font-size="12">{escape(text)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def column_chart(labels: list[str], groups: list[tuple[str, list[float], str]], unit: str = "") -> str:
    """Vertical columns: for each category label, one column per (name, values, color) group side by
    side, scaled to the largest value; a legend on top, slanted labels below, the unit in hover titles."""
    top = max((v for _, values, _ in groups for v in values), default=0) or 1
    cw, height, left, legend = 44, 180, 50, 24
    n, k = len(labels), max(len(groups), 1)
    base = legend + height
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + n * cw + 20}" height="{base + 60}">']
    for g, (name, _, color) in enumerate(groups):
        parts.append(f'<rect x="{left + 150 * g}" y="4" width="10" height="10" fill="{escape(color)}"/>'
                     f'<text x="{left + 150 * g + 14}" y="13" font-size="11">{escape(name)}</text>')
    parts.append(f'<text x="{left - 6}" y="{legend + 10}" font-size="10" text-anchor="end">{format_number(top)}</text>'
                 f'<text x="{left - 6}" y="{base}" font-size="10" text-anchor="end">0</text>')
    width = cw // k - 3 if k > 1 else cw - 6
    for j, label in enumerate(labels):
        x = left + j * cw
        for g, (_, values, color) in enumerate(groups):
            hgt = height * values[j] / top
            parts.append(f'<rect x="{x + 2 + g * (cw // k - 2)}" y="{base - hgt:.1f}" width="{width}" '
                         f'height="{hgt:.1f}" fill="{escape(color)}"><title>{format_number(values[j])} '
                         f'{escape(unit)}</title></rect>')
        parts.append(f'<text x="{x + cw / 2}" y="{base + 14}" font-size="10" text-anchor="end" '
                     f'transform="rotate(-40 {x + cw / 2} {base + 14})">{escape(label)}</text>')
    parts.append(f'<line x1="{left}" y1="{base}" x2="{left + n * cw}" y2="{base}" stroke="#888"/></svg>')
    return "".join(parts)


def json_script(element_id: str, obj: Any) -> str:
    """`obj` as strict JSON in a `<script type="application/json">` element that nothing in it can close."""
    text = json.dumps(obj, allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="{escape(element_id)}">{text}</script>'


PAGE_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; } h3 { font-size: 15px; }
.meta, .note { color: #666; font-size: 13px; }
.warnings { background: #fff4e5; border: 1px solid #f0c36d; padding: 8px 8px 8px 28px; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
td { font-variant-numeric: tabular-nums; } thead th { background: #f4f4f4; }
.charts { display: flex; flex-wrap: wrap; } figure { margin: 0; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 10px; font-size: 12px; overflow-x: auto; }
"""


def table_cell(v: Any) -> str:
    """A table cell's text: thousands separators, 6 significant digits, long text cut at 200."""
    if isinstance(v, bool) or v is None:
        return str(v).lower() if v is not None else "-"
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."


def html_table(table_id: str, header: list[str], rows: list[list[Any]], cell=table_cell) -> str:
    """A `<table>` of escaped cells, each written by `cell`."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table id="{escape(table_id)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

"""The run page's sections for `kiln loader-bench`'s reports (reports/loader-bench.json for token
shards, reports/loader-bench-image.json for image-text) and the image report's chart.

Each section is rebuilt from the report's checked numbers, never from a file of markup anyone could
have written; a report that is not what it should be is a warning on the page, not a crash.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from kiln.report.charts import bar_chart, html_table

LOADER_BENCH_TIMES = (("compute", "compute_s_per_step"), ("preprocessing", "prep_s_per_step"),
                      ("fetch (cold)", "fetch_s_per_step"))


def text_section(run_dir: Path, warnings: list[str]) -> str:
    """reports/loader-bench.json (`kiln loader-bench`) as bars of ms per step, the stall and the
    recommended settings; a file that is not what it should be is a warning, not a crash."""
    path = run_dir / "reports" / "loader-bench.json"
    if not path.is_file():
        return ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        times = [(label, float(data[key])) for label, key in LOADER_BENCH_TIMES]
        fractions = [float(data[k]) for k in ("stall_fraction", "fetch_stall_fraction", "prep_stall_fraction")]
        recommended = data["recommended"]
        if not all(map(math.isfinite, [v for _, v in times] + fractions)) or min(v for _, v in times) < 0 \
                or not isinstance(recommended, dict):
            raise ValueError("times must be finite and >= 0, recommended a table")
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.append(f"{path}: not a loader-bench report ({type(e).__name__}: {e})")
        return ""
    bars = bar_chart([(label, v * 1e3, f"{v * 1e3:.2f} ms") for label, v in times], "#1f77b4")
    stall = (f"stall {fractions[0]:.1%} of the step: fetch {fractions[1]:.1%}, "
             f"preprocessing {fractions[2]:.1%}")
    rows = [[f"data.{k}", v] for k, v in recommended.items() if k != "note"]
    note = f'<p class="note">{escape(str(recommended["note"]))}</p>' if "note" in recommended else ""
    return (f'<h2>Data loading (kiln loader-bench)</h2><p id="loader-stall">{escape(stall)}</p>'
            f'<figure id="chart-loader-bench">{bars}</figure>{note}'
            + html_table("loader-recommended", ["recommended setting", "value"], rows))


def image_chart_svg(report: dict) -> str:
    """Modelled step time of each configuration as bars (kiln/report/charts.py)."""
    rows = [("compute only", report["compute_s_per_step"] * 1e3, f"{report['compute_s_per_step'] * 1e3:.2f} ms")]
    rows += [(f"{r['mode']}, {r['workers']} worker(s)", r["step_s"] * 1e3,
              f"{r['step_s'] * 1e3:.2f} ms (stall {r['stall_fraction']:.0%})") for r in report["configs"]]
    return bar_chart(rows, "#1f77b4")


def image_section(run_dir: Path, warnings: list[str]) -> str:
    """The run page's section for reports/loader-bench-image.json: the chart, rebuilt from the
    checked numbers (never the .svg file, which anyone could have written), and the verdict; a
    file that is not a report is a warning."""
    path = Path(run_dir) / "reports" / "loader-bench-image.json"
    if not path.is_file():
        return ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        report = {"compute_s_per_step": float(data["compute_s_per_step"]), "configs": [
            {"mode": str(r["mode"]), "workers": int(r["workers"]), "step_s": float(r["step_s"]),
             "stall_fraction": float(r["stall_fraction"])} for r in data["configs"]]}
        verdict = str(data["recommended"]["verdict"])
        numbers = [report["compute_s_per_step"]] + [v for r in report["configs"] for v in (r["step_s"],
                                                                                            r["stall_fraction"])]
        if not report["configs"] or not all(math.isfinite(v) and v >= 0 for v in numbers):
            raise ValueError("times must be finite and >= 0")
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.append(f"{path}: not a loader-bench image report ({type(e).__name__}: {e})")
        return ""
    return (f'<h2>Image-text loading (kiln loader-bench --image-text)</h2><p id="image-loader-verdict">'
            f'{escape(verdict)}</p><figure id="chart-loader-bench-image">{image_chart_svg(report)}</figure>')

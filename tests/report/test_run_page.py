import json
import math
import shutil
import statistics
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.report.run_metrics import read_metrics
from kiln.report.run_page import ema, write_report

REPO = Path(__file__).resolve().parents[2]
CHARTS = ["chart-loss", "chart-lr", "chart-grad-norm", "chart-tokens-per-s", "chart-mfu", "chart-memory",
          "chart-data-wait"]
CONFIG = '[model]\nname = "tiny </pre><script>alert(1)</script>"\ndim = 64\n'


class Page(HTMLParser):
    """Collects what the tests check: svg ids, JSON data blocks, tables by id, summary values."""

    def __init__(self, html: str):
        super().__init__()
        self.svgs, self.data, self.tables, self.summary = [], {}, {}, {}
        self.config, self.warnings, self.markers = "", [], {}
        self._script = self._table = self._row = self._chart = None
        self._in_pre = self._in_li = False
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs.append(a.get("id"))
            self._chart = a.get("id")
        elif tag == "line" and a.get("class") == "marker":
            self.markers[self._chart] = self.markers.get(self._chart, 0) + 1
        elif tag == "script":
            assert a.get("type") == "application/json", "no executable scripts in a report"
            self._script = [a["id"], ""]
        elif tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
            if self._table == "summary":
                self.summary[a["data-key"]] = a["data-value"]
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "pre" and a.get("id") == "config":
            self._in_pre = True
        elif tag == "li":
            self._in_li = True
            self.warnings.append("")

    def handle_endtag(self, tag):
        if tag == "script" and self._script:
            self.data[self._script[0]] = json.loads(self._script[1])
            self._script = None
        elif tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "pre":
            self._in_pre = False
        elif tag == "li":
            self._in_li = False

    def handle_data(self, data):
        if self._script:
            self._script[1] += data
        if self._cell is not None:
            self._cell.append(data)
        if self._in_pre:
            self.config += data
        if self._in_li:
            self.warnings[-1] += data


def synthetic_run(run_dir: Path, steps: int = 120) -> list[dict]:
    """A run dir with every row kind, a NaN step, a resume that repeats steps, and bad lines."""
    run_dir.mkdir(parents=True)
    rows = [{"kind": "run", "step": 0, "time": 1000.0, "n_params": 123456, "device": "cpu", "dtype": "fp32",
             "resumed_from": None}]
    t = 1000.0
    for step in range(1, steps + 1):
        t += 0.5
        loss = 5.0 * math.exp(-step / 40) + 2.0 + 0.05 * math.sin(step)
        rows.append({"kind": "train", "step": step, "time": t, "loss": math.nan if step == 50 else loss,
                     "lr": 1e-3 * min(1.0, step / 10), "grad_norm": 1.0 + 0.01 * step, "tokens": 512 * step,
                     "tokens_per_s": 1000.0 + (step * 37) % 101, "mfu": 0.2 + 0.001 * (step % 7),
                     "memory_mb": 300.0 + step % 13, "data_wait_ms": 0.1 * (step % 5), "step_ms": 500.0,
                     "skipped": step == 50})
        if step % 40 == 0:
            rows.append({"kind": "eval", "step": step, "time": t, "val_loss": 3.0 - step / 100,
                         "val_ppl": math.exp(3.0 - step / 100), "val_bpb": 4.0 - step / 100, "extra_loss": 3.5 - step / 100})
        if step % 60 == 0:
            rows.append({"kind": "checkpoint", "step": step, "time": t, "path": f"{run_dir}/checkpoints/step-{step}",
                         "save_s": 0.1})
    rows.append({"kind": "event", "step": steps, "time": t, "message": "early stop: no val_loss improvement <3>"})
    lines = [json.dumps(r) for r in rows]
    # a crash after step 70 and a resume from the step-60 checkpoint: steps 61..70 appear twice
    crashed = [json.dumps({**r, "loss": 99.0}) for r in rows if r["kind"] == "train" and 61 <= r["step"] <= 70]
    split = next(i for i, r in enumerate(rows) if r["kind"] == "train" and r["step"] == 61)
    lines = (lines[:split] + crashed + ['{"kind": "train", "step": 71, "loss": 2.'] +  # cut short by the crash
             [json.dumps({"kind": "run", "step": 60, "time": rows[split]["time"], "resumed_from": 60})] +
             ["[1, 2, 3]"] + lines[split:])
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (run_dir / "config.toml").write_text(CONFIG, encoding="utf-8")
    (run_dir / "reports").mkdir()
    (run_dir / "reports" / "eval-step-120.json").write_text(json.dumps(
        {"step": 120, "time": 1_700_000_000.0, "parts": {"perplexity": {"loss": 2.345678, "ppl": 10.44}, "generation": {"samples": list(range(20))}},
         "failed": None}), encoding="utf-8")
    (run_dir / "reports" / "eval-broken.json").write_text("{not json", encoding="utf-8")
    return rows


def bad_line_numbers(run_dir: Path) -> list[int]:
    out = []
    for i, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines(), start=1):
        try:
            if not isinstance(json.loads(line), dict):
                out.append(i)
        except json.JSONDecodeError:
            out.append(i)
    return out


@pytest.fixture
def report(tmp_path):
    run = tmp_path / "run"
    rows = synthetic_run(run)
    path, summary, warnings = write_report(run)
    assert path == run / "reports" / "report.html"
    html = path.read_text(encoding="utf-8")
    return run, rows, html, Page(html), summary


def test_every_chart_is_there_with_its_data(report):
    _, rows, _, page, _ = report
    for chart in CHARTS:
        assert chart in page.svgs
        assert f"data-{chart}" in page.data
    train = [r for r in rows if r["kind"] == "train"]
    steps = [r["step"] for r in train]
    loss = page.data["data-chart-loss"]
    assert loss["train loss"]["x"] == steps
    assert loss["train loss"]["y"] == [None if math.isnan(r["loss"]) else r["loss"] for r in train]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert loss["val loss"] == {"x": [40, 80, 120], "y": [r["val_loss"] for r in evals]}
    assert loss["extra loss"]["y"] == [r["extra_loss"] for r in evals]
    ema_y = loss["train loss (EMA)"]["y"]
    assert ema_y[0] == pytest.approx(train[0]["loss"]) and ema_y[49] is None
    assert page.data["data-chart-lr"]["lr"]["y"] == [r["lr"] for r in train]
    assert page.data["data-chart-mfu"]["MFU %"]["y"] == [100.0 * r["mfu"] for r in train]
    assert page.data["data-chart-memory"]["memory MB"]["y"] == [r["memory_mb"] for r in train]
    assert page.data["data-chart-data-wait"]["data wait ms"]["y"] == [r["data_wait_ms"] for r in train]
    assert page.data["data-chart-grad-norm"]["grad norm"]["y"] == [r["grad_norm"] for r in train]
    assert page.data["data-chart-tokens-per-s"]["tokens/s"]["y"] == [r["tokens_per_s"] for r in train]
    assert all(page.markers[c] == 2 for c in CHARTS)  # checkpoints at 60 and 120


def test_moe_runs_get_a_load_balance_chart(tmp_path):
    run = tmp_path / "run"
    rows = synthetic_run(run)  # rewritten without its crash and bad lines, with MoE keys
    lines = [json.dumps({**r, "moe_max_load": 1.0 + 4.0 / r["step"], "moe_aux_loss": 1.1})
             if r["kind"] == "train" else json.dumps(r) for r in rows]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    page = Page(write_report(run)[0].read_text(encoding="utf-8"))
    data = page.data["data-chart-moe-load"]
    assert data["max expert load / mean"]["y"] == [1.0 + 4.0 / s for s in range(1, 121)]
    assert data["balancing loss (unweighted)"]["y"] == [1.1] * 120
    assert "chart-moe-load" in page.svgs


def test_dense_runs_have_no_moe_chart(report):
    assert "chart-moe-load" not in report[3].svgs


def test_summary_matches_the_rows(report):
    run, rows, _, page, summary = report
    train = [r for r in rows if r["kind"] == "train"]
    finite = [r["loss"] for r in train if not math.isnan(r["loss"])]
    val = [r["val_loss"] for r in rows if r["kind"] == "eval"]
    expected = {
        "steps": 120, "tokens": 512 * 120, "final_loss": finite[-1], "best_loss": min(finite),
        "final_val_loss": val[-1], "best_val_loss": min(val),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in train),
        "mfu_median": statistics.median(r["mfu"] for r in train),
        "peak_memory_mb": max(r["memory_mb"] for r in train), "skipped_steps": 1, "checkpoints": 2,
        "malformed_lines": 2,
    }
    for key, value in expected.items():
        assert summary[key] == value, key
        assert float(page.summary[key]) == value, key
    # two segments: 1000 -> crash (step 70) and the resume (step 60 time) -> the end
    t61 = next(r["time"] for r in train if r["step"] == 61)
    assert summary["wall_time_s"] == pytest.approx((train[69]["time"] - 1000.0) + (train[-1]["time"] - t61))
    shown = {row[0]: row[1] for row in page.tables["summary"]}
    assert shown["final val loss"] == f"{val[-1]:.4f}" and shown["steps"] == "120"


def test_resumed_steps_keep_the_latest_rows(report):
    _, _, _, page, _ = report
    ys = page.data["data-chart-loss"]["train loss"]["y"]
    assert 99.0 not in ys and len(ys) == 120


def test_malformed_lines_are_named_with_file_and_line(report):
    run, _, _, page, _ = report
    bad = bad_line_numbers(run)
    assert len(bad) == 2
    warning = next(w for w in page.warnings if "malformed" in w)
    for n in bad:
        assert f"metrics.jsonl:{n}:" in warning
    assert any("eval-broken.json" in w for w in page.warnings)


def test_tables_events_config_and_no_external_resources(report):
    _, _, html, page, _ = report
    assert page.tables["eval-table"][0] == ["step", "val_loss", "val_ppl", "val_bpb", "extra_loss"]
    assert page.tables["eval-table"][-1][:2] == ["120", "1.8"]
    eval_file = {row[0]: row[1] for row in page.tables["eval-file-0"]}
    assert eval_file["parts.perplexity.loss"] == "2.34568"
    assert eval_file["parts.generation.samples"] == "[20 items]"
    assert eval_file["time"] == "2023-11-14 22:13:20 UTC"
    assert page.tables["events"][1][2] == "early stop: no val_loss improvement <3>"
    assert {row[0]: row[1] for row in page.tables["run-info"]}["n_params"] == "123,456"
    assert page.config == CONFIG  # escaped in the page, intact when parsed
    assert "<script>alert" not in html
    for needle in ("src=", "href=", "url(", "@import", "https:"):
        assert needle not in html
    assert html.count("http://") == html.count('xmlns="http://www.w3.org/2000/svg"') == len(CHARTS)


def test_long_runs_are_downsampled(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 20_001):
            loss = 100.0 if step == 12_345 else 3.0 + 1.0 / step
            f.write(json.dumps({"kind": "train", "step": step, "time": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
                                "tokens_per_s": 1.0, "mfu": 0.1, "memory_mb": 1.0, "data_wait_ms": 0.0}) + "\n")
    path, summary, _ = write_report(run, max_points=1000)
    page = Page(path.read_text())
    raw = page.data["data-chart-loss"]["train loss"]
    assert len(raw["x"]) <= 1000 and 100.0 in raw["y"]  # the spike survives
    assert path.stat().st_size < 400_000
    assert summary["steps"] == 20_000 and summary["best_val_loss"] is None
    assert "config.toml not found" in path.read_text()


def test_missing_empty_and_garbage_metrics_are_clear_errors(tmp_path):
    with pytest.raises(KilnError, match="run directory .* not found"):
        write_report(tmp_path / "nope")
    (tmp_path / "r").mkdir()
    with pytest.raises(KilnError, match=r"metrics.jsonl not found"):
        read_metrics(tmp_path / "r" / "metrics.jsonl")
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    with pytest.raises(KilnError, match="no metrics rows"):
        write_report(tmp_path / "r")
    (tmp_path / "r" / "metrics.jsonl").write_text("\n{oops\n")
    with pytest.raises(KilnError, match=r"metrics.jsonl:2: not valid JSON"):
        write_report(tmp_path / "r")


def test_ema_is_debiased_and_skips_nan():
    assert ema([2.0, 2.0, 2.0], span=9) == [2.0, 2.0, 2.0]
    out = ema([1.0, math.nan, 3.0], span=3)  # alpha 0.5
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx((0.25 * 1 + 0.5 * 3) / 0.75)


def test_cli_prints_summary_and_fails_cleanly(report, capsys, tmp_path):
    run = report[0]
    assert main(["report", str(run), "--out", str(tmp_path / "x.html")]) == 0
    out = capsys.readouterr()
    assert "final val loss" in out.out and "1.8000" in out.out and "x.html" in out.out
    assert "malformed" in out.out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
@pytest.mark.timeout(120)
def test_renders_in_headless_chromium(report, tmp_path):
    run = report[0]
    png = tmp_path / "report.png"
    subprocess.run(["bash", str(REPO / "scripts" / "render_report.sh"), str(run), str(png), "1200,2000"],
                   check=True, timeout=100, capture_output=True)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 2000)
    assert len(data) > 20_000  # a blank page compresses to a few KB

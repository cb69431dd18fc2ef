"""Short-run hyperparameter search: a grid or seeded random search over any config keys.

Each trial is a normal training run in `SWEEP_DIR/trial-NNN/`, started through
`kiln.train.trainer.train`, one after the other. `sweep.json` holds the plan and every trial's
outcome and is rewritten after each trial, so an interrupted sweep picks up where it stopped:
finished trials are skipped, an interrupted one resumes from its last checkpoint. A trial that
diverges or raises is recorded as failed and the sweep moves on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.config import JobConfig, load_config, parse_literal
from kiln.errors import ConfigError, KilnError, TrainingDiverged
from kiln.io import atomic_write_json

SWEEP_FILE = "sweep.json"
FINISHED = ("completed", "diverged", "failed")


@dataclass
class Space:
    """A random-search range: uniform (or log-uniform) in [lo, hi]; integers when both ends are."""

    key: str
    lo: float
    hi: float
    log: bool
    integer: bool

    def sample(self, rng: random.Random) -> int | float:
        if self.log:
            value = math.exp(rng.uniform(math.log(self.lo), math.log(self.hi)))
        else:
            value = rng.uniform(self.lo, self.hi)
        return min(max(int(round(value)), int(self.lo)), int(self.hi)) if self.integer else value


# A value as `--set` reads it (a TOML literal, else a string): the config engine's parse.
parse_value = parse_literal


def _split_key(item: str, flag: str, example: str) -> tuple[str, str]:
    key, sep, rest = item.partition("=")
    key = key.strip()
    if not sep or "." not in key or not rest.strip():
        raise ConfigError(f"{flag} {item!r}: expected section.key=..., e.g. {flag} {example}")
    return key, rest.strip()


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so `optim.betas=[0.9,0.95],[0.9,0.99]` works."""
    parts, depth, quote, current = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += c
    parts.append(current.strip())
    return parts


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`["optim.lr=1e-3,3e-3"]` -> {"optim.lr": ["1e-3", "3e-3"]} (value texts, as --set takes them)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, text = _split_key(item, "--grid", "optim.lr=1e-3,3e-3")
        values = _split_values(text)
        if any(not v for v in values):
            raise ConfigError(f"--grid {item!r}: empty value in the list")
        if key in grid:
            raise ConfigError(f"--grid {key} given twice")
        grid[key] = values
    return grid


def parse_space(items: list[str]) -> dict[str, Space]:
    """`["optim.lr=1e-4:1e-2:log", "schedule.warmup_steps=0:50"]` -> {key: Space}."""
    spaces: dict[str, Space] = {}
    for item in items:
        key, text = _split_key(item, "--space", "optim.lr=1e-4:1e-2:log")
        parts = text.split(":")
        log = len(parts) == 3 and parts[2].strip() == "log"
        if len(parts) not in (2, 3) or (len(parts) == 3 and not log):
            raise ConfigError(f"--space {item!r}: expected LO:HI or LO:HI:log")
        lo, hi = parse_value(parts[0].strip()), parse_value(parts[1].strip())
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)):
            raise ConfigError(f"--space {item!r}: LO and HI must be numbers")
        if not lo < hi:
            raise ConfigError(f"--space {item!r}: LO must be smaller than HI")
        if log and lo <= 0:
            raise ConfigError(f"--space {item!r}: a log range needs LO > 0")
        if key in spaces:
            raise ConfigError(f"--space {key} given twice")
        spaces[key] = Space(key, float(lo), float(hi), log, isinstance(lo, int) and isinstance(hi, int))
    return spaces


def grid_trials(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination, the first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def random_trials(spaces: dict[str, Space], n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{key: repr(space.sample(rng)) for key, space in spaces.items()} for _ in range(n)]


# ------------------------------------------------------------------------------------ running


@dataclass
class SweepPlan:
    config: str | None  # config file path (None: the embedded default)
    overrides: list[str]  # applied to every trial before the trial's own values
    trials: list[dict[str, str]]  # per trial: key -> value text
    steps: int | None = None

    def trial_overrides(self, index: int) -> list[str]:
        extra = [f"train.steps={self.steps}"] if self.steps is not None else []
        return self.overrides + extra + [f"{k}={v}" for k, v in self.trials[index].items()]

    def to_json(self) -> dict[str, Any]:
        # the config file's content is part of the plan: an edited file makes earlier trials stale
        digest = hashlib.sha256(Path(self.config).read_bytes()).hexdigest() if self.config else None
        return {"config": self.config, "config_sha256": digest, "overrides": self.overrides, "steps": self.steps,
                "trials": self.trials}


def trial_name(index: int) -> str:
    return f"trial-{index:03d}"


def build_configs(plan: SweepPlan, sweep_dir: Path) -> list[JobConfig]:
    """Validate every trial's config before any training, naming the trial that is wrong."""
    configs = []
    swept = {k for t in plan.trials for k in t}
    for i in range(len(plan.trials)):
        try:
            cfg = load_config(plan.config, plan.trial_overrides(i))
        except ConfigError as e:
            raise ConfigError(f"sweep {trial_name(i)} ({_params_text(plan.trials[i])}): {e}") from None
        if cfg.train.eval_every == 0:
            raise ConfigError("sweeps rank trials by validation loss: set train.eval_every > 0 "
                              "(the last step is always evaluated)")
        if not cfg.data.shards_dir and not any(k.startswith("data.") for k in swept):
            # trials share one tokenization of the data unless the data settings are what is swept
            cfg.data.shards_dir = str(sweep_dir / "data")
        configs.append(cfg)
    return configs


def load_state(sweep_dir: Path, plan: SweepPlan) -> list[dict[str, Any]]:
    """Trial records from an earlier run of the same sweep, or fresh ones."""
    path = sweep_dir / SWEEP_FILE
    fresh = [{"trial": trial_name(i), "params": {k: parse_value(v) for k, v in t.items()}, "status": "pending"}
             for i, t in enumerate(plan.trials)]
    if not path.is_file():
        return fresh
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise KilnError(f"{path}: not readable ({e}); move it away to start the sweep afresh") from None
    if saved.get("plan") != plan.to_json():
        raise KilnError(f"{sweep_dir} holds a different sweep (its {SWEEP_FILE} has another plan: the config "
                        f"file or its content, --set, --steps or the trials differ); use --name for a new sweep "
                        f"or delete that directory")
    return saved["trials"]


def save_state(sweep_dir: Path, plan: SweepPlan, records: list[dict[str, Any]], keys: list[str]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    obj = {"plan": plan.to_json(), "keys": keys, "trials": records, "ranking": [r["trial"] for r in rank(records)]}
    atomic_write_json(sweep_dir / SWEEP_FILE, obj, indent=1, default=_json_default, allow_nan=False)


def _json_default(v: Any) -> Any:
    return str(v)


def _finite_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None  # sweep.json stays strict JSON


def run_sweep(plan: SweepPlan, sweep_dir: str | Path, *, retry_failed: bool = False,
              train_fn: Callable | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every unfinished trial in order; returns the trial records (see sweep.json)."""
    from kiln.report.run_metrics import read_metrics, summarize

    if train_fn is None:
        from kiln.train.trainer import train as train_fn
    sweep_dir = Path(sweep_dir)
    if not plan.trials:
        raise KilnError("the sweep has no trials")
    keys = list(dict.fromkeys(k for t in plan.trials for k in t))
    configs = build_configs(plan, sweep_dir)
    records = load_state(sweep_dir, plan)
    save_state(sweep_dir, plan, records, keys)
    for i, (cfg, record) in enumerate(zip(configs, records)):
        run_dir = sweep_dir / record["trial"]
        if record["status"] in FINISHED and not (retry_failed and record["status"] != "completed"):
            log(f"{record['trial']}: {record['status']} earlier, skipped")
            continue
        if record["status"] in ("diverged", "failed") and run_dir.exists():
            run_dir.rename(run_dir.with_name(f"{run_dir.name}.failed-{int(time.time())}"))  # keep it, start afresh
        log(f"{record['trial']} ({i + 1}/{len(records)}): {_params_text(plan.trials[i])}")
        record.update(status="running", error=None)
        save_state(sweep_dir, plan, records, keys)
        t0 = time.time()
        try:
            result = train_fn(cfg, run_dir)
        except KeyboardInterrupt:
            record["status"] = "interrupted"
            save_state(sweep_dir, plan, records, keys)
            raise
        except Exception as e:  # any failure is this trial's outcome, not the sweep's
            diverged = isinstance(e, TrainingDiverged)
            record.update(status="diverged" if diverged else "failed", error=f"{type(e).__name__}: {e}")
            if not isinstance(e, KilnError):
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        else:
            finite = math.isfinite(result.last_val_loss) and math.isfinite(result.best_val_loss)
            record.update(status="completed" if finite else "diverged", stop_reason=result.stop_reason,
                          steps_done=result.steps_done, final_loss=_finite_or_none(result.final_loss),
                          final_val_loss=_finite_or_none(result.last_val_loss),
                          best_val_loss=_finite_or_none(result.best_val_loss))
            if not finite:
                record["error"] = "validation loss is not finite"
        record["wall_s"] = round(time.time() - t0, 2)
        if (run_dir / "metrics.jsonl").is_file():
            try:
                summary = summarize(read_metrics(run_dir / "metrics.jsonl"))
                record["tokens_per_s"] = summary["tokens_per_s_median"]
                record.setdefault("steps_done", summary["steps"])
            except KilnError:
                pass  # a trial that failed before its first step has no metrics
        save_state(sweep_dir, plan, records, keys)
        log(f"{record['trial']}: {record['status']}" + (f" ({record['error']})" if record.get("error") else
                                                         f", best val loss {record['best_val_loss']:.4f}"))
    return records


def rank(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed trials by best validation loss, then everything else in trial order."""
    def key(r: dict[str, Any]) -> tuple:
        v = r.get("best_val_loss")
        ok = r.get("status") == "completed" and isinstance(v, (int, float)) and math.isfinite(v)
        return (0, v, r["trial"]) if ok else (1, 0.0, r["trial"])

    return sorted(records, key=key)


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


# ------------------------------------------------------------------------------------ page


def sweep_page(title: str, records: list[dict[str, Any]], keys: list[str]) -> str:
    """A self-contained HTML page: best validation loss against each swept key, and the ranking."""
    from html import escape

    from kiln.report.charts import CHART_CSS, PAGE_CSS, html_table, json_script, render_chart

    grid = is_grid(records, keys)
    charts = [sweep_chart(records, keys, key, i, grid) for i, key in enumerate(keys)]
    ranked = rank(records)
    head = ["rank", "trial", "status", *keys, "best val loss", "final val loss", "final train loss", "tokens/s",
            "wall s", "note"]
    rows = [[n if r["status"] == "completed" else "-", r["trial"], r["status"],
             *(r["params"].get(k) for k in keys), r.get("best_val_loss"), r.get("final_val_loss"),
             r.get("final_loss"), r.get("tokens_per_s"), r.get("wall_s"), r.get("error") or r.get("stop_reason") or ""]
            for n, r in enumerate(ranked, start=1)]
    table = html_table("ranking", head, rows, cell=format_cell)
    figures = "".join(f"<figure>{render_chart(c)}</figure>" for c in charts)
    data = {"keys": keys, "trials": [{"trial": r["trial"], "status": r["status"], "params": r["params"],
                                      "best_val_loss": r.get("best_val_loss")} for r in records]}
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kiln sweep: {escape(title)}</title><style>{PAGE_CSS}{CHART_CSS}{RANKING_CSS}</style></head><body>"
            f"<h1>kiln sweep: {escape(title)}</h1><h2>Best validation loss by parameter</h2>"
            f'<div class="charts">{figures}</div><h2>Trials, best first</h2>{table}'
            f"{json_script('data-sweep', data)}</body></html>\n")


RANKING_CSS = "#ranking td { white-space: nowrap; } #ranking td:last-child { white-space: normal; }"


def is_grid(records: list[dict[str, Any]], keys: list[str]) -> bool:
    """Do the trials form a full grid (every combination of each key's distinct values, once)?"""
    combos = {json.dumps([r["params"].get(k) for k in keys], sort_keys=True) for r in records}
    distinct = [len({json.dumps(r["params"].get(k), sort_keys=True) for r in records}) for k in keys]
    return len(combos) == len(records) == math.prod(distinct)


def sweep_chart(records: list[dict[str, Any]], keys: list[str], key: str, index: int, grid: bool):
    """Best val loss against `key`. In a grid, trials that agree on the other keys are joined by a
    line (one per combination, when there are few) and the tried values are the ticks; a random
    search is plain points on a 1-2-5 or log axis."""
    from kiln.report.charts import Chart, Series, format_number

    done = [r for r in records if r["status"] == "completed" and r.get("best_val_loss") is not None]
    values = [r["params"].get(key) for r in done]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    x_ticks = None
    if numeric:
        position = {v: v for v in values}
    else:  # categorical: one slot per distinct value, in first-seen order
        distinct = list(dict.fromkeys(json.dumps(v, sort_keys=True) for v in values))
        position = {d: float(i) for i, d in enumerate(distinct)}
        x_ticks = [(float(i), d.strip('"')) for i, d in enumerate(distinct)]
    if grid and numeric and 0 < len(set(values)) <= 8:  # tick exactly the values tried
        x_ticks = [(v, format_number(v)) for v in sorted(set(values))]

    def x_of(r: dict[str, Any]) -> float:
        v = r["params"].get(key)
        return position[v] if numeric else position[json.dumps(v, sort_keys=True)]

    others = [k for k in keys if k != key]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in done:
        groups.setdefault(", ".join(f"{k}={r['params'].get(k)}" for k in others) or "trials", []).append(r)
    if not grid or len(groups) > 8 or all(len(g) == 1 for g in groups.values()):
        series = [Series("trials", [x_of(r) for r in done], [r["best_val_loss"] for r in done], style="points",
                         radius=4.0)]
    else:
        series = []
        for name, members in groups.items():
            members = sorted(members, key=x_of)
            series.append(Series(name, [x_of(r) for r in members], [r["best_val_loss"] for r in members],
                                 style="line+points", width=2.0, radius=3.5))
    positive = numeric and values and min(values) > 0
    # integer ranges of a random search (warmup steps) stay linear; rates and grids of sizes go log
    log_x = bool(positive and max(values) / min(values) >= 10
                 and (grid or any(isinstance(v, float) for v in values)))
    return Chart(f"chart-sweep-{index}", f"best val loss vs {key}", series, x_label=key + (" (log)" if log_x else ""),
                 y_label="best val loss", log_x=log_x, x_ticks=x_ticks, x_pad=0.06)


def format_cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and abs(v) >= 100:
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.4f}".rstrip("0").rstrip(".")
    return str(v)

"""A run's metrics.jsonl read tolerantly (`read_metrics`) and its headline numbers (`summarize`).

One reader for every command that looks back at a run: the report page, the planner's calibration
and sweep, and `kiln train` on a finished run. Malformed lines (one cut short by a crash, a foreign
row) are skipped and listed, never fatal; train rows become numpy columns, so a million-step run
stays a few hundred MB.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import DataError

DEDUP_KINDS = ("eval", "checkpoint")  # a resumed run repeats steps after its checkpoint


TRAIN_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "memory_mb", "data_wait_ms",
              "skipped", "moe_max_load", "moe_aux_loss")


@dataclass
class RunMetrics:
    path: Path
    rows: dict[str, list[dict[str, Any]]]  # by kind except train; eval/checkpoint: last row per step, by step
    train: dict[str, np.ndarray]  # TRAIN_KEYS columns (float64, NaN where missing), last row per step, by step
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of malformed lines
    wall_s: float = 0.0  # summed over the run's segments (each `run` row starts one)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return self.rows.get(kind, [])

    @property
    def n_train(self) -> int:
        return len(self.train["step"])


def read_metrics(path: str | Path) -> RunMetrics:
    """Rows of a metrics.jsonl; malformed lines (e.g. one cut short by a crash) are skipped and
    listed. A missing file or one without a single valid row is a DataError. Train rows become
    columns: a million-step run stays a few hundred MB."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} not found; is {path.parent} a run directory written by `kiln train`?")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    train_by_step: dict[int, tuple] = {}
    skipped: list[str] = []
    segments: list[list[float]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                skipped.append(f"{path}:{number}: not valid JSON ({e.msg})")
                continue
            problem = _row_problem(row)
            if problem:
                skipped.append(f"{path}:{number}: {problem}")
                continue
            kind = row["kind"]
            if kind == "train":
                try:  # resumes repeat steps: the last row of a step wins
                    train_by_step[row["step"]] = _train_getter(row)
                except KeyError:  # an older or foreign row without some fields
                    train_by_step[row["step"]] = tuple(row.get(k) for k in TRAIN_KEYS)
            else:
                by_kind.setdefault(kind, []).append(row)
            if kind == "run" or not segments:
                segments.append([])
            t = row.get("time")
            if type(t) is float or (type(t) is int and t > 0):
                segments[-1].append(float(t))
    if not by_kind and not train_by_step:
        detail = f" ({len(skipped)} malformed lines; first: {skipped[0]})" if skipped else ""
        raise DataError(f"{path}: no metrics rows{detail}; expected JSON objects with 'kind' and 'step'")
    for kind in DEDUP_KINDS:
        if kind in by_kind:
            by_kind[kind] = sorted({r["step"]: r for r in by_kind[kind]}.values(), key=lambda r: r["step"])
    wall = sum(max(s) - min(s) for s in segments if s and math.isfinite(max(s) - min(s)))
    return RunMetrics(path, by_kind, _train_columns(sorted(train_by_step.values())), skipped, wall)


_train_getter = operator.itemgetter(*TRAIN_KEYS)


def _train_columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    try:
        table = np.array(rows, dtype=np.float64).reshape(len(rows), len(TRAIN_KEYS))  # None -> NaN
    except (TypeError, ValueError):  # a value of the wrong type somewhere: clean row by row
        table = np.array([[_number(v) for v in r] for r in rows], dtype=np.float64).reshape(len(rows), len(TRAIN_KEYS))
    return {key: table[:, i].copy() for i, key in enumerate(TRAIN_KEYS)}


def _number(v: Any) -> float:
    if isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, (int, float)) else math.nan


def _row_problem(row: Any) -> str:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if not isinstance(row.get("kind"), str):
        return "no 'kind' string"
    if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return "no integer 'step'"
    return ""


def finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _finite_values(column: np.ndarray) -> np.ndarray:
    return column[np.isfinite(column)]


def summarize(m: RunMetrics) -> dict[str, Any]:
    """Headline numbers (None where the run has no data for one)."""
    t = m.train
    losses = t["loss"][np.isfinite(t["loss"]) & (t["skipped"] != 1)]
    val = [r["val_loss"] for r in m.of("eval") if finite_number(r.get("val_loss"))]
    tps, mfu, mem = (_finite_values(t[k]) for k in ("tokens_per_s", "mfu", "memory_mb"))
    last_tokens = t["tokens"][-1] if m.n_train else math.nan
    steps = int(t["step"][-1]) if m.n_train else max((r["step"] for rs in m.rows.values() for r in rs), default=0)
    return {
        "steps": steps,
        "tokens": int(last_tokens) if math.isfinite(last_tokens) else None,
        "final_loss": float(losses[-1]) if losses.size else None,
        "best_loss": float(losses.min()) if losses.size else None,
        "final_val_loss": val[-1] if val else None,
        "best_val_loss": min(val) if val else None,
        "tokens_per_s_median": float(np.median(tps)) if tps.size else None,
        "mfu_median": float(np.median(mfu)) if mfu.size else None,
        "peak_memory_mb": float(mem.max()) if mem.size else None,
        "wall_time_s": m.wall_s,
        "skipped_steps": int((t["skipped"] == 1).sum()),
        "checkpoints": sum(1 for r in m.of("checkpoint") if r.get("ok", True)),  # failed saves are rows too
        "malformed_lines": len(m.skipped),
    }

"""Metrics are rows: one dict per step appended to metrics.jsonl, fanned out to the terminal
(a rich progress bar on a TTY, plain lines otherwise) and the sinks of kiln/train/metric_sinks.py
(TensorBoard, Weights & Biases offline) when enabled.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from kiln.config import MetricsConfig
from kiln.train.metric_sinks import open_sinks


class MetricsLogger:
    def __init__(self, path: Path, cfg: MetricsConfig, total_steps: int, start_step: int,
                 enabled: bool = True):
        self.enabled = enabled
        self.cfg = cfg
        self.total_steps = total_steps
        self.path = path
        self._file = _open_for_rows(path) if enabled else None
        self._write_failed = False
        mode = cfg.progress
        if mode == "auto":
            mode = "rich" if sys.stderr.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self._progress = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()
        self._sinks = open_sinks(cfg, path.parent, self.print) if enabled else []

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        elif self.mode != "none":
            print(message, file=sys.stderr, flush=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"time": time.time(), **row}
        self._append((json.dumps(row, allow_nan=True) + "\n").encode("utf-8"), row)
        kind, step = row.get("kind"), row.get("step", 0)
        for sink in self._sinks:
            sink.write(row)
        if kind == "train":
            info = (f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  "
                    f"mfu {100 * row['mfu']:.1f}%  wait {row['data_wait_ms']:.1f} ms")
            if self._progress is not None:
                self._progress.update(self._task, completed=step, info=info)
            elif self.mode == "plain" and (step % self.cfg.log_every == 0 or step == self.total_steps):
                print(f"step {step}/{self.total_steps}  {info}  gnorm {row['grad_norm']:.3f}  "
                      f"mem {row['memory_mb']:.0f} MB", file=sys.stderr, flush=True)
        elif kind == "eval":
            parts = [f"{k} {v:.4f}" for k, v in row.items() if k not in ("kind", "step", "time")
                     and isinstance(v, float) and math.isfinite(v)]
            self.print(f"eval @ step {step}: " + "  ".join(parts))
        elif kind in ("event", "checkpoint"):
            self.print(f"[{kind}] step {step}: {row.get('message') or row.get('path')}")

    def _append(self, data: bytes, row: dict[str, Any]) -> None:
        """Append one whole line or nothing: on a write error (disk full) the file is cut back to
        where the line began, a one-line warning is printed once, and training goes on."""
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # an unbuffered write may be partial
                view = view[self._file.write(view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            if not self._write_failed:
                self._write_failed = True
                reason = os.strerror(e.errno).lower() if e.errno else str(e)
                print(f"{self.path}: {row.get('kind')} row for step {row.get('step')} not written ({reason}); "
                      f"rows are dropped until writes succeed again", file=sys.stderr, flush=True)
            return
        self._write_failed = False

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for sink in self._sinks:
            sink.close()
        if self._file is not None:
            self._file.close()


def _open_for_rows(path: Path):
    """Open metrics.jsonl for appending whole lines (unbuffered: one write call per row). A half
    line at the end, left by a crash or a full disk in an older run, is cut off first so the
    next row starts on its own line."""
    f = open(path, "ab", buffering=0)
    size = os.lseek(f.fileno(), 0, os.SEEK_END)
    if size:
        with open(path, "rb") as r:
            r.seek(max(0, size - (1 << 20)))
            tail = r.read()
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n")
            os.ftruncate(f.fileno(), size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= len(tail) else size))
    return f

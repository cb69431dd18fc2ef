"""Helpers shared by the training benchmarks: machine facts, the matmul peak probe, results files."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kiln.train.peak import cpu_matmul_peak

RESULTS_DIR = Path(__file__).parent / "results"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:  # /proc/cpuinfo names the CPU model; platform.processor() is often just "x86_64"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores_visible": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "mkldnn_bf16_native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], seconds: float) -> dict[str, Any]:
    """Best FLOP/s over several square sizes: kiln's probe at one size can sit below the kernel's
    best (cache blocking favours some sizes), and MFU against a low peak would flatter us."""
    by_size = {n: cpu_matmul_peak(dtype, n=n, seconds=seconds) for n in sizes}
    best_n = max(by_size, key=by_size.get)
    return {"flops": by_size[best_n], "best_n": best_n,
            "by_size_gflops": {str(n): round(f / 1e9, 2) for n, f in by_size.items()}}


def train_in_child(overrides: list[str], run_dir: str) -> None:
    """Process target: one `kiln train` run. Lives here, not in a script, so that spawned children
    can import it (spawn passes the parent's sys.path, which holds benchmarks/)."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    train(load_config(None, overrides), run_dir, resume=False)


def free_port() -> int:
    """A TCP port free on this host now, for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write results/NAME.json, or to NAME itself when it is a path ending in .json (tests)."""
    path = Path(name) if name.endswith(".json") else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine_info(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)

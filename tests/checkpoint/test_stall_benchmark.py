"""Keep benchmarks/checkpoint_stall.py runnable (its --quick mode; the figures are noise here)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_stall.py"


@pytest.mark.timeout(120)
def test_stall_benchmark_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_checkpoint_stall", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = module.main(["--quick", "--dir", str(tmp_path)])
    row = out["sizes"]["1M"]
    assert row["sync_block_s"] > 0 and row["async_block_s"] > 0 and row["async_background_s"] > 0
    assert all(run["size_bytes"] > row["state_bytes"] for run in row["runs"]["sync"])  # state + manifest'd extras

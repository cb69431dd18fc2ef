"""kill -9 during training and inside a save: the resume continues from the newest complete
checkpoint with the uninterrupted run's per-step losses (benchmarks/checkpoint_faults.py runs 20+)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_faults.py"


def _faults():
    spec = importlib.util.spec_from_file_location("bench_checkpoint_faults", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
def test_kill9_trials_resume_exactly(tmp_path, text_file):
    faults = _faults()
    ref = faults.reference(tmp_path, text_file)
    rng = random.Random(1)
    results = [faults.trial(tmp_path, text_file, i, mode, rng, ref)
               for i, mode in enumerate(["step", "save"])]
    for r in results:
        assert r["ok"], r
    assert results[0]["killed"]  # the step-kill always lands; a save-kill may miss a fast save

"""The trainer warns when the step waits on data for more than data.wait_warn_fraction of its time."""

import json
import time

from conftest import tiny_overrides
from kiln.config import load_config
from kiln.data.loader import Loader
from kiln.train.trainer import train


def events(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["message"] for r in rows if r.get("kind") == "event"]


def test_slow_loader_warns_and_fast_one_does_not(tmp_path, text_file, monkeypatch):
    # a tiny CPU model's step is a few ms, so scheduling noise on a busy machine is a real share of
    # it: the threshold here is 50%, and the slow loader waits ~20x longer than a step takes
    over = {"train.steps": 6, "train.eval_every": 0, "checkpoint.every": 0, "metrics.log_every": 2,
            "data.wait_warn_fraction": 0.5}
    train(load_config(None, tiny_overrides(text_file, **over)), tmp_path / "fast")
    assert not [m for m in events(tmp_path / "fast") if "data wait" in m]

    make = Loader._make
    monkeypatch.setattr(Loader, "_make", lambda self, idx: (time.sleep(0.2), make(self, idx))[1])
    train(load_config(None, tiny_overrides(text_file, **over)), tmp_path / "slow")
    warned = [m for m in events(tmp_path / "slow") if "data wait" in m]
    assert len(warned) == 1 and "data.wait_warn_fraction=0.5" in warned[0]  # once, not every window

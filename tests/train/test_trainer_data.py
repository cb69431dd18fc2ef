"""The trainer's data side: the data-wait warning, training on a mixture of shard directories."""

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


def test_trains_on_a_mixture_and_logs_the_realized_mix(tmp_path, text_file):
    from kiln.data.raw_to_shards import prepare_shards

    over = {"train.steps": 3, "train.eval_every": 0, "checkpoint.every": 0, "metrics.log_every": 3}
    cfg = load_config(None, tiny_overrides(text_file, **over))
    cfg.data.shards_dir = str(tmp_path / "shards")
    prepare_shards(cfg.data, tmp_path)
    cfg.data.mixture, cfg.data.mixture_weights = [cfg.data.shards_dir] * 2, [0.75, 0.25]
    train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mix = [r for r in rows if r.get("kind") == "mixture"]
    assert len(mix) == 1 and mix[0]["mix0_tokens"] + mix[0]["mix1_tokens"] == 3 * 4 * 32
    assert mix[0]["mix0_tokens"] > mix[0]["mix1_tokens"] > 0

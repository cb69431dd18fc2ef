"""Fake `kiln train` run directories for the calibration tests (test_plan_command, test_collectives)."""

import json
from pathlib import Path


def write_calibration_runs(tmp_path: Path, truth, sizes) -> list[str]:
    """Single-process fp32 run directories (config.toml + metrics.jsonl) whose tokens/s are what
    `truth` predicts for each (dim, micro_batch) in `sizes`: what `kiln plan --calibrate` reads."""
    from kiln.config import load_config, to_toml
    from kiln.plan.calibrate import Measurement, predicted_step
    from kiln.plan.memory import Layout, ModelShape

    runs = []
    for i, (dim, mb) in enumerate(sizes):
        cfg = load_config(None, [f"model.dim={dim}", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=300",
                                 f"train.batch_size={mb}", "data.seq_len=64", "model.max_seq_len=64",
                                 "train.dtype=fp32"])
        lay = Layout(micro_batch=mb, precision="fp32")
        step = predicted_step(Measurement("x", ModelShape.from_config(cfg.model, 300), lay, 64, 1.0), truth)
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "config.toml").write_text(to_toml(cfg))
        rows = [{"kind": "run", "step": 0, "world_size": 1, "dp_mode": "none", "dp_replicate": 1, "dp_shard": 1,
                 "tokens_per_step": mb * 64, "dtype": "fp32"}]
        rows += [{"kind": "train", "step": s, "loss": 5.0, "lr": 1e-3, "tokens": s * mb * 64,
                  "tokens_per_s": mb * 64 / step, "skipped": 0} for s in range(1, 4)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        runs.append(str(run))
    return runs


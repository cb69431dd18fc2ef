"""Loop stall per checkpoint: synchronous DCP save vs kiln's asynchronous save of the same state.

For each model size, builds kiln's Transformer with AdamW state (one optimizer step on random
gradients, so exp_avg/exp_avg_sq exist), then saves it through `kiln.checkpoint.CheckpointManager`
alternately with `async_save=False` (the loop blocks for staging + write + fsync + manifest +
rename) and `async_save=True` (the loop blocks for `dcp.async_save`'s copy to host memory; the rest
runs in a background thread and is timed as `background_s`). Each async save is waited for before
the next save starts, so the two never overlap. Reports the median block time per mode and the
ratio async/sync (target <= 10%).

    python benchmarks/checkpoint_stall.py [--sizes 10M,100M,400M] [--rounds 2] [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from common import RESULTS_DIR, machine_info, median  # noqa: E402

from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState, RNGState  # noqa: E402
from kiln.config import ModelConfig, OptimConfig  # noqa: E402
from kiln.model.transformer import Transformer, count_params  # noqa: E402
from kiln.train.optim import build_optimizer  # noqa: E402

# dim, layers, heads, vocab: ~params with tied embeddings (GPT-2 124M is dim 768, 12 layers, 50257).
SIZES = {
    "1M": (128, 2, 4, 4096),
    "10M": (384, 4, 6, 8192),
    "100M": (768, 12, 12, 16384),
    "124M": (768, 12, 12, 50257),
    "400M": (1280, 18, 16, 32768),
}


def build_state(size: str, device: torch.device) -> tuple[dict, int, int]:
    dim, layers, heads, vocab = SIZES[size]
    cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=heads, vocab_size=vocab, max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights()
    optimizer = build_optimizer(model, OptimConfig(name="adamw"), device.type)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # + exp_avg, exp_avg_sq
    return ({"app": ModelOptimizerState(model, optimizer), "rng": RNGState()},
            count_params(model)["total"], state_bytes)


def one_save(mgr: CheckpointManager, states: dict, step: int) -> dict:
    t0, c0 = time.perf_counter(), time.thread_time()
    results = mgr.save(step, states)
    loop_blocked = time.perf_counter() - t0  # what the training loop waits for
    loop_cpu = time.thread_time() - c0  # the loop thread's CPU time: less inflated by a busy machine
    results += mgr.wait()
    [result] = results
    if not result.ok:
        raise SystemExit(result.error)
    return {"block_s": loop_blocked, "block_cpu_s": loop_cpu, "manager_block_s": result.block_s, "background_s": result.background_s,
            "size_bytes": result.size_bytes}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10M,100M,400M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", help="where to write checkpoints (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="1M model, one round (smoke test)")
    args = ap.parse_args(argv)
    sizes = ["1M"] if args.quick else args.sizes.split(",")
    rounds = 1 if args.quick else args.rounds
    device = torch.device(args.device)
    out = {"command": " ".join(sys.argv), "machine": machine_info(), "device": str(device), "sizes": {}}
    if device.type == "cuda":
        out["machine"]["gpu"] = torch.cuda.get_device_name()
    print(f"{'size':>6} {'params':>8} {'state GB':>8} {'sync block s':>12} {'async block s':>13} "
          f"{'async bg s':>10} {'ratio':>6} {'sync cpu s':>10} {'async cpu s':>11} {'cpu ratio':>9}")
    for size in sizes:
        states, n_params, state_bytes = build_state(size, device)
        runs = {"sync": [], "async": []}
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            root = Path(tmp) / "checkpoints"
            managers = {mode: CheckpointManager(root, keep_last=1, async_save=mode == "async", make_room=False)
                        for mode in runs}  # one per mode, kept: the async one reuses its staging buffers
            step = 0
            for r in range(rounds + 1):  # round 0 warms up both paths (imports, page cache, pinned buffers)
                for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                    step += 1
                    timing = one_save(managers[mode], states, step)
                    if r:
                        runs[mode].append(timing)
            for mgr in managers.values():
                mgr.close()
            shutil.rmtree(root, ignore_errors=True)
        sync_block = median([t["block_s"] for t in runs["sync"]])
        async_block = median([t["block_s"] for t in runs["async"]])
        async_bg = median([t["background_s"] for t in runs["async"]])
        ratio = async_block / sync_block
        sync_cpu = median([t["block_cpu_s"] for t in runs["sync"]])
        async_cpu = median([t["block_cpu_s"] for t in runs["async"]])
        print(f"{size:>6} {n_params / 1e6:>7.1f}M {state_bytes / 1e9:>8.2f} {sync_block:>12.3f} "
              f"{async_block:>13.3f} {async_bg:>10.3f} {100 * ratio:>5.1f}% {sync_cpu:>10.3f} {async_cpu:>11.3f} "
              f"{100 * async_cpu / sync_cpu:>8.1f}%", flush=True)
        out["sizes"][size] = {"params": n_params, "state_bytes": state_bytes, "runs": runs,
                              "sync_block_s": sync_block, "async_block_s": async_block,
                              "async_background_s": async_bg, "async_over_sync": ratio,
                              "sync_block_cpu_s": sync_cpu, "async_block_cpu_s": async_cpu}
        del states
    if not args.quick:
        RESULTS_DIR.mkdir(exist_ok=True)
        name = "checkpoint_stall" + ("" if device.type == "cpu" else f"_{device.type}") + ".json"
        (RESULTS_DIR / name).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

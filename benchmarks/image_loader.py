"""Image-text preprocessing: CPU DataLoader workers vs the device path, and the stall each leaves.

Generates a sample (`kiln.data.image_sample.write_sample_shards`: JPEG and PNG, sides drawn from
[--min-side, --max-side]) in a temporary directory, then for R rounds times every configuration -
mode "cpu" (workers decode, resize, crop, normalize) and mode "device" (workers read and tokenize,
the main process decodes and transforms on --device) with each worker count - through
`kiln.data.stall_image.time_loader`, warm and with the page cache dropped (cold). Configurations
are interleaved within a round (the order rotates each round) and the medians over rounds are
reported, with images/s and the ratio to the baseline (cpu, 0 workers: one process doing it all).
The stall each configuration leaves beside a step of each --step-ms is `stall_image.step_time`'s
model (see that module).

    python benchmarks/image_loader.py [--images 256] [--batch 32] [--size 128] [--workers 0,1,2]
                                      [--rounds 3] [--batches 6] [--step-ms 50,200] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR, machine_info, median  # noqa: E402

from kiln.data.image_sample import write_sample_shards  # noqa: E402
from kiln.data.image_ops import ImageSpec, torchvision_io  # noqa: E402
from kiln.data.image_text import TarIndex  # noqa: E402
from kiln.data.stall_image import step_time, time_loader  # noqa: E402
from kiln.data.tokenizer import ByteTokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--min-side", type=int, default=160)
    ap.add_argument("--max-side", type=int, default=320)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--step-ms", default="50,200")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the main process (workers use 1): on a shared machine more threads "
                         "spin against other jobs and make the main-process paths look far slower")
    ap.add_argument("--out", default=str(RESULTS_DIR / "image_loader.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workers = [int(w) for w in args.workers.split(",")]
    steps = [float(s) / 1e3 for s in args.step_ms.split(",")]
    configs = [(m, w) for m in ("cpu", "device") for w in workers]
    kw = {"batch_size": args.batch, "spec": ImageSpec(size=args.size), "caption_len": 32, "device": args.device}
    times: dict[tuple[str, int], dict[str, list[float]]] = {c: {"warm": [], "cold": [], "main": []} for c in configs}
    with tempfile.TemporaryDirectory(prefix="kiln-image-bench-") as tmp:
        write_sample_shards(tmp, n=args.images, shards=args.shards, min_side=args.min_side, max_side=args.max_side)
        index = TarIndex(tmp, log=lambda _m: None)
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for mode, w in order:
                for cold in (False, True):
                    t = time_loader(index, ByteTokenizer(), mode=mode, workers=w, batches=args.batches, cold=cold, **kw)
                    times[(mode, w)]["cold" if cold else "warm"].append(t["batch_s"])
                    if cold:
                        times[(mode, w)]["main"].append(t["main_s"])
                print(f"round {r}: {mode} {w} worker(s) warm {times[(mode, w)]['warm'][-1] * 1e3:.1f} ms/batch, "
                      f"cold {times[(mode, w)]['cold'][-1] * 1e3:.1f}", flush=True)
    base = median(times[("cpu", 0)]["warm"])
    rows = []
    for mode, w in configs:
        t = {k: median(v) for k, v in times[(mode, w)].items()}
        row = {"mode": mode, "workers": w, "warm_ms_per_batch": round(t["warm"] * 1e3, 2),
               "cold_ms_per_batch": round(t["cold"] * 1e3, 2), "main_ms_per_batch": round(t["main"] * 1e3, 2),
               "images_per_s_warm": round(args.batch / t["warm"], 1), "speedup_vs_cpu0": round(base / t["warm"], 2)}
        for c in steps:
            step = step_time(c, t["cold"], t["main"], w)
            row[f"stall_at_{c * 1e3:g}ms"] = round((step - c) / step, 3)
        rows.append(row)
    out = {"machine": machine_info(), "args": vars(args), "decoder": "torchvision" if torchvision_io() else "pillow",
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()

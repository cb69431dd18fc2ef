"""Where a GPU step's time goes: torch.profiler over a few steps of the nanoGPT-style baseline and
of kiln's step (GPT-2 architecture and kiln's default architecture) at GPT-2 124M shapes, compiled,
bf16. Prints per case the device time per step (sum of kernel times), the wall time per step, and
the kernels with the most device time per step, so the gap between kiln and the baseline is read
off kernels, not guessed.

    python benchmarks/gpu_profile.py [--device cuda] [--steps 5] [--top 15] [--json OUT.json]

`--device cpu --quick` is a dry run at toy sizes (CPU op times instead of kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_throughput import _release, baseline_case, gpt2_style, kiln_case, shapes  # noqa: E402


def profile_case(step, device: torch.device, steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(5):  # compile and settle
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(5 + i)
    sync()
    wall = (time.perf_counter() - t0) / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            step(10 + i)
        sync()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if device.type == "cuda":  # kernels only: CPU-side ops also carry device time of their children
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return {"wall_ms": 1000 * wall, "device_ms": total / 1000 / steps,
            "top": [{"name": e.key[:90], "ms_per_step": getattr(e, attr) / 1000 / steps,
                     "calls_per_step": e.count / steps} for e in events[:top]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    g = shapes(args.quick)["gpt2-124m"]
    cases = {
        "nanoGPT baseline compiled": lambda: baseline_case(g, device, True),
        "kiln gpt2-arch compiled": lambda: kiln_case(g, gpt2_style(g.model), device, compile_model=True, loss="full"),
        "kiln default compiled": lambda: kiln_case(g, g.model, device, compile_model=True, loss="full"),
    }
    out = {}
    for name, build in cases.items():
        step = build()[0]
        out[name] = profile_case(step, device, args.steps, args.top)
        r = out[name]
        print(f"== {name}: wall {r['wall_ms']:.2f} ms/step, device busy {r['device_ms']:.2f} ms/step", flush=True)
        for k in r["top"]:
            print(f"  {k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  {k['name']}", flush=True)
        del step
        _release(device)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time one MoE layer's forward + backward: the sync-free grouped-matmul path (`F.grouped_mm`
with device offsets, what kiln/model/moe.py runs where torch takes it) against the loop over
experts with host-read split sizes (what it ran before, and still runs where grouped_mm does
not). Both paths run in interleaved rounds so load from other processes hits them alike; each
figure is the median over rounds. The outputs of the two paths are checked equal first.

    python benchmarks/moe_forward.py [--rounds 7] [--device cpu] [--dtype fp32]

Prints a table and writes benchmarks/results/moe_forward.json. On CPU a host read costs nothing
(no device queue to drain), so this measures the kernels only; on a GPU the loop also stalls the
host once per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from common import median, print_table, timed, write_results  # noqa: E402

from kiln.config import ModelConfig  # noqa: E402
from kiln.model import moe as moe_module  # noqa: E402
from kiln.model.transformer import ffn_hidden_size  # noqa: E402

CASES = {  # name -> MoE fields; model dim 256, 8 experts, batch 8 x 256 tokens
    "switch top-1, capacity 1.25": dict(moe_top_k=1, moe_capacity_factor=1.25),
    "gshard top-2, dropless": dict(moe_top_k=2, moe_capacity_factor=0.0),
}


def build(fields: dict, device: str, dtype: torch.dtype) -> moe_module.MoE:
    cfg = ModelConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, max_seq_len=256, moe_experts=8, **fields)
    layer = moe_module.MoE(cfg, ffn_hidden_size(cfg))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return layer.to(device=device, dtype=dtype)


def step(layer, x, grouped: bool, device: str) -> torch.Tensor:
    with mock.patch.object(moe_module, "grouped_mm_runs", lambda *a: grouped):
        out = layer(x)
        out.float().square().mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return out.detach()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", default="moe_forward")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    x = torch.randn(8, 256, 256, generator=torch.Generator().manual_seed(1)).to(args.device, dtype)
    rows, results = [], {}
    for name, fields in CASES.items():
        layer = build(fields, args.device, dtype)
        if not moe_module.grouped_mm_runs(x.view(-1, 256), layer.experts.w1):
            print(f"{name}: torch's grouped matmul does not take {args.dtype} on {args.device}; skipped")
            continue
        torch.testing.assert_close(step(layer, x, True, args.device), step(layer, x, False, args.device),
                                   rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-5)
        times = {"grouped_mm": [], "loop": []}
        for _ in range(args.rounds):  # interleaved: both paths in every round
            for path in times:
                times[path].append(timed(lambda: step(layer, x, path == "grouped_mm", args.device))[0])
        med = {p: median(t) for p, t in times.items()}
        paired = [g / lp for g, lp in zip(times["grouped_mm"], times["loop"])]  # same round, same load
        results[name] = {"median_ms": {p: 1000 * m for p, m in med.items()},
                         "all_ms": {p: [round(1000 * t, 2) for t in ts] for p, ts in times.items()},
                         "grouped_over_loop_paired_median": median(paired),
                         "grouped_over_loop_paired_range": [min(paired), max(paired)]}
        rows.append([name, 1000 * med["loop"], 1000 * med["grouped_mm"], median(paired),
                     f"{min(paired):.2f}-{max(paired):.2f}"])
    print_table(["case", "loop ms", "grouped_mm ms", "grouped / loop (paired median)", "range"], rows)
    print(write_results(args.out, {"device": args.device, "dtype": args.dtype, "rounds": args.rounds,
                                   "shape": "B=8, T=256, dim=256, E=8", "cases": results}))


if __name__ == "__main__":
    main()

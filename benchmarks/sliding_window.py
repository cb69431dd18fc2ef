"""Sliding-window attention: kiln's blocked attention (kiln/model/transformer.py
`sliding_window_attention`: blocks of W queries against their own and the previous block's keys)
against SDPA with the dense (T, T) window mask (`window_mask`), and against plain causal SDPA (no
window: what the window saves).

Per case (batch, heads, sequence T, head width, window W), fp32 on CPU: the bytes autograd saves
for backward (distinct storages, `saved_tensors_hooks`) and the wall time of forward + backward
(best of --repeats, after one warm-up), the ways alternating. The blocked result must equal the
dense-mask result (forward, atol 1e-5) or the benchmark fails.

    python benchmarks/sliding_window.py [--cases 2x4x1024x64w256,1x8x4096x64w512,...] [--repeats 3]

Writes benchmarks/results/sliding_window.json and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402
from kiln.model.transformer import sliding_window_attention, window_mask  # noqa: E402

CASES = "2x4x1024x64w256,1x8x4096x64w512,1x8x4096x64w2048,1x8x8192x64w1024"


def parse(case: str) -> tuple[int, int, int, int, int]:
    shape, window = case.split("w")
    b, h, t, d = (int(x) for x in shape.split("x"))
    return b, h, t, d, int(window)


def ways(window: int, seq: int):
    dense_mask = window_mask(torch.arange(seq), seq, window)
    return {"blocked": lambda q, k, v: sliding_window_attention(q, k, v, window),
            "dense_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask),
            "causal_no_window": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}


def saved_bytes(fn, q, k, v) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return sum(storages.values())


def measure(case: str, repeats: int) -> dict:
    b, h, t, d, w = parse(case)
    g = torch.Generator().manual_seed(0)
    # (B, T, H, D) transposed to (B, H, T, D): the strides the model's attention hands SDPA
    q, k, v = (torch.randn(b, t, h, d, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
    fns = ways(w, t)
    with torch.no_grad():
        error = (fns["blocked"](q, k, v) - fns["dense_mask"](q, k, v)).abs().max().item()
    if error > 1e-5:
        raise SystemExit(f"sliding_window {case}: blocked differs from the dense mask by {error}")
    row = {"case": case, "batch": b, "heads": h, "seq": t, "head_dim": d, "window": w, "max_abs_diff": error}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        row[f"{name}_saved_bytes"] = saved_bytes(fn, q, k, v)
        fn(q, k, v).sum().backward()  # warm-up
    for r in range(repeats):
        for name, fn in (fns.items() if r % 2 == 0 else reversed(list(fns.items()))):
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            fn(q, k, v).sum().backward()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        row[f"{name}_s"], row[f"{name}_s_all"] = min(ts), ts
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="BxHxTxDwW, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="sliding_window")
    args = ap.parse_args(argv)
    rows = [measure(case, args.repeats) for case in args.cases.split(",")]
    mib = 2**20
    print_table(["B x H x T x D", "window", "saved MiB blocked / dense / causal", "s blocked / dense / causal"],
                [[f"{r['batch']}x{r['heads']}x{r['seq']}x{r['head_dim']}", r["window"],
                  " / ".join(f"{r[f'{n}_saved_bytes'] / mib:.1f}" for n in ("blocked", "dense_mask", "causal_no_window")),
                  " / ".join(f"{r[f'{n}_s']:.3f}" for n in ("blocked", "dense_mask", "causal_no_window"))]
                 for r in rows])
    command = "python benchmarks/sliding_window.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'torch_threads': torch.get_num_threads(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

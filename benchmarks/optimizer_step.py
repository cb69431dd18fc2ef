"""Time one optimizer step on the parameter set of a ~17M-parameter transformer.

Answers: is torch's fused AdamW faster than its foreach AdamW on this device (what
`optim.implementation=auto` should pick, kiln.train.optim.FUSED_ADAMW_FASTER), and what each
optimizer's step costs relative to foreach AdamW. Implementations are timed in interleaved rounds
so load from other processes hits them alike; each figure is the median over rounds.

    python benchmarks/optimizer_step.py [--rounds 5] [--device cpu]

Prints a table and writes benchmarks/results/optimizer_step.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from torch import nn
from torch.utils.benchmark import Timer

from kiln.config import OptimConfig
from kiln.train.optim import FUSED_ADAMW_FASTER, adamw_implementation, build_optimizer

RESULTS = Path(__file__).parent / "results" / "optimizer_step.json"


class ShapeOnlyTransformer(nn.Module):
    """The parameters (names, shapes, module types) of a Llama-style decoder, without forward:
    an optimizer step only sees parameters, and this keeps the benchmark independent of
    kiln.model. Defaults give 17.3M parameters (vocab 4096, dim 384, 8 layers, SwiGLU 1024)."""

    def __init__(self, vocab: int = 4096, dim: int = 384, layers: int = 8, hidden: int = 1024):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.attention = nn.ModuleDict({k: nn.Linear(dim, dim, bias=False) for k in ("wq", "wk", "wv", "wo")})
            block.feed_forward = nn.ModuleDict({
                "w1": nn.Linear(dim, hidden, bias=False),
                "w2": nn.Linear(hidden, dim, bias=False),
                "w3": nn.Linear(dim, hidden, bias=False),
            })
            block.attention_norm = nn.RMSNorm(dim)
            block.ffn_norm = nn.RMSNorm(dim)
            self.layers.append(block)
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


CASES = [  # (optimizer name, implementation); the first is the baseline of the ratio column
    ("adamw", "foreach"),
    ("adamw", "fused"),
    ("adamw", "single"),
    ("sgd", "auto"),
    ("lion", "auto"),
    ("lamb", "auto"),
    ("adafactor", "auto"),
    ("muon", "auto"),
]


def make_case(name: str, impl: str, device: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ShapeOnlyTransformer().to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_optimizer(model, OptimConfig(name=name, implementation=impl, lr=1e-3), device)
    opt.step()  # allocate state outside the timing
    return model, opt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per case per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    device_type = torch.device(args.device).type
    cases = [(n, i) for n, i in CASES if not (i == "fused" and device_type not in ("cpu", "cuda"))]
    built = {case: make_case(*case, device=args.device) for case in cases}
    n_params = sum(p.numel() for p in built[cases[0]][0].parameters())
    samples: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            opt = built[case][1]
            sync = "torch.cuda.synchronize()" if device_type == "cuda" else "pass"
            timer = Timer(stmt=f"opt.step(); {sync}", globals={"opt": opt, "torch": torch})
            samples[case].append(timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e3)

    median = {case: statistics.median(v) for case, v in samples.items()}
    baseline = median[cases[0]]
    rows = []
    print(f"optimizer step, {n_params / 1e6:.1f}M params, device={args.device}, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'optimizer':<10} {'impl':<8} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'x adamw-foreach':>16}")
    for case in cases:
        v = samples[case]
        ratio = median[case] / baseline
        print(f"{case[0]:<10} {case[1]:<8} {median[case]:>10.2f} {min(v):>8.2f} {max(v):>8.2f} {ratio:>16.2f}")
        rows.append({"optimizer": case[0], "implementation": case[1], "median_ms": round(median[case], 3),
                     "min_ms": round(min(v), 3), "max_ms": round(max(v), 3),
                     "time_vs_adamw_foreach": round(ratio, 3)})

    fused_speedup = median[("adamw", "foreach")] / median[("adamw", "fused")]
    fused_faster = fused_speedup > 1.0
    params = list(built[cases[0]][0].parameters())
    auto_pick = adamw_implementation(OptimConfig(implementation="auto"), params, device_type)
    print(f"fused AdamW speedup over foreach: {fused_speedup:.2f}x -> fused is "
          f"{'faster' if fused_faster else 'slower'}; auto picks {auto_pick!r}")
    agrees = FUSED_ADAMW_FASTER.get(device_type) == fused_faster
    if not agrees:
        print(f"NOTE: kiln.train.optim.FUSED_ADAMW_FASTER[{device_type!r}] = "
              f"{FUSED_ADAMW_FASTER.get(device_type)} disagrees with this measurement")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "optimizer_step",
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "params": n_params,
        "rounds": args.rounds,
        "results": rows,
        "adamw_fused_speedup_over_foreach": round(fused_speedup, 3),
        "fused_faster": fused_faster,
        "auto_picks": auto_pick,
        "auto_table_agrees": agrees,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time one optimizer step on the parameter set of a ~17M-parameter transformer.

Answers: is torch's fused AdamW faster than its foreach AdamW on this device (what
`optim.implementation=auto` should pick, kiln.train.optim.FUSED_ADAMW_FASTER), and what each
optimizer's step costs relative to foreach AdamW. Implementations are timed in interleaved rounds
so load from other processes hits them alike; each figure is the median over rounds.

Second table (`--skip-check`, on by default): what skipping a non-finite step on the device
costs. For each optimizer that honours `found_inf` (kiln.train.step.skips_on_device), the
device-masked step (`found_inf` set, as train_step's step_unless does) against the host-checked
step it replaced (`bool(skipped)` then a plain step()), in paired rounds (the two alternate
within a round, their order flipping every round); the ratio is the median of the per-round
ratios. With `--baseline-ref REF` the host-checked side runs the optimizer classes as they were
at git commit REF (kiln/train/optimizers/{lion,lamb,muon}.py read with `git show`), so the
comparison is against the previous code, not only against the new code without a mask.

    python benchmarks/optimizer_step.py [--rounds 5] [--device cpu] [--baseline-ref REF]

Prints a table and writes benchmarks/results/optimizer_step.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.utils.benchmark import Timer

import kiln.train.optim
from kiln.config import OptimConfig
from kiln.train.optim import FUSED_ADAMW_FASTER, adamw_implementation, build_optimizer
from kiln.train.step import skips_on_device

RESULTS = Path(__file__).parent / "results" / "optimizer_step.json"
SKIP_RESULTS = Path(__file__).parent / "results" / "optimizer_step_skip.json"  # --only-skip-check


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


def make_case(name: str, impl: str, device: str, seed: int = 0, classes: dict | None = None):
    """Model with random gradients and its optimizer, state allocated; `classes` replaces kiln's
    optimizer classes (name -> class) for the build, e.g. a baseline commit's."""
    torch.manual_seed(seed)
    model = ShapeOnlyTransformer().to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    with ExitStack() as stack:
        for attr, cls in (classes or {}).items():
            stack.enter_context(mock.patch.object(kiln.train.optim, attr, cls))
        opt = build_optimizer(model, OptimConfig(name=name, implementation=impl, lr=1e-3), device)
    opt.step()  # allocate state outside the timing
    return model, opt


BASELINE_MODULES = {"Lion": "lion", "Lamb": "lamb", "Muon": "muon"}


def baseline_classes(ref: str, workdir: Path) -> dict:
    """kiln's optimizer classes as they were at git commit `ref` (they import the current
    kiln.train.optimizers.adam_state, which on the CPU keeps the same state as before)."""
    classes = {}
    for cls, module in BASELINE_MODULES.items():
        src = subprocess.run(["git", "show", f"{ref}:kiln/train/optimizers/{module}.py"], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).parent).stdout
        path = workdir / f"baseline_{module}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"baseline_{module}", path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        classes[cls] = getattr(loaded, cls)
    return classes


def time_skip_check(cases, args, device_type: str) -> list[dict]:
    """Paired rounds: the host-checked step (baseline classes if given) vs the device-masked step."""
    sync = "torch.cuda.synchronize()" if device_type == "cuda" else "pass"
    with tempfile.TemporaryDirectory() as tmp:
        classes = baseline_classes(args.baseline_ref, Path(tmp)) if args.baseline_ref else None
        pairs = {}
        for case in cases:
            host_opt = make_case(*case, device=args.device, classes=classes)[1]
            masked_opt = make_case(*case, device=args.device)[1]
            if skips_on_device(masked_opt):
                pairs[case] = (host_opt, masked_opt)
        flag = torch.zeros((), dtype=torch.bool, device=args.device)  # "not skipped", on the device
        stmts = {"host": f"if not bool(flag): opt.step()\n{sync}",
                 "device": f"opt.found_inf = found_inf; opt.step(); opt.found_inf = None; {sync}"}
        samples = {case: {"host": [], "device": []} for case in pairs}
        for round_ in range(args.rounds):
            for case, (host_opt, masked_opt) in pairs.items():
                order = ("host", "device") if round_ % 2 == 0 else ("device", "host")
                for side in order:
                    opt = host_opt if side == "host" else masked_opt
                    timer = Timer(stmt=stmts[side], globals={"opt": opt, "torch": torch, "flag": flag,
                                                             "found_inf": flag.float()})
                    samples[case][side].append(timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e3)
    rows = []
    baseline = f"commit {args.baseline_ref}" if args.baseline_ref else "current code, no found_inf"
    print(f"non-finite check: host (bool(skipped), {baseline}) vs device (found_inf mask); "
          f"paired rounds, ratio = median of per-round device/host")
    print(f"{'optimizer':<10} {'impl':<8} {'host ms':>9} {'device ms':>10} {'device/host':>12} {'range':>13}")
    for case, s in samples.items():
        ratios = [d / h for d, h in zip(s["device"], s["host"])]
        row = {"optimizer": case[0], "implementation": case[1],
               "host_checked_median_ms": round(statistics.median(s["host"]), 3),
               "device_masked_median_ms": round(statistics.median(s["device"]), 3),
               "device_over_host_median": round(statistics.median(ratios), 3),
               "device_over_host_min": round(min(ratios), 3), "device_over_host_max": round(max(ratios), 3)}
        rows.append(row)
        print(f"{case[0]:<10} {case[1]:<8} {row['host_checked_median_ms']:>9.2f} {row['device_masked_median_ms']:>10.2f} "
              f"{row['device_over_host_median']:>12.2f} {min(ratios):>6.2f}-{max(ratios):<6.2f}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per case per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--baseline-ref", default=None,
                        help="git commit whose Lion/LAMB/Muon the host-checked side runs (default: current code)")
    parser.add_argument("--only-skip-check", action="store_true", help="time only the second table")
    parser.add_argument("--optimizers", default="", help="comma-separated optimizer names to time (default: all)")
    args = parser.parse_args()

    device_type = torch.device(args.device).type
    cases = [(n, i) for n, i in CASES if not (i == "fused" and device_type not in ("cpu", "cuda"))]
    if args.optimizers:
        wanted = set(args.optimizers.split(","))
        cases = [c for c in cases if c[0] in wanted or c == CASES[0]]  # the ratio baseline stays
    skip_rows = time_skip_check(cases, args, device_type)
    if args.only_skip_check:
        write_results({"benchmark": "optimizer_step", **machine(args), "skip_check": skip_rows,
                       "baseline_ref": args.baseline_ref}, SKIP_RESULTS)
        return 0
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

    write_results({
        "benchmark": "optimizer_step", **machine(args),
        "params": n_params,
        "results": rows,
        "adamw_fused_speedup_over_foreach": round(fused_speedup, 3),
        "fused_faster": fused_faster,
        "auto_picks": auto_pick,
        "auto_table_agrees": agrees,
        "skip_check": skip_rows,
        "baseline_ref": args.baseline_ref,
    }, RESULTS)
    return 0


def machine(args) -> dict:
    return {"device": args.device, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "rounds": args.rounds,
            "command": " ".join(["python", *sys.argv]), "load_average_at_end": os.getloadavg()[0]}


def write_results(payload: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())

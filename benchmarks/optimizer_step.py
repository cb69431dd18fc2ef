"""Time one optimizer step on the parameter set of a ~17M-parameter transformer.

Answers: is torch's fused AdamW faster than its foreach AdamW on this device (what
`optim.implementation=auto` should pick, kiln.train.optim.FUSED_ADAMW_FASTER), and what each
optimizer's step costs relative to foreach AdamW. Implementations are timed in interleaved rounds
so load from other processes hits them alike; each figure is the median over rounds.

Second table (always; alone with `--only-skip-check`): the optimizer step as train_step runs
it, non-finite check included (kiln.train.step.step_unless, gradients kept between calls), for
each optimizer that honours `found_inf` (kiln.train.step.honours_found_inf), three sides timed in
paired rounds (all three within a round, their order rotating every round):
  old     the step as it ran before: with `--baseline-ref REF`, step_unless and Lion/LAMB/Muon as
          they were at git commit REF (kiln/train/step.py, kiln/train/optimizers/{lion,lamb,muon}.py
          read with `git show`); without it, today's code with a host check;
  new     today's step_unless and optimizers: on CPU parameters the host check (`bool(skipped)`
          then a plain step()), elsewhere the found_inf mask;
  masked  today's code with the found_inf mask forced (kiln.train.step.force_device_skip): what
          a GPU runs, timed here on the same device.
The three are built afresh every round (memory placement alone moves a CPU step by up to ~10%).
Each ratio is the median of the per-round ratios, with their min-max. `--clock cpu` times the
process's CPU seconds on one thread instead of elapsed seconds, for a loaded shared machine.

    python benchmarks/optimizer_step.py [--rounds 5] [--device cpu] [--baseline-ref REF] [--clock cpu]

Prints a table and writes benchmarks/results/optimizer_step.json (optimizer_step_NAMES.json with
`--optimizers NAMES`).
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
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
import kiln.train.optim
from kiln.config import OptimConfig
from kiln.train.optim import FUSED_ADAMW_FASTER, adamw_implementation, build_optimizer
from kiln.train.step import force_device_skip, honours_found_inf, step_unless

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
    ("adafactor", "torch"),  # torch.optim.Adafactor, which kiln used until it stepped sharded parameters
    ("muon", "auto"),
]


def make_case(name: str, impl: str, device: str, seed: int = 0, classes: dict | None = None):
    """Model with random gradients and its optimizer, state allocated; `classes` replaces kiln's
    optimizer classes (name -> class) for the build, e.g. a baseline commit's; implementation
    "torch" is torch's own class of that name (only Adafactor's has the same constructor)."""
    if impl == "torch":
        classes, impl = {**(classes or {}), name.capitalize(): getattr(torch.optim, name.capitalize())}, "auto"
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


BASELINE_MODULES = {"Lion": "optimizers/lion", "Lamb": "optimizers/lamb", "Muon": "optimizers/muon"}


def load_at_ref(ref: str, module: str, workdir: Path):
    """kiln/train/`module`.py as it was at git commit `ref`, loaded as a stand-alone module (it
    imports today's kiln for anything else, e.g. kiln.train.optimizers.adam_state, which on the
    CPU keeps the same state as before)."""
    src = subprocess.run(["git", "show", f"{ref}:kiln/train/{module}.py"], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    name = "baseline_" + module.replace("/", "_")
    path = workdir / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # step.py's dataclasses look their module up there
    spec.loader.exec_module(loaded)
    return loaded


def baseline_classes(ref: str, workdir: Path) -> dict:
    """kiln's optimizer classes as they were at git commit `ref`."""
    return {cls: getattr(load_at_ref(ref, module, workdir), cls) for cls, module in BASELINE_MODULES.items()}


SIDES = ("old", "new", "masked")


def host_checked_step(opt, skipped: torch.Tensor) -> None:
    """The old side without --baseline-ref: today's optimizer behind one host check."""
    if not bool(skipped):
        opt.step()


def time_skip_check(cases, args, device_type: str) -> list[dict]:
    """Paired rounds of the step as train_step runs it: old (baseline commit), new, new masked.

    Every round builds the three optimizers afresh (in the round's order): where a model's
    tensors land in memory moves one instance's step time by up to ~10% on a CPU (measured:
    two instances of the same class differed that much, consistently), so keeping one instance
    per side for all rounds would compare placements, not code."""
    sync = "torch.cuda.synchronize()" if device_type == "cuda" else "pass"
    with tempfile.TemporaryDirectory() as tmp:
        classes = old_step_unless = None
        if args.baseline_ref:
            classes = baseline_classes(args.baseline_ref, Path(tmp))
            old_step_unless = load_at_ref(args.baseline_ref, "step", Path(tmp)).step_unless
        steps = {"old": old_step_unless or host_checked_step, "new": step_unless, "masked": step_unless}

        def build(case, side):
            opt = make_case(*case, device=args.device, classes=classes if side == "old" else None)[1]
            opt.zero_grad = lambda set_to_none=True: None  # step_unless zeroes them: keep them for the next call
            return force_device_skip(opt) if side == "masked" else opt

        cases = [c for c in cases if honours_found_inf(make_case(*c, device=args.device)[1])]
        flag = torch.zeros((), dtype=torch.bool, device=args.device)  # "not skipped", on the device
        samples = {case: {side: [] for side in SIDES} for case in cases}
        for round_ in range(args.rounds):
            for case in cases:
                order = SIDES[round_ % 3:] + SIDES[:round_ % 3]
                opts = {side: build(case, side) for side in order}
                for side in order:
                    timer = Timer(stmt=f"step(opt, flag); {sync}", **timer_kwargs(args),
                                  globals={"opt": opts[side], "step": steps[side], "torch": torch, "flag": flag})
                    samples[case][side].append(timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e3)
                del opts
    rows = []
    baseline = f"commit {args.baseline_ref}" if args.baseline_ref else "today's code, host check"
    print(f"optimizer step with its non-finite check (step_unless): old ({baseline}) vs new (today's, "
          f"{'host check' if device_type == 'cpu' else 'found_inf'} on {device_type}) vs masked (found_inf "
          f"forced); paired rounds, ratio = median of per-round ratios (min-max); {clock_note(args)}")
    print(f"{'optimizer':<10} {'impl':<8} {'old ms':>8} {'new ms':>8} {'masked ms':>10} "
          f"{'new/old':>18} {'masked/old':>18}")
    for case, s in samples.items():
        row = {"optimizer": case[0], "implementation": case[1]}
        cells = []
        for side in SIDES:
            row[f"{side}_median_ms"] = round(statistics.median(s[side]), 3)
        for side in ("new", "masked"):
            ratios = [x / o for x, o in zip(s[side], s["old"])]
            row[f"{side}_over_old_median"] = round(statistics.median(ratios), 3)
            row[f"{side}_over_old_min"], row[f"{side}_over_old_max"] = round(min(ratios), 3), round(max(ratios), 3)
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        rows.append(row)
        print(f"{case[0]:<10} {case[1]:<8} {row['old_median_ms']:>8.2f} {row['new_median_ms']:>8.2f} "
              f"{row['masked_median_ms']:>10.2f} {cells[0]:>18} {cells[1]:>18}")
    return rows


def timer_kwargs(args) -> dict:
    """`--clock cpu`: the process's CPU seconds on one torch thread (the work done, which other
    processes' load barely moves) instead of elapsed seconds on all threads."""
    return {"timer": time.process_time, "num_threads": 1} if args.clock == "cpu" else {}


def clock_note(args) -> str:
    return ("CPU ms on 1 thread" if args.clock == "cpu"
            else f"elapsed ms on {torch.get_num_threads()} threads")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per case per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--baseline-ref", default=None,
                        help="git commit whose step_unless and Lion/LAMB/Muon the old side runs "
                             "(default: today's code with a host check)")
    parser.add_argument("--only-skip-check", action="store_true", help="time only the second table")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time, all torch threads; cpu: process CPU time, one thread "
                             "(steadier on a loaded machine)")
    parser.add_argument("--optimizers", default="", help="comma-separated optimizer names to time (default: all)")
    args = parser.parse_args()

    device_type = torch.device(args.device).type
    args.load_average_at_start = os.getloadavg()[0]
    cases = [(n, i) for n, i in CASES if not (i == "fused" and device_type not in ("cpu", "cuda"))]
    if args.optimizers:
        wanted = set(args.optimizers.split(","))
        cases = [c for c in cases if c[0] in wanted or c == CASES[0]]  # the ratio baseline stays
    skip_rows = time_skip_check(cases, args, device_type)
    if args.only_skip_check:
        write_results({"benchmark": "optimizer_step", **machine(args), "skip_check": skip_rows,
                       "baseline_ref": args.baseline_ref},
                      SKIP_RESULTS.with_stem(SKIP_RESULTS.stem + "_cpu") if args.clock == "cpu" else SKIP_RESULTS)
        return 0
    built = {case: make_case(*case, device=args.device) for case in cases}
    n_params = sum(p.numel() for p in built[cases[0]][0].parameters())
    samples: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            opt = built[case][1]
            sync = "torch.cuda.synchronize()" if device_type == "cuda" else "pass"
            timer = Timer(stmt=f"opt.step(); {sync}", globals={"opt": opt, "torch": torch}, **timer_kwargs(args))
            samples[case].append(timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e3)

    median = {case: statistics.median(v) for case, v in samples.items()}
    baseline = median[cases[0]]
    rows = []
    print(f"optimizer step, {n_params / 1e6:.1f}M params, device={args.device}, {clock_note(args)}, "
          f"torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'optimizer':<10} {'impl':<8} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'x adamw-foreach':>16}")
    for case in cases:
        v = samples[case]
        ratio = median[case] / baseline
        print(f"{case[0]:<10} {case[1]:<8} {median[case]:>10.2f} {min(v):>8.2f} {max(v):>8.2f} {ratio:>16.2f}")
        rows.append({"optimizer": case[0], "implementation": case[1], "median_ms": round(median[case], 3),
                     "min_ms": round(min(v), 3), "max_ms": round(max(v), 3),
                     "time_vs_adamw_foreach": round(ratio, 3)})

    fused_speedup = fused_faster = auto_pick = agrees = None
    if ("adamw", "fused") in median:  # not with --optimizers naming others
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
        "adamw_fused_speedup_over_foreach": fused_speedup and round(fused_speedup, 3),
        "fused_faster": fused_faster,
        "auto_picks": auto_pick,
        "auto_table_agrees": agrees,
        "skip_check": skip_rows,
        "baseline_ref": args.baseline_ref,
    }, RESULTS.with_stem(f"{RESULTS.stem}_{args.optimizers.replace(',', '_')}") if args.optimizers else RESULTS)
    return 0


def machine(args) -> dict:
    return {"device": args.device, "cpu": platform.processor() or platform.machine(),
            "threads": 1 if args.clock == "cpu" else torch.get_num_threads(), "clock": args.clock,
            "torch": torch.__version__, "rounds": args.rounds,
            "command": " ".join(["python", *sys.argv]), "load_average_at_start": args.load_average_at_start,
            "load_average_at_end": os.getloadavg()[0]}


def write_results(payload: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())

"""Training-step throughput and MFU: kiln's model and step against a plain PyTorch GPT.

One step = forward + backward + clip + optimizer step, through `kiln.train.trainer.train_step`
(the function the trainer calls) with kiln's optimizer builder. The baseline is a minimal
nanoGPT-style model (benchmarks/baseline_gpt.py: fused qkv Linear, LayerNorm, GeLU MLP, learned
positions, tied head, SDPA) trained with torch AdamW, same shapes and token counts. Cases are timed in
interleaved rounds (so load from other processes hits them alike); figures are medians over
rounds, with process CPU-seconds beside wall time. MFU = model FLOPs/token x tokens/s over the
best matmul FLOP/s this machine reaches, probed in the same run (several sizes, best kept).

    python benchmarks/throughput.py [--rounds 4] [--no-compile] [--quick]
    python benchmarks/throughput.py --device cuda [--budget-s 420] [--corpus tinyshakespeare.txt]
    python benchmarks/throughput.py --fused-ab [--sizes debug,small,124m] [--rounds 8] [--fused-compile | --fused-block]

`--fused-ab`: model.fused_projections on against off (kiln default and gpt2 architecture, eager
or `--fused-compile`d),
interleaved rounds, per size; writes benchmarks/results/fused_projections_cpu.json.

Prints tables and writes benchmarks/results/throughput.json. `--device cuda` runs the one-GPU
comparison in benchmarks/gpu_throughput.py instead (`--device cpu --gpu-cases --quick` dry-runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from baseline_gpt import BaselineGPT, Size  # noqa: E402
from common import matmul_peak, median, print_table, timed, write_results  # noqa: E402

from kiln.config import ModelConfig, OptimConfig  # noqa: E402
from kiln.model.transformer import Transformer, flops_per_token  # noqa: E402
from kiln.train.evaluate import autocast_context  # noqa: E402
from kiln.train.optim import build_optimizer  # noqa: E402
from kiln.train.step import train_step  # noqa: E402


SIZES = {
    "debug": Size("debug", vocab=4096, dim=128, layers=2, heads=4, seq=256, batch=8),
    "tiny": Size("tiny", vocab=512, dim=64, layers=1, heads=2, seq=64, batch=2),  # --quick only
    "small": Size("small", vocab=4096, dim=384, layers=8, heads=6, seq=256, batch=4),
    # GPT-2 124M's model (--fused-ab only), with 512 tokens a step: seconds per step on a CPU
    "124m": Size("124m", vocab=50304, dim=768, layers=12, heads=12, seq=256, batch=2),
}


# ---------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    step: Callable[[], None]
    flops_per_token: float
    tokens_per_step: int
    n_params: int
    compile_s: float = 0.0


def kiln_model_config(s: Size, style: str, fused: bool | None = None) -> ModelConfig:
    cfg = ModelConfig(vocab_size=s.vocab, dim=s.dim, n_layers=s.layers, n_heads=s.heads, max_seq_len=s.seq)
    if fused is not None:
        cfg = replace(cfg, fused_projections=fused)
    if style == "gpt2":  # the baseline's architecture expressed in kiln's config
        cfg = replace(cfg, norm="layernorm", activation="gelu", positions="learned", init="normal")
    return cfg


def make_batch(s: Size, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=gen)
    return [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]


def kiln_case(s: Size, style: str, dtype: str, compile_model: bool, fused: bool | None = None) -> Case:
    torch.manual_seed(0)
    model = Transformer(kiln_model_config(s, style, fused))
    model.init_weights(torch.Generator().manual_seed(0))
    optimizer = build_optimizer(model, OptimConfig())
    flops = flops_per_token(model, s.seq)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    runner = torch.compile(model) if compile_model else model
    batch = make_batch(s)
    autocast = autocast_context(torch.device("cpu"), dtype)

    def step() -> None:
        loss, _, _ = train_step(runner, optimizer, batch, autocast=autocast, scaler=None, clip=1.0)
        loss.item()

    name = f"kiln-{style} {dtype}" + (" compiled" if compile_model else "")
    if fused is not None:
        name += " fused" if fused else " unfused"
    return _warm(Case(name, step, flops, s.batch * s.seq, n_params), compile_model)


def baseline_case(s: Size, compile_model: bool) -> Case:
    torch.manual_seed(0)
    model = BaselineGPT(s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    runner = torch.compile(model) if compile_model else model
    (x, y), = make_batch(s)

    def step() -> None:
        loss = F.cross_entropy(runner(x).view(-1, s.vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    name = "nanoGPT baseline fp32" + (" compiled" if compile_model else "")
    return _warm(Case(name, step, model.flops_per_token(), s.batch * s.seq, n_params), compile_model)


def _warm(case: Case, compiled: bool) -> Case:
    wall, _ = timed(case.step)  # first step: compiles, allocates optimizer state
    case.compile_s = wall if compiled else 0.0
    case.step()
    return case


def measure(cases: list[Case], rounds: int, steps: int, peak: float) -> list[dict[str, Any]]:
    walls: dict[str, list[float]] = {c.name: [] for c in cases}
    cpus: dict[str, list[float]] = {c.name: [] for c in cases}
    for r in range(rounds):
        order = cases if r % 2 == 0 else cases[::-1]  # alternate order: no case always runs first
        for case in order:
            wall, cpu = timed(lambda: [case.step() for _ in range(steps)])
            walls[case.name].append(wall / steps)
            cpus[case.name].append(cpu / steps)
    rows = []
    for case in cases:
        step_s = median(walls[case.name])
        tps = case.tokens_per_step / step_s
        rows.append({"case": case.name, "params_m": case.n_params / 1e6, "step_ms": 1000 * step_s,
                     "cpu_s_per_step": median(cpus[case.name]), "tokens_per_s": tps,
                     "flops_per_token": case.flops_per_token,
                     "mfu_fp32": case.flops_per_token * tps / peak,
                     "compile_s": case.compile_s, "step_ms_all": [1000 * w for w in walls[case.name]],
                     "cpu_s_all": cpus[case.name]})
    return rows


def profile_top_ops(case: Case, steps: int, top: int = 15) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            case.step()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "pct": 100 * e.self_cpu_time_total / total, "calls_per_step": e.count / steps}
            for e in events[:top]]


def block_case(s: Size, style: str, fused: bool) -> Case:
    """Forward + backward of one transformer block (no embedding, head or optimizer) on a fixed
    (batch, seq, dim) input: the part of the step that model.fused_projections changes."""
    from kiln.model.transformer import TransformerBlock, rope_tables

    torch.manual_seed(0)
    cfg = kiln_model_config(s, style, fused)
    block = TransformerBlock(cfg, 0)
    x = torch.randn(s.batch, s.seq, s.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rope = rope_tables(s.dim // s.heads, s.seq, cfg.rope_theta)

    def step() -> None:
        block(x, rope).square().mean().backward()
        for p in (x, *block.parameters()):
            p.grad = None

    name = f"kiln-{style} block fp32 " + ("fused" if fused else "unfused")
    return _warm(Case(name, step, 0.0, s.batch * s.seq, sum(p.numel() for p in block.parameters())), False)


def fused_ab(sizes: list[Size], rounds: int, steps: int, compile_model: bool, out: str, block: bool) -> int:
    """model.fused_projections on vs off, same weights and batch, cases interleaved per round;
    the ratios are unfused/fused per round (> 1: fused is faster), of wall time and of process
    CPU time (steadier than wall time on a shared machine), median and range. `block`: one
    block's forward + backward instead of the whole training step."""
    from common import machine_info

    results: dict[str, Any] = {"machine": machine_info(), "load_before": list(_loadavg()), "rounds": rounds,
                               "steps_per_round": steps, "scope": "block" if block else "step", "sizes": {}}
    for s in sizes:
        pairs = {style: [block_case(s, style, fused) if block else kiln_case(s, style, "fp32", compile_model, fused)
                         for fused in (False, True)] for style in ("default", "gpt2")}
        rows = measure([c for pair in pairs.values() for c in pair], rounds, steps, 1.0)
        by = {r["case"]: r for r in rows}
        ratios = {}
        for style, (plain_case, fused_case) in pairs.items():
            ratios[style] = {}
            for kind, key in (("wall", "step_ms_all"), ("cpu", "cpu_s_all")):
                plain, fused = by[plain_case.name][key], by[fused_case.name][key]
                per_round = sorted(p / f for p, f in zip(plain, fused))
                ratios[style][kind] = {
                    "median": median(per_round), "min": per_round[0], "max": per_round[-1]}
        print(f"\n== {s.name}: dim {s.dim}, {s.layers} layers, vocab {s.vocab}, {s.batch} x {s.seq} tokens ==")
        print_table(["case", "step ms (median)", "CPU s/step", "rounds ms"],
                    [[r["case"], r["step_ms"], r["cpu_s_per_step"], " ".join(f"{x:.0f}" for x in r["step_ms_all"])]
                     for r in rows])
        for style, by_kind in ratios.items():
            for kind, r in by_kind.items():
                print(f"kiln-{style} {kind}: unfused/fused per round median {r['median']:.3f} "
                      f"(range {r['min']:.3f}-{r['max']:.3f})")
        results["sizes"][s.name] = {"shape": vars(s), "rows": rows, "unfused_over_fused": ratios}
    results["load_after"] = list(_loadavg())
    path = write_results(out, {"command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]), **results})
    print(f"wrote {path}; load average before {results['load_before']}, after {results['load_after']}")
    return 0


def _loadavg() -> tuple[float, ...]:
    try:
        import os

        return os.getloadavg()
    except OSError:
        return ()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="steps per case per round")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases")
    ap.add_argument("--no-bf16", action="store_true", help="skip the (emulated, slow) bf16 cases")
    ap.add_argument("--sizes", default="debug,small")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run; figures are noise")
    ap.add_argument("--out", default="throughput", help="results/NAME.json, or a path ending in .json")
    gpu = ap.add_argument_group("one GPU (benchmarks/gpu_throughput.py)")
    gpu.add_argument("--device", default="cpu", help="cuda: the GPU cases instead of the CPU ones")
    gpu.add_argument("--gpu-cases", action="store_true", help="the GPU cases on --device (cpu: a dry run)")
    gpu.add_argument("--budget-s", type=float, default=420, help="skip the remaining GPU cases after this")
    gpu.add_argument("--gpu-steps", type=int, default=30, help="timed steps per GPU case")
    gpu.add_argument("--corpus", help="text file for the time-to-target cases (tinyshakespeare)")
    gpu.add_argument("--target", type=float, default=1.8, help="validation loss to reach (bytes, nats)")
    gpu.add_argument("--target-steps", type=int, default=1200)
    gpu.add_argument("--json", help="also write the GPU results to this file after every case")
    gpu.add_argument("--only", default="", help="run only the GPU cases whose 'case @ shape' contains this (alternatives: a|b)")
    ap.add_argument("--fused-ab", action="store_true", help="model.fused_projections on vs off (CPU, fp32)")
    ap.add_argument("--fused-compile", action="store_true", help="--fused-ab: torch.compile the models")
    ap.add_argument("--fused-block", action="store_true", help="--fused-ab: one block's forward + backward")
    args = ap.parse_args(argv)
    if args.fused_ab:
        out = "fused_projections_cpu" if args.out == "throughput" else args.out
        return fused_ab([SIZES[n] for n in args.sizes.split(",")], args.rounds, args.steps,
                        args.fused_compile, out, args.fused_block)
    if args.device.startswith("cuda") or args.gpu_cases:
        from gpu_throughput import run_all

        results = run_all(args.device, args.quick, args.budget_s, args.gpu_steps, args.corpus, args.target,
                          args.target_steps, args.json, args.only)
        name = args.out if args.out.endswith(".json") else "gpu_throughput" + ("_dryrun" if args.quick else "")
        path = write_results(name,
                             {"command": "python benchmarks/throughput.py " + " ".join(argv or sys.argv[1:]),
                              "results": [vars(r) for r in results]})
        print(f"wrote {path}")
        return 0
    if args.quick:
        args.rounds, args.steps, args.no_compile, args.no_bf16, args.sizes = 1, 1, True, True, "tiny"
    sizes = [SIZES[n] for n in args.sizes.split(",")]
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    t0 = time.perf_counter()
    fp32_sizes = (256,) if args.quick else (1536, 2048, 3072)
    peak32 = matmul_peak(torch.float32, fp32_sizes, 0.2 if args.quick else 1.5)
    # Emulated bf16 is ~100x slower: small matrices keep the probe short; native bf16 gets big ones.
    bf16_sizes = (256,) if args.quick else ((1536, 2048) if native_bf16 else (256, 512))
    peak16 = None if args.no_bf16 else matmul_peak(torch.bfloat16, bf16_sizes, 0.2 if args.quick else 1.0)
    print(f"matmul peak fp32 {peak32['flops'] / 1e9:.1f} GFLOP/s (n={peak32['best_n']}, {peak32['by_size_gflops']})")
    if peak16:
        print(f"matmul peak bf16 {peak16['flops'] / 1e9:.2f} GFLOP/s (n={peak16['best_n']}, "
              f"{peak16['by_size_gflops']}; native bf16: {native_bf16})")

    results: dict[str, Any] = {"peak_fp32": peak32, "peak_bf16": peak16, "native_bf16": native_bf16,
                               "rounds": args.rounds, "steps_per_round": args.steps, "sizes": {}}
    for s in sizes:
        cases = [kiln_case(s, "default", "fp32", False), kiln_case(s, "gpt2", "fp32", False),
                 baseline_case(s, False)]
        if not args.no_compile:
            cases += [kiln_case(s, "default", "fp32", True), baseline_case(s, True)]
        rows = measure(cases, args.rounds, args.steps, peak32["flops"])
        entry: dict[str, Any] = {"shape": vars(s), "fp32": rows}
        if peak16 and (s.name == "debug" or native_bf16):
            # A few steps only: without native bf16 every bf16 matmul is emulated.
            bf16 = measure([kiln_case(s, "default", "bf16", False)], 1, 1 if not native_bf16 else args.steps,
                           peak32["flops"])
            for row in bf16:
                row["mfu_bf16"] = row["flops_per_token"] * row["tokens_per_s"] / peak16["flops"]
            entry["bf16"] = bf16
        print(f"\n== {s.name}: dim {s.dim}, {s.layers} layers, {s.heads} heads, vocab {s.vocab}, "
              f"seq {s.seq}, batch {s.batch} ==")
        base = next(r for r in rows if r["case"].startswith("nanoGPT") and "compiled" not in r["case"])
        print_table(["case", "params M", "step ms", "CPU s/step", "tokens/s", "MFU fp32", "vs baseline", "compile s"],
                    [[r["case"], r["params_m"], r["step_ms"], r["cpu_s_per_step"], r["tokens_per_s"],
                      f"{100 * r['mfu_fp32']:.1f}%", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                      r["compile_s"]] for r in rows + entry.get("bf16", [])])
        if s.name in ("debug", "tiny"):
            entry["profile_kiln_default_eager"] = profile_top_ops(cases[0], 1 if args.quick else 3)
            print("\ntop ops, kiln default eager fp32 (self CPU time per step):")
            print_table(["op", "ms/step", "%", "calls/step"],
                        [[e["op"], e["self_ms_per_step"], e["pct"], e["calls_per_step"]]
                         for e in entry["profile_kiln_default_eager"]])
        results["sizes"][s.name] = entry
    results["total_s"] = time.perf_counter() - t0
    path = write_results(args.out, {"command": "python benchmarks/throughput.py " + " ".join(argv or sys.argv[1:]),
                                    **results})
    print(f"\nwrote {path} ({results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

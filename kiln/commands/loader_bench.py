"""kiln loader-bench [CONFIG.toml] [--set section.key=value ...] [--run-dir DIR] [--steps N]
kiln loader-bench [CONFIG.toml] --image-text SHARDS --step-ms C [--image-size S] [--workers 0,1,2] ...

Measures compute, warm and cold loading (kiln/train/stall.py) and writes
RUN_DIR/reports/loader-bench.json, which `kiln report` charts. With --image-text, compares
preprocessing image-text tar shards in CPU workers vs on the device (kiln/data/stall_image.py)
and writes RUN_DIR/reports/loader-bench-image.{json,svg}."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.config import load_config

REPORT_NAME = "loader-bench.json"
IMAGE_REPORT_NAME = "loader-bench-image"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML (default: the embedded default job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key; repeatable")
    p.add_argument("--run-dir", help="run directory (default: runs/<model.name>)")
    p.add_argument("--steps", type=int, default=10, help="training steps' worth of batches to time (default 10)")
    g = p.add_argument_group("image-text data (CPU-worker vs device preprocessing)")
    g.add_argument("--image-text", metavar="SHARDS", help="directory or URL of WebDataset-style .tar shards")
    g.add_argument("--step-ms", type=float, help="compute time of one training step, ms (required with --image-text)")
    g.add_argument("--image-size", type=int, default=224, help="square crop size (default 224)")
    g.add_argument("--workers", default="0,1,2", help="DataLoader worker counts to compare (default 0,1,2)")
    g.add_argument("--device", help="where the device path decodes: cpu or cuda (default: train.device, auto=cuda "
                                    "when available)")
    g.add_argument("--skip-bad", action="store_true", help="log, count and skip bad samples instead of failing")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, list(args.overrides))
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.model.name
    if args.image_text:
        return run_image(args, cfg, run_dir)
    from kiln.train.stall import analyze
    from kiln.io import atomic_write_json

    report = analyze(cfg, run_dir, steps=args.steps, log=lambda m: print(m, flush=True))
    out = atomic_write_json(run_dir / "reports" / REPORT_NAME, report, indent=1)
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    print(f"compute {ms(report['compute_s_per_step'])}/step, preprocessing {ms(report['prep_s_per_step'])}/step, "
          f"fetch {ms(report['fetch_s_per_step'])}/step ({report['storage']} shards, cold: {report['cold']})")
    print(f"stall {report['stall_fraction']:.1%} of the step (fetch {report['fetch_stall_fraction']:.1%}, "
          f"preprocessing {report['prep_stall_fraction']:.1%})")
    live = report["live"]
    print(f"live training (threaded loader, data wait / step time): cold {live['cold']['stall_fraction']:.2%} "
          f"(after the first step {live['cold']['steady_stall_fraction']:.2%}), warm {live['warm']['stall_fraction']:.2%}")
    rec = report["recommended"]
    print("recommended: " + ", ".join(f"data.{k}={rec[k]}" for k in ("prefetch", "fetch_workers", "lookahead",
                                                                      "cache_gb")))
    if "note" in rec:
        print(f"note: {rec['note']}")
    print(f"report: {out}")
    return 0


def run_image(args: argparse.Namespace, cfg, run_dir: Path) -> int:
    import torch

    from kiln.data.image_ops import ImageSpec
    from kiln.data.image_text import TarIndex
    from kiln.data.stall_image import analyze_image
    from kiln.report.loader_bench import image_chart_svg
    from kiln.data.storage import ShardStore
    from kiln.data.tokenizer import build_tokenizer
    from kiln.errors import KilnError
    from kiln.io import atomic_write_json, atomic_write_text

    if args.step_ms is None:
        raise KilnError("loader-bench --image-text needs --step-ms (the compute time of one training step)")
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        raise KilnError(f"--workers={args.workers!r}: expected comma-separated counts like 0,1,2") from None
    device = args.device or cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    log = lambda m: print(m, flush=True)  # noqa: E731
    store_kw = {"cache_dir": cfg.data.cache_dir or None, "cache_bytes": int(cfg.data.cache_gb * (1 << 30)),
                "workers": cfg.data.fetch_workers, "retries": cfg.data.fetch_retries}
    texts = ()
    if cfg.data.tokenizer == "bpe":  # trained on (up to 10k of) the captions themselves
        index = TarIndex(args.image_text, store=ShardStore(args.image_text, **store_kw), skip_bad=True,
                         log=lambda _m: None)
        texts = [index.read(s.shard, s.caption_range).decode("utf-8", "replace") for s in index.samples[:10_000]]
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.vocab_size, texts)
    report = analyze_image(args.image_text, tokenizer, compute_s=args.step_ms / 1e3, batch_size=cfg.train.batch_size,
                           spec=ImageSpec(size=args.image_size), caption_len=cfg.data.seq_len, device=device,
                           workers=workers, batches=args.steps, max_stall=cfg.data.wait_warn_fraction,
                           skip_bad=args.skip_bad, store_kw=store_kw, log=log)
    out = atomic_write_json(run_dir / "reports" / f"{IMAGE_REPORT_NAME}.json", report, indent=1)
    atomic_write_text(run_dir / "reports" / f"{IMAGE_REPORT_NAME}.svg", image_chart_svg(report))
    print(f"{'mode':8} {'workers':>7} {'warm ms/batch':>14} {'cold ms/batch':>14} {'step ms':>9} {'stall':>7} "
          f"{'fetch':>7} {'prep':>7}")
    for r in report["configs"]:
        print(f"{r['mode']:8} {r['workers']:>7} {r['warm_batch_s'] * 1e3:>14.2f} {r['cold_batch_s'] * 1e3:>14.2f} "
              f"{r['step_s'] * 1e3:>9.2f} {r['stall_fraction']:>7.1%} {r['fetch_stall_fraction']:>7.1%} "
              f"{r['prep_stall_fraction']:>7.1%}")
    rec = report["recommended"]
    print(f"recommended: {rec['verdict']}; prefetch {rec['prefetch']} per worker; a CPU path needs "
          f"{rec['cpu_workers_needed']} worker(s) for a {args.step_ms:g} ms step")
    if report["skipped"]:
        print(f"skipped {report['skipped']} bad sample(s) while indexing (--skip-bad)")
    print(f"report: {out}")
    return 0

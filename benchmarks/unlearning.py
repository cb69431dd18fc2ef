"""Unlearning benchmark: all-at-once vs sequential chunks (Jang et al. 2022) on a model trained
with canaries on this machine.

Trains a byte-level model on standard-library text with `data.canaries` (kiln's train path), then,
from the same checkpoint, runs `kiln unlearn` (kiln.commands.unlearn, with the retain text) for
each chunk size and records: forget-set extraction likelihood, memorization accuracy and exposure
before/after, validation perplexity before/after, and accuracy on a local lm-eval
multiple-choice task (true continuation of held-out text vs one from elsewhere) before/after.

    PYTHONPATH=. python benchmarks/unlearning.py --out benchmarks/results/unlearning.json

`--train-only` trains the model and stops (a later call reuses it: `train_seconds` is then ~0);
`--chunks` picks the chunk sizes, so sizes can run in separate processes on the same --root run
(the README's table came from two such calls). `--from-run DIR` copies an already trained run into
ROOT/run instead of training (the source directory is only read), so a new --root can rerun the
unlearning with other settings; `--lr`, `--stop-on-exposure`, `--format-weight` and `--bisect`
are passed to `kiln unlearn`.
`--label NAME` appends this call's rows, labelled, to an existing --out file's "runs" list
instead of replacing the file (the rows already there are kept).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one

import torch  # noqa: E402

from common import machine_info  # noqa: E402


def local_task(root: Path, val_text: str, n: int, seed: int) -> Path:
    """An lm-eval YAML task of n two-way choices cut from held-out text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(len(val_text) - 80), rng.randrange(len(val_text) - 80)
        rows.append({"question": val_text[a:a + 48], "choices": [val_text[a + 48:a + 72], val_text[b + 48:b + 72]],
                     "answer": 0})
    data = root / "heldout_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "kiln_heldout_mc.yaml").write_text(
        "task: kiln_heldout_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks


def task_accuracy(run_dir: Path, tasks: Path) -> float:
    from kiln.eval.lm_eval_adapter import run_lm_eval
    from kiln.eval.load import load_run

    out = run_lm_eval(load_run(run_dir), ["kiln_heldout_mc"], include_path=[str(tasks)], include_defaults=False)
    return out["results"]["kiln_heldout_mc"]["acc,none"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/kiln-unlearning-bench")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "unlearning.json"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--canaries", type=int, default=32)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--chunks", default="1,4,16,0", help="chunk sizes; 0 = all at once")
    p.add_argument("--candidates", type=int, default=300)
    p.add_argument("--task-size", type=int, default=100)
    p.add_argument("--train-only", action="store_true", help="train the model (if not there yet) and stop")
    p.add_argument("--from-run", help="copy this trained run to ROOT/run instead of training (the source is only read)")
    p.add_argument("--lr", type=float, help="kiln unlearn --lr (default: kiln's default)")
    p.add_argument("--stop-on-exposure", action="store_true", help="kiln unlearn --stop-on-exposure")
    p.add_argument("--format-weight", type=float, help="kiln unlearn --format-weight (default: kiln's default)")
    p.add_argument("--bisect", type=int, help="kiln unlearn --bisect (default: kiln's default)")
    p.add_argument("--label", help="append the rows under this label to --out's 'runs' list, keeping the file")
    args = p.parse_args()
    torch.set_num_threads(1)  # the machine is shared: one thread is faster than two oversubscribed

    from kiln.cli import main as kiln
    from kiln.config import load_config
    from kiln.data.corpus import stdlib_files
    from kiln.io import atomic_write_json
    from kiln.train.trainer import train

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(f.read_text(errors="replace") for f in stdlib_files()[:20])[:100_000])
    run_dir = root / "run"
    overrides = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                 "data.tokenizer=byte",
                 f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}", "train.batch_size=8",
                 f"train.steps={args.steps}",
                 "train.dtype=fp32", "metrics.progress=none", "train.eval_every=0", "schedule.warmup_steps=30",
                 "metrics.peak_flops=1e12",
                 "checkpoint.every=0", f"data.canaries={args.canaries}", f"data.canary_repeats={args.repeats}",
                 "data.canary_digits=6", f"data.source={corpus}"]
    t0 = time.perf_counter()
    if args.from_run and not (run_dir / "checkpoints").is_dir():
        import shutil
        if not (Path(args.from_run) / "checkpoints").is_dir():
            sys.exit(f"--from-run {args.from_run}: no checkpoints/ there (expected a trained kiln run)")
        shutil.copytree(args.from_run, run_dir)
    if not (run_dir / "checkpoints").is_dir():
        train(load_config(None, overrides), run_dir)
    train_s = time.perf_counter() - t0
    if args.train_only:
        print(f"trained in {train_s:.1f} s: {run_dir}")
        return
    text = corpus.read_text()
    retain = root / "retain.txt"
    retain.write_text(text[:30_000])
    tasks = local_task(root, text[-5_000:], args.task_size, 0)
    acc_before = task_accuracy(run_dir, tasks)
    rows = []
    for k in [int(c) for c in args.chunks.split(",")]:
        out = root / f"unlearned-k{k}"
        if out.exists():
            import shutil
            shutil.rmtree(out)
        t1 = time.perf_counter()
        code = kiln(["unlearn", str(run_dir), "--forget", str(run_dir / "canaries.jsonl"), "--retain", str(retain),
                     "--chunk", str(k), "--candidates", str(args.candidates), "--out", str(out)]
                    + (["--lr", str(args.lr)] if args.lr is not None else [])
                    + (["--stop-on-exposure"] if args.stop_on_exposure else [])
                    + (["--format-weight", str(args.format_weight)] if args.format_weight is not None else [])
                    + (["--bisect", str(args.bisect)] if args.bisect is not None else []))
        seconds = time.perf_counter() - t1
        if code != 0:
            rows.append({"chunk": k, "error": code})
            continue
        rep = json.loads((out / "reports" / "unlearning.json").read_text())
        opts = rep.get("options", {})
        rows.append({"chunk": k or "all", "lr": opts.get("lr", args.lr), "stop_on_exposure": args.stop_on_exposure,
                     "format_weight": opts.get("format_weight"), "bisect": opts.get("bisect"),
                     "cut_back_steps": sum(1 for c in rep["chunks"] for h in c["history"] if "fraction" in h),
                     "seconds": seconds, "steps": rep["steps"], "status": rep["status"],
                     "forget_before": rep["forget_before"], "forget_after": rep["forget_after"],
                     "heldout_reference": rep["heldout_reference"],
                     "val_ppl_before": rep["val_before"]["ppl"], "val_ppl_after": rep["val_after"]["ppl"],
                     "task_acc_before": acc_before, "task_acc_after": task_accuracy(out, tasks),
                     "heldout_after": rep.get("heldout_after"), "chunk_steps": [c["steps"] for c in rep["chunks"]]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine_info(), "train_seconds": train_s, "args": vars(args), "rows": rows}
    out_file = Path(args.out)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    if args.label:
        existing = json.loads(out_file.read_text()) if out_file.exists() else {}
        existing.setdefault("runs", []).append({"label": args.label, **result})
        result = existing
    atomic_write_json(out_file, result, indent=1)
    print(f"{'K':>4} {'EL b->a':>14} {'MA b->a':>14} {'exposure b->a':>16} {'val ppl b->a':>16} {'acc b->a':>12} steps")
    for r in rows:
        if "error" in r:
            print(f"{r['chunk']:>4} failed (exit {r['error']})")
            continue
        b, a = r["forget_before"], r["forget_after"]
        print(f"{r['chunk']:>4} {b['el']:6.3f}->{a['el']:6.3f} {b['ma']:6.3f}->{a['ma']:6.3f} "
              f"{b['exposure']:7.2f}->{a['exposure']:6.2f} {r['val_ppl_before']:7.3f}->{r['val_ppl_after']:7.3f} "
              f"{r['task_acc_before']:5.2f}->{r['task_acc_after']:5.2f} {r['steps']}")


if __name__ == "__main__":
    main()

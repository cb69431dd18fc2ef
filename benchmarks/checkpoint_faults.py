"""Fault injection: kill -9 `kiln train` at random points, some inside a checkpoint save, resume,
and check that every run continues from the newest complete checkpoint with per-step losses equal
to an uninterrupted run (CPU, fp32).

Each trial starts `kiln train` in a subprocess and sends SIGKILL either after a random training step
("step") or as soon as a checkpoint's temporary directory appears ("save", i.e. inside an async
save's write/manifest/rename; which of the 2nd to 5th saves is drawn at random). It then lists the complete checkpoints left, runs `kiln train` again
on the same run directory (resume is automatic), and checks: the resumed run's `resumed_from` is
the newest complete checkpoint (or a fresh start when there was none), every metrics line parses,
every train row's loss equals the uninterrupted run's loss at that step, and the run completes.

    python benchmarks/checkpoint_faults.py [--trials 20] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = 16
EVERY = 3
SETTINGS = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.tokenizer=byte", "data.seq_len=32",
            "model.max_seq_len=64", "train.batch_size=4", f"train.steps={STEPS}", "train.eval_every=0",
            f"checkpoint.every={EVERY}", "checkpoint.keep_last=2", "train.dtype=fp32", "metrics.progress=none",
            "metrics.peak_flops=1e12", "schedule.warmup_steps=2", "train.threads=1"]


def _cmd(run_dir: Path, corpus: Path) -> list[str]:
    cmd = [sys.executable, "-m", "kiln.cli", "train", "--run-dir", str(run_dir)]
    for setting in SETTINGS + [f"data.source={str(corpus)!r}"]:
        cmd += ["--set", setting]
    return cmd


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _complete(run_dir: Path) -> list[int]:
    from kiln.checkpoint.retention import complete_steps

    return complete_steps(run_dir / "checkpoints")


def reference(root: Path, corpus: Path) -> dict[int, float]:
    run = root / "reference"
    subprocess.run(_cmd(run, corpus), env=_env(), check=True, capture_output=True, timeout=600)
    return {r["step"]: r["loss"] for r in _rows(run) if r["kind"] == "train"}


def _train_steps_logged(run_dir: Path) -> int:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return 0
    return text.count('"kind": "train"')


def trial(root: Path, corpus: Path, index: int, mode: str, rng: random.Random, ref: dict[int, float]) -> dict:
    run = root / f"trial-{index}"
    proc = subprocess.Popen(_cmd(run, corpus), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after = rng.randint(1, STEPS - 1)
    kill_in_save = rng.randint(2, STEPS // EVERY)  # which save to interrupt (the 1st has no predecessor)
    killed, deadline = False, time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if mode == "step" and _train_steps_logged(run) >= kill_after:
            killed = True
        elif mode == "save" and (run / "checkpoints" / f".step-{EVERY * kill_in_save}.tmp").exists():
            killed = True
        if killed:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.0005)
    proc.wait()
    left = _complete(run)
    resumed = subprocess.run(_cmd(run, corpus), env=_env(), capture_output=True, text=True, timeout=600)
    rows = _rows(run)  # raises if any line is not whole JSON
    runs = [r for r in rows if r["kind"] == "run"]
    train_rows = [r for r in rows if r["kind"] == "train"]
    expected_from = left[-1] if left else None
    mismatched = [r["step"] for r in train_rows if r["loss"] != ref[r["step"]]]
    ok = (resumed.returncode == 0 and runs[-1]["resumed_from"] == expected_from and not mismatched
          and train_rows[-1]["step"] == STEPS)
    return {"trial": index, "mode": mode, "killed": killed, "killed_after_rows": _train_steps_logged(run),
            "complete_checkpoints_at_kill": left, "resumed_from": runs[-1]["resumed_from"],
            "mismatched_steps": mismatched, "resume_rc": resumed.returncode, "ok": ok,
            "stderr_tail": resumed.stderr.strip().splitlines()[-1:] if resumed.returncode else []}


def run_trials(root: Path, corpus: Path, trials: int, seed: int) -> list[dict]:
    ref = reference(root, corpus)
    rng = random.Random(seed)
    return [trial(root, corpus, i, "save" if i % 2 else "step", rng, ref) for i in range(trials)]


def make_corpus(path: Path) -> Path:
    from kiln.data.corpus import stdlib_files

    parts, size = [], 0
    for f in stdlib_files():
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size > 200_000:
            break
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 trials, no results file")
    args = ap.parse_args(argv)
    trials = 2 if args.quick else args.trials
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = run_trials(root, make_corpus(root / "corpus.txt"), trials, args.seed)
    for r in results:
        print(f"trial {r['trial']:>2} {r['mode']:>4}: killed={r['killed']} complete={r['complete_checkpoints_at_kill']} "
              f"resumed_from={r['resumed_from']} {'OK' if r['ok'] else 'FAIL ' + str(r)}")
    passed = sum(r["ok"] for r in results)
    in_save = sum(r["mode"] == "save" and r["killed"] for r in results)
    print(f"{passed}/{len(results)} trials resumed from the newest complete checkpoint with identical losses "
          f"({in_save} killed inside a save)")
    if not args.quick:
        from common import RESULTS_DIR, machine_info

        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "checkpoint_faults.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "machine": machine_info(), "trials": results}, indent=1))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())

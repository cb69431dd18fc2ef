"""Throughput of `kiln prep` on real text, and the cost of its token-shard writer.

1. Whole pipeline (read JSONL -> normalize -> script -> gopher_quality -> gopher_repetition -> pii
   -> write kept documents), one worker process: MB of input per second per core; then the same
   with BPE training (vocab 8192) and token shards (tokenizers on --threads threads, default 1). Each step is also timed alone, in memory, to show where the time goes.
2. Tokenization: the pipeline's shard writer (`kiln.prep.writers.tokenize_docs`: batching,
   train/val split, ShardWriter, atomic .npy files) versus calling `tokenizers` directly
   (`Tokenizer.encode_batch_fast` over the same documents in the same batches, ids read out).
   Target: overhead <= 15%, in wall time and in process CPU time. The two are timed in
   interleaved rounds; figures are medians.

    python benchmarks/prep_pipeline.py [CORPUS ...] [--rounds 5] [--max-mb 4] [--threads 1]

CORPUS: text files (default /work/shared/data/*.txt; without them, the Python standard library
sources). Text files are split into documents at wikitext article headings (" = Title = "), else
into groups of paragraphs of about 2 KB. Prints a table; writes benchmarks/results/prep_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from kiln.data.corpus import stdlib_files
from kiln.prep.base import Doc, StepContext
from kiln.prep.executor import run_prep
from kiln.prep.pipeline import config_from_dict
from kiln.prep.writers import tokenize_docs
from kiln.data.tokenizer import train_bpe

RESULTS = Path(__file__).parent / "results" / "prep_pipeline.json"
SHARED = Path("/work/shared/data")
STEPS = [{"type": "normalize"}, {"type": "script"}, {"type": "gopher_quality", "min_words": 20},
         {"type": "gopher_repetition"}, {"type": "pii"}]
_HEADING = re.compile(r"^ = [^=].* = $", re.M)


def split_documents(path: Path, target: int = 2000) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if len(_HEADING.findall(text)) > 3:  # wikitext: one document per article
        starts = [m.start() for m in _HEADING.finditer(text)] + [len(text)]
        return [text[a:b].strip() for a, b in zip(starts, starts[1:]) if text[a:b].strip()]
    docs, current = [], ""
    for para in re.split(r"\n\s*\n", text):
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= target:
            docs.append(current)
            current = ""
    if current.strip():
        docs.append(current)
    return docs


def load_corpus(paths: list[str], max_mb: float) -> tuple[list[str], list[str]]:
    files = [Path(p) for p in paths] if paths else sorted(SHARED.glob("*.txt"))
    names = [str(f) for f in files]
    docs: list[str] = []
    if files:
        for f in files:
            docs.extend(split_documents(f))
    else:
        names = ["builtin:stdlib"]
        docs = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()]
    budget, out = int(max_mb * 1e6), []
    for d in docs:
        if budget <= 0:
            break
        out.append(d)
        budget -= len(d.encode())
    return names, out


def bench_pipeline(docs: list[str], work: Path, tokenize: bool = False) -> dict:
    raw = work / "raw"
    raw.mkdir(exist_ok=True)
    n_files = 4
    for i in range(n_files):
        with open(raw / f"part{i}.jsonl", "w", encoding="utf-8") as f:
            for j, text in enumerate(docs[i::n_files]):
                f.write(json.dumps({"text": text, "id": f"{i}-{j}"}) + "\n")
    cfg = config_from_dict({"input": {"path": str(raw), "id_field": "id"},
                            "output": {"dir": str(work / ("out-tok" if tokenize else "out"))},
                            "tokenize": {"enabled": tokenize, "vocab_size": 8192},
                            "run": {"workers": 1, "progress": "none", "resume": False}, "step": STEPS})
    t0 = time.perf_counter()
    report = run_prep(cfg)
    seconds = time.perf_counter() - t0
    mb = report["totals"]["bytes_in"] / 1e6
    return {"seconds": seconds, "mb_in": mb, "mb_per_s_per_core": mb / seconds, "workers": 1,
            "docs_in": report["totals"]["docs_in"], "docs_out": report["totals"]["docs_out"],
            "bytes_out": report["totals"]["bytes_out"]}


def bench_steps(docs: list[str]) -> dict[str, float]:
    cfg = config_from_dict({"input": {"path": "-"}, "step": STEPS})
    mb = sum(len(d.encode()) for d in docs) / 1e6
    out = {}
    for step in cfg.steps:
        ctx = StepContext()
        step.setup(ctx)
        items = [Doc(str(i), t) for i, t in enumerate(docs)]
        t0 = time.perf_counter()
        for _ in step.run(iter(items), ctx):
            pass
        out[step.name] = mb / (time.perf_counter() - t0)
    return out


def bench_tokenize(docs: list[str], rounds: int, work: Path, batch_bytes: int) -> dict:
    tokenizer = train_bpe(iter(docs), 8192)
    items = [Doc(f"doc-{i}", t) for i, t in enumerate(docs)]
    batches, batch, size = [], [], 0
    for d in docs:  # the same batches tokenize_docs forms
        batch.append(d)
        size += len(d)
        if size >= batch_bytes:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)

    def direct() -> int:
        n = 0
        for b in batches:
            for enc in tokenizer.tok.encode_batch_fast(b, add_special_tokens=False):
                n += len(enc.ids)
        return n

    def pipeline(i: int) -> int:
        result = tokenize_docs(iter(items), tokenizer, work / f"tok{i}", 0.05, batch_bytes=batch_bytes)
        return sum(result["tokens"].values()) - len(items)  # minus one EOS per document

    direct(), pipeline(-1)  # warm-up: thread pools, page cache
    # Wall time and process CPU time (all threads): on a shared machine CPU time is the steadier
    # measure of the work each side does; both are reported.
    wall = {"direct": [], "pipeline": []}
    cpu = {"direct": [], "pipeline": []}
    for i in range(rounds):
        for name, fn in (("direct", direct), ("pipeline", lambda: pipeline(i))):
            w0, c0 = time.perf_counter(), time.process_time()
            n = fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
            if name == "direct":
                n_direct = n
            else:
                n_pipe = n
    assert n_direct == n_pipe, (n_direct, n_pipe)
    d, p = statistics.median(wall["direct"]), statistics.median(wall["pipeline"])
    dc, pc = statistics.median(cpu["direct"]), statistics.median(cpu["pipeline"])
    mb = sum(len(x.encode()) for x in docs) / 1e6
    return {"tokens": n_direct, "direct_s": d, "pipeline_s": p, "direct_mb_per_s": mb / d,
            "pipeline_mb_per_s": mb / p, "overhead_wall": p / d - 1, "overhead_cpu": pc / dc - 1,
            "direct_cpu_s": dc, "pipeline_cpu_s": pc, "target_overhead": 0.15,
            "meets_target": max(p / d, pc / dc) - 1 <= 0.15, "rounds": rounds, "batch_bytes": batch_bytes,
            "wall_runs_s": wall, "cpu_runs_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="*", help="text files (default: /work/shared/data/*.txt or the stdlib)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-mb", type=float, default=4.0, help="use at most this much text")
    parser.add_argument("--batch-bytes", type=int, default=4 << 20)
    parser.add_argument("--threads", type=int, default=1,
                        help="tokenizers threads (default 1: per-core figures, steadier CPU times)")
    args = parser.parse_args()
    # Must precede the first use of tokenizers, which sizes its thread pool once.
    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)
    names, docs = load_corpus(args.corpus, args.max_mb)
    if not docs:
        sys.exit("no documents in the corpus")
    mb = sum(len(d.encode()) for d in docs) / 1e6
    print(f"corpus: {', '.join(names)}: {len(docs):,} documents, {mb:.2f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pipe = bench_pipeline(docs, work)
        pipe_tok = bench_pipeline(docs, work, tokenize=True)
        steps = bench_steps(docs)
        tok = bench_tokenize(docs, args.rounds, work, args.batch_bytes)

    from rich.console import Console
    from rich.table import Table

    table = Table(title="kiln prep throughput")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("pipeline (1 worker), MB/s per core", f"{pipe['mb_per_s_per_core']:.2f}")
    table.add_row("  + BPE training and token shards, MB/s", f"{pipe_tok['mb_per_s_per_core']:.2f}")
    table.add_row("documents kept", f"{pipe['docs_out']:,} / {pipe['docs_in']:,}")
    for name, rate in steps.items():
        table.add_row(f"  step {name}, MB/s", f"{rate:.2f}")
    table.add_row("tokenize: tokenizers direct, MB/s", f"{tok['direct_mb_per_s']:.2f}")
    table.add_row("tokenize: prep shard writer, MB/s", f"{tok['pipeline_mb_per_s']:.2f}")
    table.add_row("shard-writer overhead, wall time", f"{100 * tok['overhead_wall']:+.1f}%")
    table.add_row("shard-writer overhead, CPU time", f"{100 * tok['overhead_cpu']:+.1f}%")
    table.add_row("target: both <= 15%", "ok" if tok["meets_target"] else "MISSED")
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "corpus": names, "documents": len(docs), "mb": mb, "pipeline": pipe, "pipeline_with_tokenize": pipe_tok, "steps_mb_per_s": steps,
        "tokenize": tok, "tokenizer_threads": args.threads, "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                     "platform": platform.platform()},
        "command": "python benchmarks/prep_pipeline.py " + " ".join(sys.argv[1:]),
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Exact-substring dedup (suffix array) on ~100 MB of real text: seconds and peak RSS per 100 MB.

Corpus: the given files/directories (default: /work/shared/data/*.txt when present, then the
Python standard library sources, then the installed packages' Python sources) read until
--mb megabytes; each file is one document. Each measurement runs in a fresh process, which
reports its peak RSS (ru_maxrss) minus its RSS after loading the corpus (the working memory of
the dedup). Baseline: libdivsufsort building the suffix array alone (the unavoidable part), so
the ratio column is the cost of the whole dedup relative to one suffix-array construction.

    python benchmarks/dedup_suffix_array.py [PATH ...] [--mb 100] [--min-length 100]

Prints a table and writes benchmarks/results/dedup_suffix_array.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from kiln.data.corpus import stdlib_files

RESULTS = Path(__file__).parent / "results" / "dedup_suffix_array.json"
SHARED = Path("/work/shared/data")
SUFFIXES = {".txt", ".py", ".md", ".rst"}


def default_sources() -> list[Path]:
    sources = sorted(SHARED.glob("*.txt")) if SHARED.is_dir() else []
    sources += stdlib_files()
    site = Path(sysconfig.get_paths()["purelib"])
    sources += sorted(site.rglob("*.py"))
    return sources


def expand(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"{path}: no such file or directory")
    return files


def load_corpus(files: list[Path], max_bytes: int) -> list[str]:
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text:
            continue
        texts.append(text[: max_bytes - total])
        total += len(texts[-1].encode("utf-8"))
        if total >= max_bytes:
            break
    return texts


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(kind: str, corpus_file: str, min_length: int, out: mp.Queue) -> None:
    import pydivsufsort

    from kiln.prep.dedup.suffix_array import SuffixArrayConfig, dedup_substrings, join_documents

    with open(corpus_file, "rb") as f:
        texts = pickle.load(f)
    if kind == "suffix_array_only":  # the baseline works on the joined bytes, so build them first
        corpus, _ = join_documents([t.encode("utf-8", errors="surrogatepass") for t in texts])
    base = rss_bytes()
    start = time.perf_counter()
    if kind == "suffix_array_only":
        pydivsufsort.divsufsort(corpus)
        removed = 0
    else:
        result = dedup_substrings(texts, SuffixArrayConfig(min_length=min_length, keep=kind.split(":")[1]))
        removed = sum(result.removed_bytes)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put({"seconds": seconds, "peak_rss": peak, "rss_before": base, "working_bytes": peak - base,
             "removed_bytes": removed})


def measure(kind: str, corpus_file: str, min_length: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, corpus_file, min_length, queue))
    proc.start()
    result = queue.get(timeout=3600)
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--min-length", type=int, default=100)
    args = parser.parse_args()

    files = expand(args.paths) if args.paths else default_sources()
    texts = load_corpus(files, int(args.mb * 1e6))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"corpus: {len(texts)} documents, {n_bytes / 1e6:.1f} MB, k = {args.min_length} bytes")
    with tempfile.TemporaryDirectory() as tmp:
        corpus_file = os.path.join(tmp, "corpus.pkl")
        with open(corpus_file, "wb") as f:
            pickle.dump(texts, f)
        del texts
        runs = {kind: measure(kind, corpus_file, args.min_length)
                for kind in ("suffix_array_only", "dedup:first", "dedup:none")}
    base = runs["suffix_array_only"]["seconds"]
    per100 = 100e6 / n_bytes
    print(f"\n{'run':<20}{'seconds':>9}{'s/100MB':>9}{'x SA':>7}{'work GB':>9}{'GB/100MB':>10}{'B/byte':>8}{'removed %':>11}")
    for kind, r in runs.items():
        r["seconds_per_100mb"] = r["seconds"] * per100
        r["working_bytes_per_100mb"] = r["working_bytes"] * per100
        r["working_bytes_per_corpus_byte"] = r["working_bytes"] / n_bytes
        r["ratio_to_suffix_array"] = r["seconds"] / base
        print(f"{kind:<20}{r['seconds']:>9.1f}{r['seconds_per_100mb']:>9.1f}{r['ratio_to_suffix_array']:>7.2f}"
              f"{r['working_bytes'] / 1e9:>9.2f}{r['working_bytes_per_100mb'] / 1e9:>10.2f}"
              f"{r['working_bytes_per_corpus_byte']:>8.1f}{100 * r['removed_bytes'] / n_bytes:>11.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "dedup_suffix_array", "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "corpus_bytes": n_bytes, "files_available": len(files),
        "min_length": args.min_length, "sources": [str(p) for p in args.paths] or ["default"],
        "runs": runs,
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()

"""kiln's MinHash-LSH dedup vs datasketch (MinHash + MinHashLSH) on near-duplicates of real text.

Data: windows of 200-500 words cut from real text (`/work/shared/data/*.txt` when present, else
or additionally the Python standard library sources), and for half of them 1-3 edited copies
(word deletions, insertions and substitutions at a rate drawn from EDIT_RATES). Ground truth is
the EXACT Jaccard similarity of the two documents' shingle sets, computed for every original-copy
and copy-copy pair of a family and for every cross-family pair either method reports; pairs with
J >= threshold are duplicates, and the documents to drop are the non-lowest members of the
connected components of that graph (the rule both methods apply to their own pairs).

kiln runs with its default exact verification of LSH candidates and, as a second row, with
signature-agreement verification. Both methods get the same shingles (word 5-grams of the case-folded text), num_perm and
threshold, start from raw text, run single-threaded in this process, and are timed in
interleaved rounds (median). Memory is the tracemalloc peak of a separate run of each.

    python benchmarks/dedup_minhash.py [--originals 2000] [--rounds 3] [--text PATH ...]

Prints a table and writes benchmarks/results/dedup_minhash.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from kiln.data.corpus import stdlib_files
from kiln.prep.dedup.components import component_labels, components_keep_lowest
from kiln.prep.dedup.lsh_params import format_s_curve
from kiln.prep.dedup.minhash import MinHashConfig, minhash_duplicates, minhash_edges
from kiln.prep.dedup.shingles import shingle_strings

RESULTS = Path(__file__).parent / "results" / "dedup_minhash.json"
SHARED = Path("/work/shared/data")
EDIT_RATES = (0.0, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1)  # fraction of words edited per copy


def source_words(paths: list[Path], min_words: int) -> list[list[str]]:
    texts = [p.read_text(encoding="utf-8", errors="replace").split() for p in paths]
    total = sum(len(t) for t in texts)
    if total < min_words:  # top up with the standard library (available everywhere)
        for path in stdlib_files():
            texts.append(path.read_text(encoding="utf-8", errors="replace").split())
            total += len(texts[-1])
            if total >= min_words:
                break
    return texts


def make_dataset(n_originals: int, paths: list[Path], seed: int = 0) -> tuple[list[str], list[int]]:
    """(documents in shuffled order, family id of each)."""
    rng = random.Random(seed)
    sources = source_words(paths, n_originals * 360)
    originals: list[list[str]] = []
    for words in sources:
        pos = 0
        while len(originals) < n_originals:
            size = rng.randint(200, 500)
            if pos + size > len(words):
                break
            originals.append(words[pos:pos + size])
            pos += size
    vocab = [w for words in originals for w in words[:50]]
    docs, family = [], []
    for fam, words in enumerate(originals):
        docs.append(" ".join(words))
        family.append(fam)
        if fam % 2:
            continue
        for _ in range(rng.randint(1, 3)):
            rate = rng.choice(EDIT_RATES)
            edited = list(words)
            for _ in range(round(rate * len(words))):
                op, i = rng.randrange(3), rng.randrange(len(edited))
                if op == 0 and len(edited) > 1:
                    del edited[i]
                elif op == 1:
                    edited.insert(i, rng.choice(vocab))
                else:
                    edited[i] = rng.choice(vocab)
            docs.append(" ".join(edited))
            family.append(fam)
    order = list(range(len(docs)))
    rng.shuffle(order)
    return [docs[i] for i in order], [family[i] for i in order]


def run_kiln(docs: list[str], config: MinHashConfig) -> np.ndarray:
    return minhash_duplicates(docs, config)


def run_datasketch(docs: list[str], config: MinHashConfig) -> tuple[np.ndarray, set[tuple[int, int]]]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    pairs: set[tuple[int, int]] = set()
    for i, doc in enumerate(docs):
        m = MinHash(num_perm=config.num_perm)
        m.update_batch([s.encode("utf-8") for s in shingle_strings(doc, config.shingle, config.ngram)])
        for j in lsh.query(m):
            pairs.add((j, i))
        lsh.insert(i, m)
    u = np.array([p[0] for p in pairs], dtype=np.int64)
    v = np.array([p[1] for p in pairs], dtype=np.int64)
    return ~components_keep_lowest(len(docs), u, v), pairs


def exact_jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def evaluate(dropped: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    tp = int((dropped & truth).sum())
    return {"dropped": int(dropped.sum()), "true_dropped": tp,
            "precision": tp / max(1, int(dropped.sum())), "recall": tp / max(1, int(truth.sum()))}


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def peak_bytes(fn, *args) -> int:
    tracemalloc.start()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--originals", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--text", nargs="*", type=Path,
                        default=sorted(SHARED.glob("*.txt")) if SHARED.is_dir() else [])
    args = parser.parse_args()

    config = MinHashConfig(num_perm=128, shingle="word", ngram=5, threshold=0.8)
    docs, family = make_dataset(args.originals, args.text)
    print(f"{len(docs)} documents ({args.originals} originals), {sum(map(len, docs)) / 1e6:.1f} MB")
    print(format_s_curve(*config.bands_rows(), config.threshold))

    sig_config = MinHashConfig(num_perm=128, shingle="word", ngram=5, threshold=0.8, verify="signature")
    ours_s, sig_s, theirs_s = [], [], []
    for _ in range(args.rounds):  # interleaved, so machine load hits all alike
        ours_s.append(timed(run_kiln, docs, config))
        sig_s.append(timed(run_kiln, docs, sig_config))
        theirs_s.append(timed(run_datasketch, docs, config))
    ours_dropped = run_kiln(docs, config)
    sig_dropped = run_kiln(docs, sig_config)
    sig_peak = peak_bytes(run_kiln, docs, sig_config)
    theirs_dropped, theirs_pairs = run_datasketch(docs, config)
    ours_peak = peak_bytes(run_kiln, docs, config)
    theirs_peak = peak_bytes(run_datasketch, docs, config)

    # ground truth: exact Jaccard of family pairs and of every pair either method put together
    shingles = [shingle_strings(d, config.shingle, config.ngram) for d in docs]
    members: dict[int, list[int]] = {}
    for i, fam in enumerate(family):
        members.setdefault(fam, []).append(i)
    candidates = {(a, b) for ids in members.values() for k, a in enumerate(ids) for b in ids[k + 1:]}
    ours_labels = _labels_of(ours_dropped, docs, config)
    candidates |= {(min(a, b), max(a, b)) for a, b in theirs_pairs}
    candidates |= _same_cluster_pairs(ours_labels)
    candidates |= _same_cluster_pairs(_labels_of(sig_dropped, docs, sig_config))
    jac = {p: exact_jaccard(shingles[p[0]], shingles[p[1]]) for p in candidates}
    true_pairs = [p for p, j in jac.items() if j >= config.threshold]
    truth = ~components_keep_lowest(len(docs), np.array([p[0] for p in true_pairs], np.int64),
                                    np.array([p[1] for p in true_pairs], np.int64))

    # pair-level view per Jaccard band: fraction of family pairs each method put in one cluster
    theirs_labels = component_labels(len(docs), np.array([min(p) for p in theirs_pairs], np.int64),
                                     np.array([max(p) for p in theirs_pairs], np.int64))
    bands = [(0.0, 0.6), (0.6, 0.7), (0.7, 0.75), (0.75, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 1.01)]
    family_pairs = [p for p in candidates if family[p[0]] == family[p[1]]]
    by_band = []
    for lo, hi in bands:
        sel = [p for p in family_pairs if lo <= jac[p] < hi]
        by_band.append({"jaccard": f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}", "pairs": len(sel),
                        "kiln_joined": sum(ours_labels[a] == ours_labels[b] for a, b in sel) / max(1, len(sel)),
                        "datasketch_joined": sum(theirs_labels[a] == theirs_labels[b] for a, b in sel) / max(1, len(sel))})

    ours_rate = len(docs) / statistics.median(ours_s)
    theirs_rate = len(docs) / statistics.median(theirs_s)
    results = {
        "kiln": {"docs_per_s": ours_rate, "seconds": ours_s, "peak_bytes": ours_peak,
                 **evaluate(ours_dropped, truth)},
        "kiln_signature_verify": {"docs_per_s": len(docs) / statistics.median(sig_s), "seconds": sig_s,
                                  "peak_bytes": sig_peak, "bands_rows": list(sig_config.bands_rows()),
                                  **evaluate(sig_dropped, truth)},
        "datasketch": {"docs_per_s": theirs_rate, "seconds": theirs_s, "peak_bytes": theirs_peak,
                       **evaluate(theirs_dropped, truth)},
    }
    print(f"\n{'method':<22}{'docs/s':>10}{'speedup':>9}{'peak MB':>9}{'dropped':>9}{'precision':>11}{'recall':>8}")
    for name, r in results.items():
        print(f"{name:<22}{r['docs_per_s']:>10.0f}{r['docs_per_s'] / theirs_rate:>8.2f}x{r['peak_bytes'] / 1e6:>9.1f}"
              f"{r['dropped']:>9}{r['precision']:>11.3f}{r['recall']:>8.3f}")
    print(f"true duplicates to drop: {int(truth.sum())}")
    print(f"\n{'exact J of family pairs':<26}{'pairs':>7}{'kiln':>8}{'datasketch':>12}   (fraction put in one cluster)")
    for row in by_band:
        print(f"{row['jaccard']:<26}{row['pairs']:>7}{row['kiln_joined']:>8.3f}{row['datasketch_joined']:>12.3f}")
    bands_, rows_ = config.bands_rows()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "dedup_minhash", "machine": platform.processor() or platform.machine(),
        "documents": len(docs), "originals": args.originals, "mb": sum(map(len, docs)) / 1e6,
        "sources": [str(p) for p in args.text] or ["stdlib"], "edit_rates": EDIT_RATES,
        "config": {"num_perm": config.num_perm, "shingle": config.shingle, "ngram": config.ngram,
                   "threshold": config.threshold, "kiln_bands_rows": [bands_, rows_], "verify": config.verify},
        "true_duplicates": int(truth.sum()), "results": results, "by_jaccard": by_band,
        "speedup": ours_rate / theirs_rate,
    }, indent=2) + "\n")
    print(f"\nspeedup {ours_rate / theirs_rate:.2f}x; wrote {RESULTS}")


def _labels_of(dropped: np.ndarray, docs: list[str], config: MinHashConfig) -> np.ndarray:
    """kiln's cluster label per document (recomputed: `minhash_duplicates` returns only the mask)."""
    u, v = minhash_edges(docs, config)
    labels = component_labels(len(docs), u, v)
    assert np.array_equal(~components_keep_lowest(len(docs), u, v), dropped)
    return labels


def _same_cluster_pairs(labels: np.ndarray) -> set[tuple[int, int]]:
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(i)
    return {(a, b) for ids in groups.values() if len(ids) > 1 for k, a in enumerate(ids) for b in ids[k + 1:]}


if __name__ == "__main__":
    main()

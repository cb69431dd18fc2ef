"""By hand, not in the suite (16 processes on a 2-core machine): ep x tp x pp under ddp and zero1
with edp > 1 (dp4 x tp2 x pp2 = 16 gloo ranks, ep2 over the 4 replicas: edp 2), a MoE model (SGD),
against one process on the same global batch of 8, over 5 steps (loss, grad norm, aux and z loss)
at test_data_tensor_pipeline_parallel.py's tolerance. Built from that module's pieces.

    python tests/parallel/sixteen_ranks.py
"""
import pathlib
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parents[1])]  # tests/, tests/parallel/, the repository
from conftest import write_stdlib_corpus  # noqa: E402
from ranks import run_ranks  # noqa: E402
from test_data_tensor_pipeline_parallel import CASES, MOE, REL, job  # noqa: E402
from test_moe_tensor_parallel_layouts import rows, train_on_rank  # noqa: E402

LAYOUT = {"train.batch_size": 2, "parallel.dp_replicate": 4, "parallel.tp": 2, "parallel.pp": 2,
          "parallel.pp_microbatches": 2, "parallel.ep": 2}
RUNS = {"ddp_1f1b": {**MOE, **CASES["ddp_1f1b"]}, "zero1_interleaved": {**MOE, **CASES["zero1_interleaved"]}}


def worker(rank, world, text_file, tmp):
    for name, extra in RUNS.items():
        train_on_rank(rank, world, job(text_file, **{**LAYOUT, **extra}), tmp / name)


def main() -> int:
    from kiln.train.trainer import train

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sixteen"))
    text = write_stdlib_corpus(tmp / "corpus.txt")  # conftest's text_file
    ref = tmp / "one"
    train(job(text, **{**MOE, "train.batch_size": 8}), ref)
    want = rows(ref)
    run_ranks(worker, 16, tmp, text, tmp, timeout=1200)
    failed = 0
    for name in RUNS:
        got = rows(tmp / name)
        ok = got == pytest.approx(want, rel=REL)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want) if w)
        print(name, "matches one process" if ok else "DIFFERS", f"worst rel {worst:.2e}", len(got), "values")
        print(" got ", [round(x, 6) for x in got[:8]])
        print(" want", [round(x, 6) for x in want[:8]])
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

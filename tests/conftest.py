import sys
from pathlib import Path

import pytest

from kiln.data.corpus import stdlib_files

import torch

# Test models are tiny: one intra-op thread is faster for them and leaves the other core to
# the subprocesses some tests start.
torch.set_num_threads(1)

TINY = [
    "--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
    "--set", "data.tokenizer=byte", "--set", "data.seq_len=32", "--set", "model.max_seq_len=64",
    "--set", "train.batch_size=4", "--set", "train.steps=12", "--set", "train.eval_every=6",
    "--set", "train.eval_batches=2", "--set", "checkpoint.every=6", "--set", "train.dtype=fp32",
    "--set", "metrics.progress=plain", "--set", "schedule.warmup_steps=2",
    # A given peak for MFU: no CPU matmul probe per run (~2-3 s of busy work per rank per run, far
    # more on a loaded machine). tests/train/test_trainer.py sets 0 to keep the probe covered.
    "--set", "metrics.peak_flops=1e11",
]


def float8_import_error() -> str | None:
    """Why torchao.float8 does not import here, or None. AttributeError too: a torchao made for a
    newer torch (0.18 on torch 2.6) fails inside its own import."""
    try:
        import torchao.float8  # noqa: F401
    except (ImportError, AttributeError) as e:
        return f"torchao.float8 does not import here: {e}"
    return None


def float8_cpu_matmul_error() -> str | None:
    """Why float8 GEMMs (torch._scaled_mm) cannot run on CPU here, or None: torch 2.7 has no CPU
    kernel ("Could not run 'aten::_scaled_mm' with arguments from the 'CPU' backend"); 2.8 and later do."""
    one = torch.tensor(1.0)
    x = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (NotImplementedError, RuntimeError) as e:
        return f"torch {torch.__version__} has no float8 GEMM on CPU: {str(e)[:80]}"
    return None


def require_fsdp2_on_cpu(hsdp: bool = False) -> None:
    """Skip a test that runs FSDP2 (`hsdp`: over dp_replicate x dp_shard) on CPU where this torch
    cannot or kiln refuses it: 2.6's FSDP2 does not run on CPU; 2.7's runs and gloo sums its
    averages, so kiln makes it sum and divide, which its HSDP all-reduce cannot."""
    from kiln import torch_compat

    if not torch_compat.fsdp_runs_on_cpu():
        pytest.skip(f"FSDP2 does not run on CPU under torch {torch.__version__} (kiln refuses it there)")
    if not torch_compat.fsdp_can_force_sum(hsdp=hsdp):
        what = "HSDP" if hsdp else "FSDP2"
        pytest.skip(f"{what} cannot average over gloo under torch {torch.__version__} (kiln refuses it there)")


def tiny_overrides(source: Path, **extra) -> list[str]:
    out = [TINY[i + 1] for i in range(0, len(TINY), 2)] + [f"data.source={str(source)!r}"]
    out += [f"{k}={v}" for k, v in extra.items()]
    return out


def write_stdlib_corpus(path: Path) -> Path:
    """~200 KB of real text (standard-library sources) in one file at `path`."""
    parts, size = [], 0
    for f in stdlib_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size > 200_000:
            break
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """~200 KB of real text (standard-library sources) in one file."""
    return write_stdlib_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def short_docs_dir(tmp_path_factory) -> Path:
    """A directory of 300 documents of 2-7 words of real text (standard-library sources): a
    32-token window of them holds several documents."""
    folder = tmp_path_factory.mktemp("short_docs")
    words = " ".join(f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()[:3]).split()
    start = 0
    for i in range(300):
        n = 2 + (5 * i) % 6
        (folder / f"doc{i:03d}.txt").write_text(" ".join(words[start:start + n]), encoding="utf-8")
        start += n
    return folder


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """A directory of 40 small documents."""
    d = tmp_path_factory.mktemp("docs")
    for i, f in enumerate(stdlib_files()[:40]):
        (d / f"doc{i:03d}.txt").write_text(f.read_text(encoding="utf-8", errors="replace")[:8000], encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def dp_reference(tmp_path_factory, text_file) -> dict[int, float]:
    """Per-step losses of `kiln train` in one process on tests/parallel/test_data_parallel.py's
    `common` settings and global batch: the reference that test_data_parallel, test_context_parallel
    and test_tensor_parallel each compared against (one launch for the session, not one per module)."""
    from test_data_parallel import GLOBAL_BATCH, STEPS, common, losses, run_kiln, sets

    run = tmp_path_factory.mktemp("dp") / "single"
    run_kiln(["train", "--run-dir", str(run), *sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH}))])
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


@pytest.fixture(scope="session")
def cross_layout_reference(tmp_path_factory, text_file) -> Path:
    """tests/parallel/test_cross_layout.py's reference: kiln's trainer in this process, 6 steps of its
    "single" layout, which also tokenizes the shards every run of test_cross_layout and
    test_pipeline_data_parallel reads (`<parent>/shards`). Returns the run directory (with the
    overrides in sets.json); read, never changed, by both modules."""
    import json

    from kiln.config import load_config
    from kiln.train.trainer import train
    from test_cross_layout import overrides

    root = tmp_path_factory.mktemp("xlayout_reference")
    sets = overrides(text_file, root / "shards", "single")
    train(load_config(None, sets), root / "reference")
    (root / "reference" / "sets.json").write_text(json.dumps(sets))
    return root / "reference"


@pytest.fixture(scope="session")
def ddp2_torchrun_run(tmp_path_factory, text_file) -> Path:
    """`kiln train` under `torchrun --standalone --nproc-per-node=2`, DDP, 6 steps with
    tests/parallel/test_data_parallel.py's `ddp2_args`: one launch, read (never changed) by the ddp
    case there and as the one-node reference of test_multinode_launch.py and test_slurm_script.py."""
    from test_data_parallel import ddp2_args, run_kiln  # tests/parallel: on sys.path once collected

    run = tmp_path_factory.mktemp("ddp2") / "one-node"
    run_kiln(["train", "--run-dir", str(run), *ddp2_args(text_file)], nproc=2)
    return run


def kiln_cmd() -> list[str]:
    return [sys.executable, "-m", "kiln.cli"]

"""What `train.activation_checkpointing = "op"` keeps of a block (kiln/parallel/parallelize.py
keep_compute_op_outputs), measured per rank, against kiln/plan/memory.py
`ModelShape.op_kept_bytes_per_token`.

Measured (eager, gloo, tp 1, 2 and 4, fp32 and bf16 autocast): the bytes of every output the
selective checkpoint keeps in one training forward (each storage once; DTensors by their local
tensor), for 2 and 4 blocks: the difference / 2 is one block. The formula is exact here: q/k/v,
SDPA's output and logsumexp, the output projection's and the MLP's matmul outputs (under tp the
row-parallel ones' reduce-scatter outputs), all divided by tp, so the normed inputs that tp
all-gathers are not kept whole (their gather runs again in backward). Negative control: a policy
that also keeps the all-gathers' outputs (what checkpointing without the op rule saves under tp)
measures more than the formula. The compiled count is in tests/plan/test_compiled_saved.py.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)

SEQ, BATCH = 32, 2
MODEL = ["model.dim=64", "model.n_heads=4", "model.vocab_size=256", f"data.seq_len={SEQ}", f"model.max_seq_len={SEQ}",
         f"train.batch_size={BATCH}", "train.activation_checkpointing=op"]

if not hasattr(torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False), "op_output"):
    pytest.skip(f"torch {torch.__version__}'s selective checkpoint does not show a policy the op's output "
                f"(2.12 on), which this measurement reads", allow_module_level=True)


def kept_bytes(rank, world, keep_gathers=False):
    """{(dtype, layers): bytes the selective checkpoint keeps on this rank in one forward}."""
    from torch.distributed.tensor import DTensor
    from torch.utils.checkpoint import CheckpointPolicy

    from kiln.parallel import parallelize

    policy, gathers = parallelize.keep_compute_op_outputs, {torch.ops._c10d_functional.wait_tensor.default}
    seen, total = set(), [0]

    def count(t):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if hasattr(t, "__tensor_flatten__"):  # AsyncCollectiveTensor: its inner tensor
            for name in t.__tensor_flatten__()[0]:
                count(getattr(t, name))
        elif isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()

    def measuring(ctx, op, *args, **kwargs):
        kept = policy(ctx, op, *args, **kwargs)
        if keep_gathers and op in gathers:  # the negative control's mistake
            kept = CheckpointPolicy.MUST_SAVE
        if kept == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            for t in ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]:
                count(t)
        return kept

    parallelize.keep_compute_op_outputs = measuring
    try:
        return _measure(rank, world, seen, total)
    finally:  # tp 1 runs in the test's own process: later tests get kiln's policy back
        parallelize.keep_compute_op_outputs = policy


def _measure(rank, world, seen, total):
    from kiln.config import load_config
    from kiln.parallel.dims import ParallelDims
    from kiln.train.trainer import build_model

    out = {}
    for dtype in ("fp32", "bf16"):
        for layers in (2, 4):
            cfg = load_config(None, MODEL + [f"train.dtype={dtype}", f"model.n_layers={layers}", f"parallel.tp={world}"])
            dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank, seq_len=SEQ)
            if world > 1 and dims.mesh is None:
                dims.build_mesh("cpu")
            model = build_model(cfg, dims, torch.device("cpu"))
            tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
            seen.clear()
            total[0] = 0
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            out[dtype, layers] = total[0]
    return out


def per_block_per_token(measured: dict, dtype: str) -> float:
    return (measured[dtype, 4] - measured[dtype, 2]) / 2 / (BATCH * SEQ)


@pytest.mark.timeout(300)
def test_op_checkpointing_keeps_what_the_formula_counts_split_by_tp(tmp_path):
    from kiln.config import ModelConfig
    from kiln.plan.memory import ModelShape

    shape = ModelShape.from_config(ModelConfig(dim=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=SEQ), 256)
    runs = {1: [kept_bytes(0, 1)]}
    for tp in (2, 4):
        (tmp_path / f"tp{tp}").mkdir()
        runs[tp] = run_ranks(kept_bytes, tp, tmp_path / f"tp{tp}", timeout=240)
    (tmp_path / "wrong").mkdir()
    wrong = run_ranks(kept_bytes, 2, tmp_path / "wrong", True, timeout=240)
    for tp, per_rank in runs.items():
        assert all(r == per_rank[0] for r in per_rank), (tp, per_rank)  # every rank keeps the same
        for dtype, act in (("fp32", 4), ("bf16", 2)):
            expected = shape.op_kept_bytes_per_token(act) / tp
            assert per_block_per_token(per_rank[0], dtype) == pytest.approx(expected, rel=1e-9), (tp, dtype)
    # keeping the gathered normed inputs too (whole, 2 x dim per token) is more than the formula
    got = per_block_per_token(wrong[0], "fp32")
    assert got == pytest.approx(shape.op_kept_bytes_per_token(4) / 2 + 2 * 4 * shape.dim, rel=1e-9)

"""DDP and ZeRO-1 with tensor parallelism (replicated data parallelism over tp-sharded parameters,
Megatron-LM's default layout): `kiln train`'s trainer in-process on 4 gloo ranks (one launch)
against one process on the same global batch.

Layouts (4 ranks, dp_replicate=2 x tp=2; AdamW, so the optimizer state matters; clipping at 0.5):
- ddp_tp2, zero1_tp2: a dense model; kiln's replicas average the local tp shards' gradients over
  the 2 replicas (data_parallel.OverlappedReplicas); zero1 partitions the state of those shards.
- ddp_tp2_accum2: the same global batch in 2 micro-batches per rank (one all-reduce per step), in
  10 KB buckets started during backward.
- ep2_tp2_ddp, ep2_tp2_zero1: 4 experts (top-2, capacity 1.0) split over the 2 replicas and their
  hidden units over tp (expert tensor parallel); the experts' gradients are expert_parallel.py's.
The step-3 checkpoints of ddp_tp2 and zero1_tp2 continue (steps 4-5) in one process.

Tolerance: fp32, relative 1e-5 per step for the loss and the pre-clipping grad norm (and the MoE
losses): the layouts change only the order of sums. Negative control (must fail at step 1): the
gradients averaged over the tp group instead of the data-parallel one.
"""

import shutil

import pytest

from ranks import run_ranks
from test_expert_pipeline_context import (GLOBAL_BATCH, MOE, REL, SAVE_AT, STEPS, assert_matches_one_process,
                                          assert_same, jobs_with_mistakes, moe_job, rows)

DENSE = {"model.n_heads": 4, "model.n_kv_heads": 2, "data.seq_len": 16, "model.init_std": 0.1}
MOE_TP = {**MOE, **DENSE}
DP_TP = {"parallel.tp": 2, "parallel.dp_replicate": 2}
LAYOUTS = {  # name -> (model settings, [parallel] + train settings, data-parallel ranks x micro-batches)
    "single": (DENSE, {}, 1),
    "moe_single": (MOE_TP, {}, 1),
    "ddp_tp2": (DENSE, {**DP_TP, "parallel.dp_mode": "'ddp'"}, 2),
    "zero1_tp2": (DENSE, {**DP_TP, "parallel.dp_mode": "'zero1'"}, 2),
    "ddp_tp2_accum2": (DENSE, {**DP_TP, "parallel.dp_mode": "'ddp'", "train.grad_accum": 2}, 4),
    "ep2_tp2_ddp": (MOE_TP, {**DP_TP, "parallel.ep": 2, "parallel.dp_mode": "'ddp'"}, 2),
    "ep2_tp2_zero1": (MOE_TP, {**DP_TP, "parallel.ep": 2, "parallel.dp_mode": "'zero1'"}, 2),
}
MISTAKE = "averaged_over_tp"


def overrides(text_file, shards, name):
    model, parallel, splits = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", **parallel}
    return moe_job(text_file, shards, per_rank, splits, moe=model)


def deliberate_mistake(kind):
    """Patch one deliberate mistake into this process; returns the undo."""
    if kind == MISTAKE:  # after the (right) start broadcast, the gradients averaged over tp's group
        from torch.distributed.tensor import DTensor

        from kiln.parallel.data_parallel import Replicas

        saved = Replicas._setup

        def setup(self, params, buffers):
            saved(self, params, buffers)
            self.group = next(p for p in params if isinstance(p, DTensor)).device_mesh.get_group()

        Replicas._setup = setup
        return lambda: setattr(Replicas, "_setup", saved)
    if isinstance(kind, tuple) and kind[0] == "count":  # not a mistake: 10 KB buckets, counted
        import json

        import torch.distributed as dist

        from kiln.parallel.data_parallel import OverlappedReplicas, Replicas

        saved, saved_init, calls = Replicas._wait_all, OverlappedReplicas.__init__, []

        def wait_all(self):
            calls.append([i in self._inflight for i in range(len(self.buckets))])  # started in backward
            saved(self)

        Replicas._wait_all = wait_all
        OverlappedReplicas.__init__ = lambda self, *a, **k: saved_init(self, *a, **{**k, "bucket_cap_mb": 0.01})

        def undo():
            Replicas._wait_all, OverlappedReplicas.__init__ = saved, saved_init
            (kind[1] / f"rank{dist.get_rank()}.json").write_text(json.dumps(calls))
        return undo
    return lambda: None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("dptp")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    out = {name: root / name for name in LAYOUTS}
    out[MISTAKE] = root / MISTAKE
    train(load_config(None, sets["single"]), out["single"])  # writes the shared shards first
    train(load_config(None, sets["moe_single"]), out["moe_single"])
    out["counts"] = root / "counts"
    out["counts"].mkdir()
    jobs = [(None, out[name], sets[name], None, ("count", out["counts"]) if name == "ddp_tp2_accum2" else None)
            for name in LAYOUTS if "single" not in name]
    jobs.append((None, out[MISTAKE], sets["ddp_tp2"], 1, MISTAKE))
    (root / "ranks4").mkdir()
    run_ranks(jobs_with_mistakes, 4, root / "ranks4", deliberate_mistake, jobs, timeout=400)
    for source in ("ddp_tp2", "zero1_tp2"):
        out[f"{source}->single"] = run = root / f"{source}-to-single"
        shutil.copytree(out[source], run, ignore=shutil.ignore_patterns(f"step-{STEPS}"))
        train(load_config(None, sets["single"]), run, resume=True)
    return out


def test_global_batch_is_the_same_everywhere():
    for model, parallel, splits in LAYOUTS.values():
        assert GLOBAL_BATCH // splits * splits == GLOBAL_BATCH


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ddp_tp2", "zero1_tp2", "ddp_tp2_accum2"])
def test_dense_ddp_or_zero1_with_tp_matches_one_process(runs, name):
    expected, got = rows(runs["single"]), rows(runs[name])
    assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1))
    assert_same(expected, got, range(1, STEPS + 1), name, keys=("loss", "grad_norm"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ep2_tp2_ddp", "ep2_tp2_zero1"])
def test_ep_tp_under_ddp_or_zero1_matches_one_process(runs, name):
    assert_matches_one_process(runs["moe_single"], runs[name], 4, name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["ddp_tp2", "zero1_tp2"])
def test_checkpoint_continues_in_one_process(runs, source):
    import json

    pair = f"{source}->single"
    run_row = [json.loads(x) for x in (runs[pair] / "metrics.jsonl").read_text().splitlines() if '"run"' in x][-1]
    assert run_row["resumed_from"] == SAVE_AT and run_row["world_size"] == 1
    assert_same(rows(runs["single"]), rows(runs[pair]), range(SAVE_AT + 1, STEPS + 1), pair, keys=("loss", "grad_norm"))


@pytest.mark.timeout(600)
def test_gradients_averaged_over_tp_fail_the_comparison(runs):
    expected, got = rows(runs["single"]), rows(runs[MISTAKE])
    assert sorted(got) == [1]
    assert got[1]["loss"] == pytest.approx(expected[1]["loss"], rel=REL)  # the same first forward
    assert got[1]["grad_norm"] != pytest.approx(expected[1]["grad_norm"], rel=10 * REL)


def test_grad_accum_all_reduces_once_per_step(runs):
    """ddp_tp2_accum2 ran with 10 KB buckets (the model's ~100 KB of local shards in several): one
    averaging per step (in the last micro-batch's backward), every bucket started by its
    gradients' hooks during that backward, before the end-of-backward wait."""
    import json

    for rank in range(4):
        calls = json.loads((runs["counts"] / f"rank{rank}.json").read_text())
        assert len(calls) == STEPS, calls
        assert all(len(started) > 3 and all(started) for started in calls), calls

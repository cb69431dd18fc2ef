"""Expert parallelism under HSDP, through kiln's trainer on 4 gloo ranks, against one process on
the same global batch: dp_replicate=2 x dp_shard=2 (dp_mode fsdp, and zero2), ep=2 carved out
of dp_shard (kiln/parallel/dims.py `_build_expert_mesh`: ep groups {0, 1} and {2, 3}, one per
replica; the experts FSDP-sharded over "edp" = {0, 2} and {1, 3}, across the replicas).

Model and run (tests/parallel/test_expert_pipeline_context.py's MoE settings and trainer jobs):
4 experts, top-2 with capacity factor 1.0 (tokens are dropped: checked on the reference run),
load-balancing and router z-losses, AdamW with clipping active on every step, 5 steps.

Tolerance: fp32, relative 1e-5 per step for the loss (LM + weighted aux + z-loss), the
pre-clipping grad norm and the logged aux and z-losses (the layout changes only the order of
sums; observed at most 2.3e-7 under both modes). The fsdp run's step-3 checkpoint continues
(steps 4-5) in one process and under ep=2 fsdp at 2 ranks with the same figures (weights, AdamW
moments, LR schedule, the loader's global position).

Negative controls, each patched into the 4 ranks for one step and required to miss the
reference: HSDP without the all-reduce across replicas (FSDP over dp_shard only: each replica
steps on its own half-batch gradient; the step-1 grad norm misses), and both replicas reading
the same data-parallel slice (the loader's dp_rank taken within the replica: the step-1 loss
misses). Observed misses: 1.5e-2 (grad norm) and 4.5e-3 (loss) relative, both > 10 x the
tolerance.
"""

import shutil

import pytest

from ranks import run_ranks
from test_expert_pipeline_context import (CLIP, REL, SAVE_AT, STEPS, assert_same, jobs_with_mistakes, moe_job,
                                          rows)

HSDP = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.ep": 2}
LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "hsdp_ep2": (4, HSDP),
    "hsdp_ep2_zero2": (4, {**HSDP, "parallel.dp_mode": "'zero2'"}),  # blocks kept gathered forward -> backward
    "fsdp_ep2": (2, {"parallel.ep": 2}),  # dp_shard=2, ep=2: every expert on one rank
}


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.dp_replicate": 1, "parallel.dp_shard": -1,
                "parallel.ep": 1, **parallel}
    return moe_job(text_file, shards, per_rank, world)


def hsdp_mistake(kind):
    """Patch one deliberate HSDP mistake into this process; returns the undo."""
    from kiln.parallel.dims import ParallelDims

    if kind == "no_replica_reduce":  # FSDP over dp_shard alone: no all-reduce across the replicas
        name, saved = "grad_mesh_names", ParallelDims.grad_mesh_names
        patched = property(lambda self: tuple(n for n in saved.fget(self) if n != "dp_replicate"))
    elif kind == "replicas_same_data":  # the loader's slice numbered within the replica only
        name, saved = "dp_rank", ParallelDims.dp_rank
        patched = property(lambda self: self.mesh["dp_shard"].get_local_rank())
    else:
        return lambda: None
    setattr(ParallelDims, name, patched)
    return lambda: setattr(ParallelDims, name, saved)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.model.moe import MoE
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("hsdp_ep")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    dropped = []  # the reference run's per-layer dropped share of assignments, every forward
    forward = MoE.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        dropped.append(float(self.last_dropped_fraction))
        return out

    MoE.forward = recording
    try:
        train(load_config(None, sets["single"]), root / "single")  # writes the shared shards first
    finally:
        MoE.forward = forward
    out = {"single": root / "single", "dropped": dropped}
    for name in ("hsdp_ep2", "no_replica_reduce", "replicas_same_data"):
        out[name] = root / name
    out["hsdp_ep2_zero2"] = root / "hsdp_ep2_zero2"
    jobs = [(None, out["hsdp_ep2"], sets["hsdp_ep2"], None, None),
            (None, out["hsdp_ep2_zero2"], sets["hsdp_ep2_zero2"], None, None),
            (None, out["no_replica_reduce"], sets["hsdp_ep2"], 1, "no_replica_reduce"),
            (None, out["replicas_same_data"], sets["hsdp_ep2"], 1, "replicas_same_data")]
    (root / "ranks4").mkdir()
    run_ranks(jobs_with_mistakes, 4, root / "ranks4", hsdp_mistake, jobs, timeout=300)
    out["hsdp_ep2->fsdp_ep2"] = root / "to-fsdp-ep2"
    (root / "ranks2").mkdir()
    run_ranks(jobs_with_mistakes, 2, root / "ranks2", hsdp_mistake, [(out["hsdp_ep2"], out["hsdp_ep2->fsdp_ep2"], sets["fsdp_ep2"],
                                              None, None)], timeout=300)
    out["hsdp_ep2->single"] = run = root / "to-single"
    shutil.copytree(out["hsdp_ep2"], run, ignore=shutil.ignore_patterns(f"step-{STEPS}"))
    train(load_config(None, sets["single"]), run, resume=True)
    return out


def run_rows(run):
    import json

    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, mode", [("hsdp_ep2", "fsdp"), ("hsdp_ep2_zero2", "zero2")])
def test_hsdp_with_ep_matches_one_process(runs, name, mode):
    expected = rows(runs["single"])
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert min(r["grad_norm"] for r in expected.values()) > CLIP  # clipping is active on every step
    assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in expected.values())
    assert max(runs["dropped"]) > 0  # capacity 1.0 drops assignments: the dropping path is compared too
    run_row = run_rows(runs[name])[0]
    assert (run_row["world_size"], run_row["dp_mode"], run_row["dp_replicate"], run_row["dp_shard"]) == (4, mode, 2, 2)
    assert_same(expected, rows(runs[name]), range(1, STEPS + 1), name)


@pytest.mark.parametrize("pair, world", [("hsdp_ep2->single", 1), ("hsdp_ep2->fsdp_ep2", 2)])
def test_hsdp_ep_checkpoint_continues_in_another_layout(runs, pair, world):
    expected, got = rows(runs["single"]), rows(runs[pair])
    run_row = run_rows(runs[pair])[-1]
    assert run_row["resumed_from"] == SAVE_AT and run_row["world_size"] == world
    assert sorted(got) == list(range(1, STEPS + 1))  # the copied rows 1..3, then this run's 4..5
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), pair)


@pytest.mark.parametrize("name, key", [("no_replica_reduce", "grad_norm"), ("replicas_same_data", "loss")])
def test_each_hsdp_mistake_fails_the_comparison(runs, name, key):
    expected, got = rows(runs["single"]), rows(runs[name])
    assert sorted(got) == [1]
    assert got[1][key] != pytest.approx(expected[1][key], rel=10 * REL)
    with pytest.raises(AssertionError):
        assert_same(expected, got, [1], name)

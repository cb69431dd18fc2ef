"""Expert parallelism under the replicating data-parallel modes (ddp with pp, zero1 with and
without pp), through kiln's trainer on 4 gloo ranks, against one process on the same global batch.

Layouts (4 experts, top-2 with capacity factor 1.0, so assignments are dropped: checked on the
reference run; tests/parallel/test_expert_pipeline_context.py's MoE settings and trainer jobs):
- ep2_pp2_ddp: 2 stages x 2 DDP replicas, ep = 2 over each stage's replicas: DDP around each stage
  chunk leaves the experts out (data_parallel.py `leave_experts_to_expert_parallel`), their
  gradients are divided by the 2 data-parallel ranks in backward (expert_parallel.py). 1F1B.
- ep2_zero1: 4 replicas, ep = 2, so each expert is replicated on 2 ranks ("edp"), its gradient
  summed there; ZeRO-1 over the dense parameters, a plain AdamW over the experts
  (data_parallel.py `ZeroRedundancyExceptExperts`).
- ep2_pp2_zero1: 2 stages x 2 replicas under zero1 (GPipe): both of the above in each stage.
ep2_zero1's step-3 checkpoint continues (steps 4-5) in one process (a plain AdamW loads the split
optimizer's state) and in ep2_zero1 itself (the split optimizer loads it back).

Tolerance: fp32, relative 1e-5 per step over 5 steps for the loss (LM + weighted aux + z-loss), the
pre-clipping grad norm and the logged aux and z-losses (the layouts change only the order of sums).
Negative controls, each patched into the 4 ranks and required to miss the reference: ep2_pp2_ddp
with the expert gradients neither summed over their replicas nor divided by the data-parallel
ranks (step-1 grad norm), and ep2_zero1 with the schedule's learning rate never handed to the
two optimizers (each keeps the constructor's lr; the step-2 loss misses).
"""

import json
import shutil

import pytest

from ranks import run_ranks
from test_expert_pipeline_context import (REL, SAVE_AT, STEPS, assert_matches_one_process, assert_same,
                                          jobs_with_mistakes, moe_job, rows)

LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "ep2_pp2_ddp": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "'ddp'",
                        "parallel.pp_schedule": "'1f1b'"}),
    "ep2_zero1": (4, {"parallel.ep": 2, "parallel.dp_mode": "'zero1'"}),
    "ep2_pp2_zero1": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "'zero1'",
                          "parallel.pp_schedule": "'gpipe'"}),
}


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.pp": 1, "parallel.ep": 1, **parallel}
    return moe_job(text_file, shards, per_rank, world // per_rank["parallel.pp"])


def replicated_mistake(kind):
    """Patch one deliberate mistake into this process; returns the undo."""
    if kind == "expert_grads_not_reduced":  # the hook is bound when the experts are parallelized
        from kiln.parallel import expert_parallel as xp

        saved = xp._reduced_expert_grad
        xp._reduced_expert_grad = lambda grad, dp_size, replica_group: grad
        return lambda: setattr(xp, "_reduced_expert_grad", saved)
    if kind == "lr_not_handed_on":
        from kiln.parallel.data_parallel import ZeroRedundancyExceptExperts as Split

        saved = Split._push_hyperparameters
        Split._push_hyperparameters = lambda self: None
        return lambda: setattr(Split, "_push_hyperparameters", saved)
    return lambda: None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.model.moe import MoE
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("ep_replicated")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    dropped = []  # the reference run's dropped share of assignments, every MoE forward
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
    out = {name: root / name for name in LAYOUTS}
    out["dropped"] = dropped
    for name in ("ep2_zero1->ep2_zero1", "ep2_zero1->single", "expert_grads_not_reduced", "lr_not_handed_on"):
        out[name] = root / name.replace(">", "")
    jobs = [(None, out[name], sets[name], None, None) for name in LAYOUTS if name != "single"]
    jobs += [(out["ep2_zero1"], out["ep2_zero1->ep2_zero1"], sets["ep2_zero1"], None, None),
             (None, out["expert_grads_not_reduced"], sets["ep2_pp2_ddp"], 1, "expert_grads_not_reduced"),
             (None, out["lr_not_handed_on"], sets["ep2_zero1"], 2, "lr_not_handed_on")]
    (root / "ranks").mkdir()
    run_ranks(jobs_with_mistakes, 4, root / "ranks", replicated_mistake, jobs, timeout=400)
    shutil.copytree(out["ep2_zero1"], out["ep2_zero1->single"], ignore=shutil.ignore_patterns(f"step-{STEPS}"))
    train(load_config(None, sets["single"]), out["ep2_zero1->single"], resume=True)
    return out


def run_rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, mode", [("ep2_pp2_ddp", "ddp"), ("ep2_zero1", "zero1"), ("ep2_pp2_zero1", "zero1")])
def test_ep_under_ddp_or_zero1_matches_one_process(runs, name, mode):
    assert max(runs["dropped"]) > 0  # capacity 1.0 drops assignments: the dropping path is compared too
    assert run_rows(runs[name])[0]["dp_mode"] == mode
    assert_matches_one_process(runs["single"], runs[name], 4, name)


@pytest.mark.parametrize("pair, world", [("ep2_zero1->single", 1), ("ep2_zero1->ep2_zero1", 4)])
def test_zero1_ep_checkpoint_continues(runs, pair, world):
    expected, got = rows(runs["single"]), rows(runs[pair])
    run_row = run_rows(runs[pair])[-1]
    assert run_row["resumed_from"] == SAVE_AT and run_row["world_size"] == world
    assert sorted(got) == list(range(1, STEPS + 1))  # the copied rows 1..3, then this run's 4..5
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), pair)


@pytest.mark.parametrize("name, step, key", [("expert_grads_not_reduced", 1, "grad_norm"),
                                             ("lr_not_handed_on", 2, "loss")])
def test_each_deliberate_mistake_fails_the_comparison(runs, name, step, key):
    expected, got = rows(runs["single"]), rows(runs[name])
    assert sorted(got) == list(range(1, step + 1))
    assert got[step][key] != pytest.approx(expected[step][key], rel=10 * REL)
    with pytest.raises(AssertionError):
        assert_same(expected, got, [step], name)


@pytest.mark.parametrize("sets, expected", [
    # kiln's ddp/zero1 take no tensor-parallel parameters, dense or expert
    ({"dp_mode": "ddp", "tp": 2}, "parallel.ep=2 with parallel.tp=2 needs parallel.dp_mode='fsdp' or 'zero2'"),
    ({"dp_mode": "zero1", "tp": 2}, "parallel.ep=2 with parallel.tp=2 needs parallel.dp_mode='fsdp' or 'zero2'"),
    # ep is carved out of the replicas under zero1 as under ddp
    ({"dp_mode": "zero1", "ep": 4, "pp": 4}, "parallel.ep=4 must divide dp_replicate=2"),
])
def test_remaining_refusals_name_the_key(sets, expected):
    from kiln.config import ParallelConfig
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    cfg = ParallelConfig(**{"ep": 2, **sets})
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")) as e:
        ParallelDims.from_config(cfg, world_size=8, rank=0, local_rank=0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_ep_with_pp_and_zero1_are_accepted(mode):
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    d = ParallelDims.from_config(ParallelConfig(ep=2, pp=2, dp_mode=mode), world_size=8, rank=0, local_rank=0)
    assert (d.dp_mode, d.dp_replicate, d.pp, d.ep) == (mode, 4, 2, 2)
    d = ParallelDims.from_config(ParallelConfig(ep=2, dp_mode="zero1"), world_size=4, rank=0, local_rank=0)
    assert (d.dp_mode, d.dp_replicate, d.ep) == ("zero1", 4, 2)

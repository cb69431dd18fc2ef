"""Auxiliary-loss-free load balancing (model.moe_bias_update_rate, DeepSeek-V3's expert bias)
through kiln's trainer on 4 gloo ranks, against one process on the same global batch.

The bias moves after every step by the sign of (mean load - load) over the step's global batch,
so every layout must count each sequence's assignments once and sum them over the ranks that see
other sequences: data parallel (with ep carved out of it), not cp or tp ranks (they hold the same
whole-sequence counts). Layouts: dp4 (FSDP; each rank 1 of the 4 sequences), ddp4, ep2 x pp2 (each
stage's 2 data-parallel ranks; the loads of each stage's own layers, the schedule's shape-inference
forward left out), ep4 x cp2 (cp ranks hold zig-zag halves), ep2 x tp2 (the bias a replicated
DTensor on the tp mesh), and ep2 x tp2 with ep borrowing tp (parallel.etp=1: each tp rank routes its
own sequence shard). The step-3 checkpoint of ep2 x pp2 continues in one process (the bias is
saved and loads into another layout).

The MoE is DeepSeek-V3-shaped: fine-grained experts (model.moe_hidden = 48, the dense FFN 128
wide; tp shards their 48 hidden units) and a shared expert beside them, here with Qwen2-MoE's
per-token sigmoid gate (tp shards the shared MLP as a dense one; the gate, sequence-sharded like
the norms, has a replicated weight whose gradient is summed over tp). Routing is sigmoid top-2 with capacity drops, and the rate (0.05) moves the biases far enough to
change which experts tokens pick within the 5 steps, so a wrong bias shows in the loss as well.
Tolerance: fp32, relative 1e-5 per step for the loss and grad norm; the final biases equal
(each a sum of +-rate steps, so equal signs give equal bits; compared to 1e-6). Negative control:
dp4 with the loads left unsummed over the data-parallel ranks (each rank balances on its own
sequence) must fail. DiLoCo (2 replicas): each replica's own biases survive a resume (a
non-persistent bias, tried by hand, fails it at step 4).
"""

import json
import shutil

import pytest

from ranks import patch_for_one_run, run_ranks
from test_expert_pipeline_context import (CLIP, GLOBAL_BATCH, SAVE_AT, STEPS, jobs_with_mistakes, moe_job, rows,
                                          single_run_first, train_jobs)

REL, RATE = 1e-5, 0.05
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_capacity_factor": 1.0,
       "model.moe_router": "'sigmoid'", "model.moe_bias_update_rate": RATE, "model.moe_hidden": 48,
       "model.moe_shared_experts": 1, "model.moe_shared_gate": "true",
       "model.moe_aux_loss_weight": 0.0, "model.moe_z_loss_weight": 0.001, "model.init_std": 0.1}
LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "dp4": (4, {}),
    "ddp4": (4, {"parallel.dp_mode": "'ddp'"}),
    "ep2_pp2": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.pp_schedule": "'1f1b'"}),
    "ep4_cp2": (4, {"parallel.cp": 2, "parallel.ep": 4}),
    "ep2_tp2": (4, {"parallel.tp": 2, "parallel.ep": 2}),
    "ep2_tp2_etp1": (4, {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}),
}


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.pp": 1, "parallel.cp": 1, "parallel.tp": 1,
                "parallel.ep": 1, **parallel}
    data_ranks = world // (per_rank["parallel.pp"] * per_rank["parallel.cp"] * per_rank["parallel.tp"])
    return moe_job(text_file, shards, per_rank, data_ranks, moe=MOE)


def deliberate_mistake(kind):
    """For jobs_with_mistakes: "loads_not_summed" makes each rank balance its experts on its own
    sequences only; returns the undo."""
    if kind == "loads_not_summed":
        from kiln.train import trainer

        return patch_for_one_run(trainer, "batch_group", lambda dims: None)
    return lambda: None


def final_biases(run):
    from kiln.eval.load import load_run
    from kiln.model.moe import moe_layers

    model = load_run(run).model
    return [m.expert_bias.clone() for m in moe_layers(model)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("expert_bias")
    sets, out = single_run_first(root, text_file, LAYOUTS, overrides)
    out["dp4 unsummed"] = root / "dp4-unsummed"
    jobs = [(None, out[name], sets[name], None, None) for name in LAYOUTS if name != "single"]
    jobs.append((None, out["dp4 unsummed"], sets["dp4"], None, "loads_not_summed"))
    (root / "ranks").mkdir()
    run_ranks(jobs_with_mistakes, 4, root / "ranks", deliberate_mistake, jobs, timeout=300)  # one spawn for all
    out["ep2_pp2->single"] = run = root / "pp-to-single"
    shutil.copytree(out["ep2_pp2"], run, ignore=shutil.ignore_patterns(f"step-{STEPS}"))
    train(load_config(None, sets["single"]), run, resume=True)
    return out


def assert_same(expected, got, steps, label):
    for step in steps:
        for key in ("loss", "grad_norm", "moe_max_load"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=REL), \
                f"{label}, step {step}, {key}: {got[step][key]} != {expected[step][key]}"


def test_the_biases_move_and_change_routing(runs):
    import torch

    biases = final_biases(runs["single"])
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases)
    # every step moves every expert by +-RATE or 0 (exactly the mean load): multiples of RATE
    steps = torch.cat(biases) / RATE
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert min(r["grad_norm"] for r in rows(runs["single"]).values()) > CLIP  # clipping active throughout
    assert len(rows(runs["single"])) == STEPS and GLOBAL_BATCH == 4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_layout_balances_like_one_process(runs, name):
    run_row = next(json.loads(x) for x in (runs[name] / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert run_row["world_size"] == LAYOUTS[name][0]
    assert_same(rows(runs["single"]), rows(runs[name]), range(1, STEPS + 1), name)
    for ours, theirs in zip(final_biases(runs[name]), final_biases(runs["single"])):
        torch_close(ours, theirs)


def test_bias_checkpoint_continues_in_another_layout(runs):
    got = rows(runs["ep2_pp2->single"])
    assert_same(rows(runs["single"]), got, range(SAVE_AT + 1, STEPS + 1), "ep2_pp2 -> single")
    for ours, theirs in zip(final_biases(runs["ep2_pp2->single"]), final_biases(runs["single"])):
        torch_close(ours, theirs)


def test_loads_unsummed_over_data_parallel_fail_the_comparison(runs):
    import torch

    ours, theirs = final_biases(runs["dp4 unsummed"]), final_biases(runs["single"])
    assert any(not torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, theirs))
    expected, got = rows(runs["single"]), rows(runs["dp4 unsummed"])
    assert any(got[s]["loss"] != pytest.approx(expected[s]["loss"], rel=10 * REL) for s in range(2, STEPS + 1))


def torch_close(a, b):
    import torch

    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_diloco_replicas_keep_their_own_biases_across_a_resume(tmp_path, text_file):
    """Under DiLoCo each replica balances on its own batches between outer syncs (every 2 steps
    here), so at the step-3 checkpoint the two replicas hold different biases: each is saved
    with its replica's state, and the continued run gives the uninterrupted run's losses."""
    shards = tmp_path / "shards"
    sets = moe_job(text_file, shards, {"parallel.dp_mode": "'ddp'", "parallel.dp_replicate": 2,
                                       "parallel.diloco_inner_steps": 2}, 2, moe=MOE)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    (tmp_path / "ranks").mkdir()
    run_ranks(train_jobs, 2, tmp_path / "ranks", [(None, whole, sets, None, None), (whole, resumed, sets, None, None)],
              timeout=200)
    expected, got = rows(whole), rows(resumed)  # the copy's rows up to step 3, then the continued run's
    run_row = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines() if '"run"' in x][-1]
    assert run_row["resumed_from"] == SAVE_AT and run_row["dp_mode"] == "diloco"
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), "diloco resumed")
    assert any(b.abs().max() > 0 for b in final_biases(whole))

"""DiLoCo with DDP or ZeRO-1 inside each replica, combined with tp, pp, cp and ep (one 8-rank gloo
launch: 2 replicas x 2 DDP / ZeRO-1 ranks x tp 2, pp 2 or cp 2, and x cp 2 with ep 2 (MoE); and 2
replicas x FSDP 2 x pp 2 with the experts over ep 2, pp, fsdp and ep in one replica), against test_diloco.py's
one-process definition at its tolerance (relative 1e-5 per step over 9 steps, 3 outer steps). The
ranks of a replica that hold the same parameters (its dp_shard x cp ranks) split the outer
all-reduce: each sends 1/S of its parameters across the replicas (S = 2, with cp 4; with ep,
whose experts differ between them, 1), and keeps 1/S of the anchor and outer momentum. ddp and
zero1 inside alone run in test_diloco.py's 4-rank launch, with the trainer's resume; here the
trainer's zero1 x tp replicas resume too."""
import pytest
import torch

import test_diloco as diloco
from ranks import run_ranks

# 8 ranks give each rank one of the step's 4 rows: the pipelines run one micro-batch (GPipe)
PIPELINE = {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 1}
CASES = {  # name: ([parallel] keys, model fields, the ranks of a replica holding the same parameters)
    "zero1_tp": ({"dp_mode": "zero1", "dp_replicate": 2, "tp": 2}, {}, 2),
    "ddp_pp": ({"dp_mode": "ddp", "dp_replicate": 2, **PIPELINE}, {"n_layers": 2}, 2),
    "zero1_pp": ({"dp_mode": "zero1", "dp_replicate": 2, **PIPELINE}, {"n_layers": 2}, 2),
    "ddp_cp": ({"dp_mode": "ddp", "dp_replicate": 2, "cp": 2}, {"n_layers": 2}, 4),
    # MoE, ep 2 carved from a replica's dp_shard x cp = 4 ranks (experts replicated over the other 2);
    # the experts differ between a replica's ranks, so each sends all of its parameters
    "zero1_cp_ep": ({"dp_mode": "zero1", "dp_replicate": 2, "cp": 2, "ep": 2},
                    {"n_layers": 2, **diloco.FIELDS["ep"]}, 1),
    # and FSDP inside, with pp and the experts over ep = the replica's dp_shard 2 (each rank its own shard)
    "fsdp_pp_ep": ({"dp_mode": "fsdp", "dp_replicate": 2, "ep": 2, **PIPELINE},
                   {"n_layers": 2, **diloco.FIELDS["ep"]}, 1)}


def _register() -> None:
    for name, (layout, fields, _) in CASES.items():
        diloco.LAYOUTS[name], diloco.FIELDS[name] = layout, fields


def _runs_here(name: str) -> bool:
    from kiln import torch_compat

    # one micro-batch through 2 stages: GPipe takes it from torch 2.11 on (kiln refuses it before)
    return "pp" not in CASES[name][0] or torch_compat.gpipe_takes_fewer_microbatches()


def _replicated_ranks(rank, world, root, sets):
    """The cases against the definition, then kiln's trainer with 2 replicas x zero1 2 x tp 2:
    uninterrupted, and its step-3 checkpoint (between outer syncs) continued in a copy."""
    import os
    from pathlib import Path

    import kiln.train.trainer as trainer
    from kiln.config import load_config
    from ranks import continue_in_copy

    _register()
    runs = {name: diloco.split_replica_run(name, rank, diloco.STEPS, world=world) if _runs_here(name) else None
            for name in CASES}  # (losses, bytes sent, local parameters, the size of its anchor)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    trainer.train(load_config(None, sets), Path(root) / "zero1_tp_whole")
    continue_in_copy(Path(root) / "zero1_tp_whole", diloco.RESUME_AT, Path(root) / "zero1_tp_resumed", sets)
    return {name: run and (*run[:3], sum(a.numel() for a in run[3])) for name, run in runs.items()}


@pytest.fixture(scope="module")
def eight_root(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("diloco8")
    (root / "work").mkdir()
    sets = diloco.resume_overrides(text_file, root / "shards") + [
        "parallel.dp_mode='zero1'", "parallel.dp_replicate=2", "parallel.tp=2"]
    return root, run_ranks(_replicated_ranks, 8, root / "work", str(root), sets, timeout=300)


@pytest.fixture(scope="module")
def eight_ranks(eight_root):
    return eight_root[1]


@pytest.mark.timeout(400)
def test_zero1_tp_replicas_resume_between_outer_syncs_exactly(eight_root):
    # Each rank's 1/2 of the anchor and momentum (tp-sharded), gathered whole into the checkpoint
    # and sliced again at load: the continued run equals the uninterrupted one bit for bit.
    diloco.continued_exactly(eight_root[0], "zero1_tp", "diloco_layout_2x2x2_ddp")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", CASES)
def test_replicas_of_ddp_or_zero1_with_tp_pp_or_cp_match_the_definition(eight_ranks, name):
    if not _runs_here(name):
        pytest.skip(f"torch {torch.__version__}: GPipe refuses fewer micro-batches than stages (kiln refuses it)")
    _register()
    expected = diloco.simulated(**diloco.FIELDS[name])
    split = CASES[name][2]
    for rank, runs in enumerate(eight_ranks):
        losses, sent, n_local, anchor = runs[name]
        assert losses == pytest.approx(expected, rel=diloco.REL), (rank, losses, expected)
        assert sent == [4 * -(-n_local // split)] * (diloco.STEPS // diloco.H)  # its 1/S across the replicas
        assert anchor == -(-n_local // split)  # and keeps 1/S of the anchor and outer momentum

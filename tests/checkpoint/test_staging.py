"""An async save stages on each rank only the tensors that rank writes (kiln/checkpoint/staging.py
`owned_state`): state replicated over ranks costs one copy in host memory over all of them, not
one per rank, and the checkpoint still loads whole on every rank."""

import torch

from tests.parallel.ranks import run_ranks

from kiln.checkpoint.staging import _without


def _state(rank):
    g = torch.Generator().manual_seed(0)
    replicated = {f"layer{i}.weight": torch.randn(64, 32 + i, generator=g) for i in range(6)}
    return {"model": replicated,
            "optim": {"state": {0: {"exp_avg": torch.full((16,), 3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "own": {f"rank{rank}": torch.full((8,), float(rank))},  # a key only this rank holds
            "step": 7}


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return state


def _nbytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _save_and_load(rank, world, root, replica_dir):
    import torch.distributed.checkpoint as dcp

    from kiln.checkpoint.manager import CheckpointManager

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ckpt = CheckpointManager(root, is_main=rank == 0, async_save=True, replica_dir=replica_dir)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32.0).reshape(8, 4)
    dtensors = {"replicated": distribute_tensor(full, mesh, [Replicate()]),  # as HSDP's shards over replicas
                "sharded": distribute_tensor(full, mesh, [Shard(0)])}
    state = _state(rank)
    state["model"].pop("layer5.weight")
    ckpt.save(1, state)  # then again with a tensor more: the owners are chosen anew, not remembered
    state = {**_state(rank), "dtensors": dtensors}
    ckpt.save(2, state)
    staged = ckpt._staging.nbytes
    staged_keys = sorted(ckpt._staging.last["model"]) + sorted(ckpt._staging.last["dtensors"])
    ckpt.save(3, state)  # the same structure: the remembered owners, the same share
    assert ckpt._staging.nbytes == staged
    assert sorted(ckpt._staging.last["model"]) + sorted(ckpt._staging.last["dtensors"]) == staged_keys
    assert all(r.ok for r in ckpt.close())
    fresh = {**_zeros_like(_state(rank)),
             "dtensors": {k: distribute_tensor(torch.zeros(8, 4), mesh, v.placements) for k, v in dtensors.items()}}
    dcp.load(fresh, checkpoint_id=str(root / "step-3"), process_group=ckpt.group)
    same = all(torch.equal(fresh["dtensors"][k].full_tensor(), full) for k in dtensors)
    same = same and all(torch.equal(fresh["model"][k], state["model"][k]) for k in state["model"])
    same = same and torch.equal(fresh["own"][f"rank{rank}"], state["own"][f"rank{rank}"])
    same = same and torch.equal(fresh["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    if ckpt.replicas is not None:
        ckpt.replicas.discard()
    return staged, staged_keys, same


def test_each_rank_stages_only_what_it_writes_and_the_save_loads_whole(tmp_path):
    world = 2
    results = run_ranks(_save_and_load, world, tmp_path, tmp_path / "ckpt", None)
    state = _state(0)
    dtensor = 8 * 4 * 4
    replicated = _nbytes(state["model"]) + _nbytes(state["optim"]) + dtensor
    own = _nbytes(state["own"]) + dtensor // world  # its own key and its shard of "sharded"
    assert all(same for _, _, same in results), "a rank did not load back what was saved"
    # every replicated tensor (plain or DTensor) staged by exactly one rank, each rank's own by itself
    keys = [k for _, staged_keys, _ in results for k in staged_keys]
    assert sorted(keys) == sorted([*state["model"], "replicated"] + ["sharded"] * world), keys
    assert sum(staged for staged, _, _ in results) == replicated + world * own
    # and the work is shared, not all on one rank (DCP's size-balanced choice)
    assert all(staged < replicated for staged, _, _ in results)


def test_memory_replicas_stage_the_whole_state(tmp_path):
    """A replica restores a rank from its own snapshot, so it needs all of it."""
    results = run_ranks(_save_and_load, 2, tmp_path, tmp_path / "ckpt", str(tmp_path / "shm"))
    state = _state(0)
    assert all(same for _, _, same in results)
    whole = _nbytes(state["model"]) + _nbytes(state["optim"]) + _nbytes(state["own"]) + 8 * 4 * 4 * 3 // 2
    assert all(staged == whole for staged, _, _ in results)


def test_without_removes_leaves_by_dcp_path_and_never_changes_the_input():
    state = {"optim": {"state": {0: {"exp_avg": 1, "step": 2}}, "param_groups": [{"params": [0]}]}, "w": 3}
    out = _without(state, [("optim", "state", "0", "exp_avg"), ("w",), ("optim", "param_groups", "0", "params")])
    assert out == {"optim": {"state": {0: {"step": 2}}, "param_groups": [{"params": [0]}]}}  # lists keep theirs
    assert state == {"optim": {"state": {0: {"exp_avg": 1, "step": 2}}, "param_groups": [{"params": [0]}]}, "w": 3}

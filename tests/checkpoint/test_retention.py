"""Retention: the last K plus every M-th step; never the newest complete one; room made before a save."""

import errno
from collections import namedtuple

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_fs

from kiln.checkpoint import manager as manager_mod
from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.retention import complete_steps, retained, to_prune
from kiln.train.trainer import ScalerState


@pytest.mark.parametrize("steps,keep_last,keep_every,kept", [
    ([1, 2, 3, 4, 5], 2, 0, {4, 5}),
    ([2, 4, 6, 8, 10, 12], 2, 4, {4, 8, 10, 12}),
    ([3, 5, 7], 1, 0, {7}),
    ([3, 5, 7], 0, 100, {7}),  # the newest survives whatever the configuration
    ([], 2, 3, set()),
])
def test_retained(steps, keep_last, keep_every, kept):
    assert retained(steps, keep_last, keep_every) == kept
    assert sorted(set(steps) - kept) == to_prune(steps, keep_last, keep_every)


def _state(value: float):
    return {"w": torch.full((256,), value), "step": int(value)}


def test_manager_keeps_last_and_every(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2, keep_every=4, async_save=True)
    for step in range(1, 11):
        results = mgr.save(step, _state(step))
        assert all(r.ok for r in results)
    mgr.close()
    assert complete_steps(tmp_path / "ck") == [4, 8, 9, 10]
    out = _state(0)
    assert mgr.load(out) == 10 and out["step"] == 10 and torch.equal(out["w"], torch.full((256,), 10.0))


def test_incomplete_dirs_are_not_counted_or_pruned(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=1)
    (tmp_path / "ck" / "step-99").mkdir(parents=True)
    for step in (1, 2):
        assert all(r.ok for r in mgr.save(step, _state(step)))
    assert complete_steps(tmp_path / "ck") == [2]
    assert (tmp_path / "ck" / "step-99").is_dir() and mgr.latest_step() == 2


def test_room_is_made_before_the_save_when_the_disk_is_short(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    mgr = CheckpointManager(ck, keep_last=2, keep_every=4, async_save=False)
    for step in (4, 8, 9, 10):
        assert all(r.ok for r in mgr.save(step, _state(step)))
    assert complete_steps(ck) == [4, 8, 9, 10]
    # The disk now reports less free space than one checkpoint, and the write itself fails:
    # step 9 (which this save's retention drops anyway) must already be gone when the writer runs,
    # and the newest complete checkpoint (10) must survive the failed save.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(manager_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    seen_by_writer = []
    real = dcp_fs._write_item

    def write_item(transforms, stream, *args, **kwargs):
        seen_by_writer.append(complete_steps(ck))
        raise OSError(errno.ENOSPC, "No space left on device", stream.name)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    lines = []
    mgr.log = lines.append
    [result] = mgr.save(11, _state(11))
    assert not result.ok and result.error.startswith("checkpoint at step 11 not written: no space left on device")
    assert seen_by_writer[0] == [4, 8, 10]
    assert complete_steps(ck) == [4, 8, 10] and not (ck / ".step-11.tmp").exists()
    assert lines == [result.error]
    monkeypatch.setattr(dcp_fs, "_write_item", real)
    out = _state(0)
    assert mgr.load(out) == 10 and out["step"] == 10


def test_make_room_can_be_turned_off(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    mgr = CheckpointManager(ck, keep_last=2, make_room=False)
    for step in (1, 2):
        mgr.save(step, _state(step))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(manager_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    mgr.save(3, _state(3))
    assert complete_steps(ck) == [2, 3]  # pruned only after the successful save


def test_async_save_result_rows(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", async_save=True)
    assert mgr.save(1, _state(1)) == []  # in flight
    assert mgr.latest_step() == 1  # counts as the latest: the trainer must not save step 1 again
    [first] = mgr.save(2, _state(2))  # waits for step 1 first: at most one in flight
    [second] = mgr.close()
    for result, step in ((first, 1), (second, 2)):
        row = result.row()
        assert row["ok"] and row["step"] == step and row["save_block_s"] >= 0 and row["save_background_s"] > 0
        assert row["size_bytes"] > 1024


def test_grad_scaler_state_round_trips(tmp_path):
    """fp16 runs save torch's GradScaler (kiln/train/trainer.py): the scale and its growth count
    come back, so a resumed run skips and grows exactly as the uninterrupted one."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    scaler.scale(torch.ones(()))  # its first use creates the scale
    scaler.update(new_scale=1024.0)
    scaler._growth_tracker.fill_(2)  # two good steps since the last change
    mgr = CheckpointManager(tmp_path / "ck", async_save=False)
    assert all(r.ok for r in mgr.save(5, {"scaler": ScalerState(scaler), "w": torch.ones(2)}))
    fresh = torch.amp.GradScaler("cpu", growth_interval=3)
    assert mgr.load({"scaler": ScalerState(fresh), "w": torch.zeros(2)}) == 5
    assert fresh.get_scale() == 1024.0 and fresh.state_dict()["_growth_tracker"] == 2
    assert "scaler" in mgr.saved_state_names(5)


def test_rng_state_follows_the_run_device_and_a_cpu_checkpoint_continues_on_a_gpu(tmp_path, monkeypatch):
    """Found on the GPU machine: a CPU run there saved the GPU generator on some ranks and not on
    others (pinned staging had initialized CUDA), and its resume asked for `rng.cuda` that was not
    saved. The GPU generator is saved iff the run trains on a GPU; a checkpoint without one (taken on
    a CPU) continues on a GPU with the CPU generator restored and the GPU's as seeded."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: asked.append(device) or torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: asked.append(("set", device)))
    with monkeypatch.context() as gpu_machine:  # CUDA present and initialized, the run on the CPU
        gpu_machine.setattr(torch.cuda, "is_available", lambda: True)
        gpu_machine.setattr(torch.cuda, "is_initialized", lambda: True)
        assert set(manager_mod.RNGState("cpu").state_dict()) == {"cpu"}
    mgr = CheckpointManager(tmp_path / "ck", async_save=False)
    torch.manual_seed(3)
    saved_cpu = torch.get_rng_state()
    assert all(r.ok for r in mgr.save(4, {"rng": manager_mod.RNGState("cpu")}))
    assert asked == []  # a CPU run never touches the GPU generator
    torch.manual_seed(5)
    on_gpu = manager_mod.RNGState(torch.device("cuda", 0))
    assert mgr.load({"rng": on_gpu}) == 4  # before: Missing key in checkpoint state_dict: rng.cuda
    assert torch.equal(torch.get_rng_state(), saved_cpu) and not on_gpu.cuda_saved and asked == []
    gpu_run = manager_mod.RNGState(torch.device("cuda", 0))  # a GPU run saves and restores its generator
    assert all(r.ok for r in mgr.save(8, {"rng": gpu_run}))
    assert mgr.load({"rng": manager_mod.RNGState(torch.device("cuda", 0))}) == 8
    assert asked == [torch.device("cuda", 0), torch.device("cuda", 0), ("set", torch.device("cuda", 0))]


@pytest.mark.parametrize("key, bad", [("scale", -1.0), ("scale", float("nan")), ("scale", "big"),
                                      ("_growth_tracker", -3), ("growth_interval", 0)])
def test_a_bad_scaler_value_is_one_line_and_an_older_checkpoint_is_used(tmp_path, key, bad):
    """A tampered scaler value never reaches torch: that checkpoint is skipped in one line naming
    the key, and the older good one loads."""
    from kiln.errors import KilnError

    good = torch.amp.GradScaler("cpu", init_scale=512.0)
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3, async_save=False)
    assert all(r.ok for r in mgr.save(1, {"scaler": ScalerState(good)}))
    tampered = type("Tampered", (), {"state_dict": lambda self: {**good.state_dict(), key: bad},
                                     "load_state_dict": lambda self, s: None})()
    assert all(r.ok for r in mgr.save(2, {"scaler": tampered}))
    lines = []
    mgr.log = lines.append
    fresh = torch.amp.GradScaler("cpu")
    assert mgr.load({"scaler": ScalerState(fresh)}) == 1 and fresh.get_scale() == 512.0
    assert len(lines) == 1 and f"scaler.{key}=" in lines[0] and "\n" not in lines[0]
    with pytest.raises(KilnError, match=f"scaler.{key}="):
        ScalerState(fresh).load_state_dict({**good.state_dict(), key: bad})

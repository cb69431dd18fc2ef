"""A checkpoint can come from someone else: loading it must never run code it carries."""

import inspect
import os
import pickle
import pickletools

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.manifest import write_manifest
from kiln.checkpoint.safe_load import UnsafeCheckpointError, load_metadata
from kiln.cli import main
from ckpt_testlib import copy_run, make_run

# DCP's explicit one-process switch (torch 2.6 has none and infers it: no process group here)
NO_DIST = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    return make_run(tmp_path_factory.mktemp("safe"), text_file)


class RunsShell:
    """Unpickling this calls os.system(touch MARKER): what a hostile .metadata would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class RunsExec:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _plant(step_dir, payload: bytes):
    """Replace .metadata and re-sign the manifest, as an attacker who sends a whole run dir would."""
    (step_dir / ".metadata").write_bytes(payload)
    write_manifest(step_dir, int(step_dir.name.split("-")[1]))


@pytest.mark.parametrize("payload", [RunsShell, RunsExec])
@pytest.mark.parametrize("command", ["generate", "eval", "train --resume"])
def test_malicious_metadata_is_refused_and_runs_nothing(trained, tmp_path, capsys, payload, command):
    run = copy_run(trained, tmp_path / "run")
    marker = tmp_path / "PWNED"
    # Both checkpoints: refusing one must not fall back to the other silently either.
    for step in ("step-2", "step-4"):
        _plant(run / "checkpoints" / step, pickle.dumps(payload(marker), protocol=2))
    argv = {"generate": ["generate", str(run), "--max-tokens", "4"],
            "eval": ["eval", str(run), "--max-tokens", "64", "--out", str(tmp_path / "r.json")],
            "train --resume": ["train", "--resume", str(run)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "the payload ran"
    assert "refused to load" in err and ".metadata" in err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "refused" in line]) == 1


def test_metadata_allowlist_is_exactly_dcps_classes(trained, tmp_path):
    real = (trained / "checkpoints" / "step-4" / ".metadata").read_bytes()
    assert load_metadata(real, "real").state_dict_metadata  # kiln's own saves load
    marker = tmp_path / "PWNED"
    hostile = [
        pickle.dumps(RunsShell(marker), protocol=4),  # STACK_GLOBAL
        pickle.dumps(RunsShell(marker), protocol=0),  # GLOBAL
        b"cbuiltins\neval\n(V__import__('os').system('touch " + str(marker).encode() + b"')\ntR.",
        b"ctorch\nload\n(Vx\ntR.",  # a torch global that is not a dtype
        b"csubprocess\nPopen\n((Vtouch\nV" + str(marker).encode() + b"\nltR.",
    ]
    for data in hostile:
        with pytest.raises(UnsafeCheckpointError, match="refused to load"):
            load_metadata(data, "hostile")
    with pytest.raises(UnsafeCheckpointError, match="not DCP metadata"):
        load_metadata(pickle.dumps({"a": 1}), "a dict")
    assert not marker.exists()
    # Every global the real metadata references is one the allowlist admits (and nothing more).
    names = {arg for op, arg, _ in pickletools.genops(real) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")}
    assert "posix" not in names and "builtins" not in names


def test_non_tensor_items_load_with_weights_only(tmp_path):
    """Byte items (DCP torch.saves them into .distcp) must not run code when loaded; stock DCP
    loads them with weights_only=False, which does."""
    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "checkpoints" / "step-1"
    dcp.save({"counter": RunsShell(marker), "w": torch.ones(2)}, checkpoint_id=str(ckpt), **NO_DIST)
    write_manifest(ckpt, 1)
    with pytest.raises(UnsafeCheckpointError, match="counter"):
        CheckpointManager(tmp_path / "checkpoints").load({"counter": 0, "w": torch.zeros(2)})
    assert not marker.exists()
    dcp.load({"counter": 0, "w": torch.zeros(2)}, checkpoint_id=str(ckpt), **NO_DIST)  # stock DCP
    assert marker.exists(), "the check above proves nothing if stock DCP would not run the payload"


def test_plain_values_still_round_trip(tmp_path):
    ckpt = tmp_path / "checkpoints"
    mgr = CheckpointManager(ckpt, async_save=False)
    state = {"n": 7, "f": float("inf"), "s": "adamw", "t": (0.9, 0.95), "l": [1, 2], "w": torch.arange(3.0)}
    assert all(r.ok for r in mgr.save(3, state))
    out = {"n": 0, "f": 0.0, "s": "", "t": (0, 0), "l": [], "w": torch.zeros(3)}
    assert mgr.load(out) == 3
    assert {k: v for k, v in out.items() if k != "w"} == {k: v for k, v in state.items() if k != "w"}
    assert torch.equal(out["w"], state["w"])


def test_metadata_cannot_point_outside_the_checkpoint(trained, tmp_path):
    import dataclasses

    real = load_metadata((trained / "checkpoints" / "step-4" / ".metadata").read_bytes(), "real")
    key = next(iter(real.storage_data))
    real.storage_data[key] = dataclasses.replace(real.storage_data[key], relative_path="../../config.toml")
    with pytest.raises(UnsafeCheckpointError, match="not a plain file name"):
        load_metadata(pickle.dumps(real), "crafted")


@pytest.mark.parametrize("damage, expected", [
    ("shrink", r"has chunks of \d+ elements for its \d+ \(a gap\)"),
    ("duplicate", r"has overlapping chunks at \[0, 0\] and \[0, 0\]"),
    ("outside", r"has a chunk at \[0, 0\] of \[\d+, \d+\] outside its shape \[\d+, \d+\]"),
])
def test_chunks_must_tile_each_tensor(trained, tmp_path, damage, expected):
    """DCP reads a tensor (or a ZeRO-1 rank's boxes of it) from whichever saved chunks overlap it:
    a crafted .metadata with a gap would leave part of it as it was, silently."""
    import dataclasses

    real = load_metadata((trained / "checkpoints" / "step-4" / ".metadata").read_bytes(), "real")
    fqn, item = next((k, v) for k, v in real.state_dict_metadata.items()
                     if getattr(v, "chunks", None) and len(v.size) == 2)
    chunk = item.chunks[0]
    grown = torch.Size([chunk.sizes[0] + 1, chunk.sizes[1]])
    item.chunks = {"shrink": [dataclasses.replace(chunk, sizes=torch.Size([chunk.sizes[0] - 1, chunk.sizes[1]]))],
                   "duplicate": [chunk, chunk],
                   "outside": [dataclasses.replace(chunk, sizes=grown)]}[damage]
    with pytest.raises(UnsafeCheckpointError, match=rf"^crafted: refused to load: tensor {fqn!r} {expected}$"):
        load_metadata(pickle.dumps(real), "crafted")

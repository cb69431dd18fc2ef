"""Every way a checkpoint can be damaged falls back to the newest good one with one warning line."""

import os
import shutil

import pytest
import torch

from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
from kiln.checkpoint.manifest import MANIFEST
from kiln.config import load_config
from kiln.eval.load import load_run
from kiln.train.trainer import train

from ckpt_testlib import copy_run, distcp_files, make_run, rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    return make_run(tmp_path_factory.mktemp("corrupt"), text_file)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_bits(path, span=1):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + span, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty_dir(d):
    shutil.rmtree(d)
    d.mkdir()


DAMAGE = {
    "truncate distcp": lambda d: _truncate(distcp_files(d)[0]),
    "zero-length distcp": lambda d: distcp_files(d)[0].write_bytes(b""),
    "delete distcp": lambda d: distcp_files(d)[0].unlink(),
    "delete metadata": lambda d: (d / ".metadata").unlink(),
    "truncate metadata": lambda d: _truncate(d / ".metadata"),
    "flip one byte": lambda d: _flip_bits(distcp_files(d)[0]),
    "flip a 4 KB span": lambda d: _flip_bits(distcp_files(d)[0], 4096),
    "flip metadata": lambda d: _flip_bits(d / ".metadata"),
    "empty step dir": _empty_dir,
    "delete manifest": lambda d: (d / MANIFEST).unlink(),
    "garbage manifest": lambda d: (d / MANIFEST).write_text("{not json"),
    "manifest escapes the dir": lambda d: (d / MANIFEST).write_text(
        '{"format": "kiln-checkpoint", "version": 1, "files": {".metadata": {"size": 1, "sha256": "%s"},'
        ' "../../config.toml": {"size": 1, "sha256": "%s"}}}' % ("0" * 64, "0" * 64)),
}


def _weights(run):
    return {k: v.clone() for k, v in load_run(run).model.state_dict().items()}


@pytest.mark.parametrize("case", list(DAMAGE) + ["stray empty step-99"])
def test_damaged_newest_checkpoint_falls_back_with_one_line(trained, tmp_path, case):
    run = copy_run(trained, tmp_path / "run")
    ckpts = run / "checkpoints"
    if case == "stray empty step-99":
        (ckpts / "step-99").mkdir()
        expected = 4
    else:
        DAMAGE[case](ckpts / "step-4")
        expected = 2
    lines = []
    model = load_run(trained).model  # a model of the right shape to load into
    step = CheckpointManager(ckpts, log=lines.append).load({"app": ModelOptimizerState(model)})
    assert step == expected
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("checkpoint skipped: ") and str(ckpts / ("step-99" if expected == 4 else "step-4")) in lines[0]
    good = copy_run(trained, tmp_path / "good")
    if expected == 2:
        shutil.rmtree(good / "checkpoints" / "step-4")
    for key, value in _weights(good).items():  # exactly the weights of the checkpoint it fell back to
        assert torch.equal(model.state_dict()[key], value), key


def test_resume_after_damage_continues_from_the_previous_checkpoint(trained, tmp_path, capfd):
    run = copy_run(trained, tmp_path / "run")
    _flip_bits(distcp_files(run / "checkpoints" / "step-4")[0], 4096)
    (run / "checkpoints" / ".step-6.tmp").mkdir()  # left by a save that was killed
    (run / "checkpoints" / ".step-6.tmp" / "__0_0.distcp").write_bytes(b"partial")
    cfg = load_config(run / "config.toml", ["train.steps=6"])
    result = train(cfg, run, resume=True)
    assert result.steps_done == 6
    assert rows(run, "run")[-1]["resumed_from"] == 2
    err = capfd.readouterr().err
    assert "checkpoint skipped:" in err and "checksum mismatch" in err and "Traceback" not in err
    assert not (run / "checkpoints" / ".step-6.tmp").exists()  # stray temporary directory cleaned
    # Steps 3-4 are replayed from step 2 with the same losses as the first time.
    first = {r["step"]: r["loss"] for r in rows(trained, "train")}
    replay = [r for r in rows(run, "train")][-4:]
    assert [r["step"] for r in replay] == [3, 4, 5, 6]
    assert [r["loss"] for r in replay[:2]] == [first[3], first[4]]


def test_readers_never_clean_what_they_read(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    (run / "checkpoints" / ".step-6.tmp").mkdir()
    assert load_run(run).step == 4
    assert (run / "checkpoints" / ".step-6.tmp").is_dir()


def test_nothing_good_is_one_error(trained, tmp_path):
    from kiln.errors import KilnError

    run = copy_run(trained, tmp_path / "run")
    for step in ("step-2", "step-4"):
        os.unlink(run / "checkpoints" / step / ".metadata")
    with pytest.raises(KilnError, match="no usable checkpoint"):
        load_run(run)

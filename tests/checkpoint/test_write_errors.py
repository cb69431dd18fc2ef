"""A full disk during a save: one clear line, partial files removed, the previous checkpoint kept,
training goes on (or stops cleanly); metrics rows are whole or absent."""

import errno
import json

import pytest
from torch.distributed.checkpoint import filesystem as dcp_fs

from kiln.checkpoint.errors import describe_write_error
from kiln.config import MetricsConfig, load_config
from kiln.errors import KilnError
from kiln.train.metrics import MetricsLogger
from kiln.train.trainer import train

from ckpt_testlib import RUN, rows
from conftest import tiny_overrides


def _disk_full_at(monkeypatch, tmp_name: str):
    """Make DCP's writer fail like a full disk (after writing part of the item) for one save."""
    real = dcp_fs._write_item

    def write_item(*args, **kwargs):  # (transforms, stream, ...) in torch 2.13, (stream, ...) in 2.6
        stream = next(a for a in args if hasattr(a, "write"))
        if tmp_name in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", stream.name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_save_is_one_line_and_training_continues(tmp_path, text_file, monkeypatch, capfd, async_save):
    _disk_full_at(monkeypatch, ".step-4.tmp")
    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(text_file, **{**RUN, "train.steps": 6,
                                                         "checkpoint.async_save": str(async_save).lower()}))
    result = train(cfg, run)
    assert result.steps_done == 6 and result.stop_reason == "completed"
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-6"]  # no partial .step-4.tmp
    failed = [r for r in rows(run, "checkpoint") if not r["ok"]]
    assert [r["step"] for r in failed] == [4]
    line = failed[0]["message"]
    assert line.startswith("checkpoint at step 4 not written: no space left on device (") and ".step-4.tmp" in line
    err = capfd.readouterr().err
    assert line in err and "Traceback" not in err and "enforce fail" not in err


def test_disk_full_stops_cleanly_when_configured(tmp_path, text_file, monkeypatch):
    _disk_full_at(monkeypatch, ".step-4.tmp")
    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(text_file, **{**RUN, "train.steps": 6, "checkpoint.on_error": "'stop'"}))
    with pytest.raises(KilnError, match=r"checkpoint at step 4 not written: no space left on device .*on_error='stop'"):
        train(cfg, run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    # With space again, the run resumes from the last good checkpoint; every metrics line is whole JSON.
    monkeypatch.undo()
    result = train(load_config(run / "config.toml", ["train.steps=6"]), run, resume=True)
    assert result.steps_done == 6 and rows(run, "run")[-1]["resumed_from"] == 2


def test_write_error_description_finds_the_os_error():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ck/.step-9.tmp/__0_0.distcp")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from e
    except RuntimeError as e:
        text = describe_write_error(e, "/ck/.step-9.tmp")
    assert text == "no space left on device (/ck/.step-9.tmp/__0_0.distcp)"
    assert describe_write_error(RuntimeError("x"), "/d") == "RuntimeError: x (/d)"


class _FullDisk:
    """A file whose writes stop half way through a row with ENOSPC, like a filling disk."""

    def __init__(self, f):
        self.f, self.fail = f, True

    def write(self, data):
        if self.fail:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()


def test_metrics_rows_are_whole_or_absent(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "run", "step": 0}\n{"kind": "train", "st')  # a half line from a crash
    logger = MetricsLogger(path, MetricsConfig(progress="none"), 10, 0)
    logger.log({"kind": "event", "step": 1, "message": "a"})
    logger._file = _FullDisk(logger._file)
    logger.log({"kind": "event", "step": 2, "message": "lost"})
    logger.log({"kind": "event", "step": 3, "message": "lost too"})
    logger._file.fail = False
    logger.log({"kind": "event", "step": 4, "message": "b"})
    logger.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 4]
    err = capsys.readouterr().err
    assert err.count("not written (no space left on device)") == 1

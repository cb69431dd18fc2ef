import json
import os

import pytest

from kiln.io import AtomicFile, atomic_file, atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_replace_the_target_and_leave_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(path, {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    atomic_write_bytes(path, b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_an_error_mid_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as f:
            f.write("half of the new")
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_unserializable_json_leaves_old_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    assert path.read_text() == "old"
    assert not (tmp_path / "r.json.tmp").exists()


def test_leftover_temporary_from_a_killed_run_is_replaced(tmp_path):
    path = tmp_path / "out.bin"
    (tmp_path / "out.bin.tmp").write_bytes(b"stale partial data" * 100)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert not (tmp_path / "out.bin.tmp").exists()


def test_symlink_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.txt.tmp").symlink_to(victim)
    atomic_write_text(tmp_path / "out.txt", "data")
    assert victim.read_text() == "precious"
    assert (tmp_path / "out.txt").read_text() == "data" and not (tmp_path / "out.txt").is_symlink()


def test_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.txt").symlink_to(victim)
    atomic_write_text(tmp_path / "out.txt", "data")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out.txt").is_symlink() and (tmp_path / "out.txt").read_text() == "data"


def test_atomic_file_object_commit_and_abort(tmp_path):
    w = AtomicFile(tmp_path / "a.bin", "wb")
    w.file.write(b"abc")
    assert not (tmp_path / "a.bin").exists()  # nothing visible before commit
    assert w.commit() == tmp_path / "a.bin"
    assert (tmp_path / "a.bin").read_bytes() == b"abc"
    w = AtomicFile(tmp_path / "a.bin", "wb")
    w.file.write(b"replacement")
    w.abort()
    w.abort()  # idempotent
    assert (tmp_path / "a.bin").read_bytes() == b"abc"
    assert sorted(os.listdir(tmp_path)) == ["a.bin"]
    with pytest.raises(ValueError):
        AtomicFile(tmp_path / "x", "a")


def test_atomic_path_for_libraries_that_write_by_name(tmp_path):
    from kiln.io import atomic_path

    target = tmp_path / "tok.json"
    target.write_text("old")
    with atomic_path(target) as tmp:
        assert tmp != target
        tmp.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("writer crashed")
    with pytest.raises(OSError, match="no regular file"):
        with atomic_path(target):
            pass  # the writer wrote nothing
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["tok.json"]


def test_read_text_file_gives_one_line_for_missing_or_undecodable_files(tmp_path):
    from kiln.errors import DataError
    from kiln.io import read_text_file

    good = tmp_path / "ok.txt"
    good.write_text("héllo", encoding="utf-8")
    assert read_text_file(good, error=DataError, missing="nope") == "héllo"
    with pytest.raises(DataError, match="^forget file gone$"):
        read_text_file(tmp_path / "absent.txt", error=DataError, missing="forget file gone")
    with pytest.raises(DataError, match="^forget file gone$"):  # a directory is not a file either
        read_text_file(tmp_path, error=DataError, missing="forget file gone")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text") as info:
        read_text_file(bad, error=DataError, missing="nope")
    assert "\n" not in str(info.value)

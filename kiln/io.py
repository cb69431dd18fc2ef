"""Atomic file writes: the one place kiln writes a file under a temporary name and renames it.

A reader (or a resumed run) sees either the previous file or the complete new one, never a
half-written one: the data goes to `<name>.tmp` beside the target, is flushed and fsynced, then
`os.replace` (atomic on POSIX within one filesystem) moves it over the target and the directory is
fsynced so the rename survives a power cut. On any error the temporary file is removed.

The temporary name is fixed rather than random (`tempfile.mkstemp`) on purpose: a run killed
mid-write leaves `<name>.tmp`, and the rerun of the same task reuses and replaces it instead of
accumulating stray files next to the outputs. A leftover at that name is unlinked and the new one
created with O_EXCL | O_NOFOLLOW, so a symlink planted there cannot redirect the write elsewhere;
the final `os.replace` swaps a symlink at the target itself for the new file, never writing
through it.

    with atomic_file(path) as f:          # text ("w", utf-8) or binary ("wb")
        f.write(...)
    atomic_write_text(path, text); atomic_write_bytes(path, data); atomic_write_json(path, obj)
    w = AtomicFile(path, "wb"); ...; w.commit() or w.abort()   # for writers that outlive a block
    with atomic_path(path) as tmp:        # for libraries that write to a path themselves
        tokenizer.save(tmp)

Its reading counterpart, `read_text_file`, reads a text file kiln was handed (an eval set, a forget
list, a shard directory's meta.json) and turns a missing file or bad bytes into one line.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator

TMP_SUFFIX = ".tmp"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform or filesystem that cannot open directories: the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """An open file at `<path>.tmp` that `commit()` moves onto `path` and `abort()` discards.

    For writers whose life spans several calls (e.g. a document writer fed one record at a time);
    code that writes in one block uses `atomic_file`.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "wb", *, encoding: str = "utf-8", fsync: bool = True):
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile mode must be 'w' or 'wb', not {mode!r}")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self._fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.unlink(missing_ok=True)  # a leftover from a killed run, or anything planted there
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(self.tmp, flags, 0o666)
        try:
            self.file: IO[Any] = open(fd, mode, encoding=encoding if mode == "w" else None)
        except BaseException:
            os.close(fd)
            self.tmp.unlink(missing_ok=True)
            raise
        self.done = False

    def commit(self) -> Path:
        """Flush, fsync, close and rename onto the target; returns the target path."""
        try:
            self.file.flush()
            if self._fsync:
                os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self.done = True
        if self._fsync:
            _fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file; the target is left as it was."""
        if self.done:
            return
        self.done = True
        try:
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, encoding: str = "utf-8",
                fsync: bool = True) -> Iterator[IO[Any]]:
    """Yield a file to write; on normal exit it replaces `path`, on an exception it is deleted."""
    f = AtomicFile(path, mode, encoding=encoding, fsync=fsync)
    try:
        yield f.file
    except BaseException:
        f.abort()
        raise
    f.commit()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    with atomic_file(path, "wb", fsync=fsync) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> Path:
    with atomic_file(path, "w", fsync=fsync) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = True, **dumps_kwargs: Any) -> Path:
    """json.dumps(obj, **dumps_kwargs) written atomically; the object is serialized before the file
    is opened, so an unserializable value leaves the old file untouched and no temporary file."""
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs), fsync=fsync)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path for a library that writes files by name (`tokenizer.save(p)`); on
    normal exit the file there replaces `path`, on an exception it is deleted."""
    target = Path(path)
    tmp = target.with_name(target.name + TMP_SUFFIX)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        if not tmp.is_file() or tmp.is_symlink():
            raise OSError(f"{tmp}: the writer left no regular file to move onto {target}")
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(target.parent)


def read_text_file(path: str | os.PathLike, *, error: type[Exception], missing: str,
                   encoding: str = "utf-8") -> str:
    """The text of `path`, or `error` with one line: `missing` when it is not a regular file, or
    "<path>: not UTF-8 text (...)" when its bytes do not decode."""
    path = Path(path)
    if not path.is_file():
        raise error(missing)
    try:
        return path.read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e})") from None

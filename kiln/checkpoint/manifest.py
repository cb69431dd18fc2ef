"""Per-checkpoint manifest: the list of files with sizes and SHA-256 digests, written last.

A checkpoint directory counts as complete only when `manifest.json` is in it and every file it
lists has the recorded size and digest. The manifest is written after DCP has finished (and
fsynced) every data file and `.metadata`, then fsynced itself, then the directory is renamed into
place and its parent fsynced, so a crash at any point leaves either the previous state or a whole
checkpoint. Hashing uses hashlib (stdlib); no new dependency for the training core.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "kiln-checkpoint"
VERSION = 1
_CHUNK = 8 << 20


class CheckpointInvalid(Exception):
    """A checkpoint directory is missing, partial or corrupt; the message says what and where."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories: so a rename or a new entry is durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt_dir: Path, step: int) -> int:
    """Hash every file in `ckpt_dir` (DCP writes a flat directory) and write the manifest last.
    Returns the total size of the listed files in bytes."""
    files = {}
    for path in sorted(ckpt_dir.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    if ".metadata" not in files:
        raise CheckpointInvalid(f"{ckpt_dir}: DCP wrote no .metadata")
    body = json.dumps({"format": FORMAT, "version": VERSION, "step": step, "files": files}, indent=1)
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    fsync_path(ckpt_dir)
    return sum(entry["size"] for entry in files.values())


def read_manifest(ckpt_dir: Path) -> dict[str, dict]:
    """The manifest's file table, validated for shape (the file may be hostile). Cheap: no hashing."""
    path = ckpt_dir / MANIFEST
    if not ckpt_dir.is_dir():
        raise CheckpointInvalid(f"{ckpt_dir}: not a directory")
    if not path.is_file():
        raise CheckpointInvalid(f"{ckpt_dir}: incomplete (no {MANIFEST}; the save never finished)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointInvalid(f"{path}: not a {FORMAT} v{VERSION} manifest")
    files = doc.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointInvalid(f"{path}: 'files' must map file names to size/sha256 and list .metadata")
    for name, entry in files.items():
        # Names are plain file names inside the checkpoint: no separators, no '..', no hidden escape.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointInvalid(f"{path}: bad file name {name!r} (expected a plain name)")
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0
                or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64):
            raise CheckpointInvalid(f"{path}: entry for {name!r} must be {{'size': int >= 0, 'sha256': hex}}")
    return files


def verify(ckpt_dir: Path) -> int:
    """Check every listed file's size, then digest. Returns the checkpoint's size in bytes."""
    files = read_manifest(ckpt_dir)
    for name, entry in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointInvalid(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointInvalid(f"{path}: {size} bytes, manifest says {entry['size']} (truncated or replaced)")
    for name, entry in files.items():  # sizes first: the cheap check catches most damage
        if sha256_file(ckpt_dir / name) != entry["sha256"]:
            raise CheckpointInvalid(f"{ckpt_dir / name}: checksum mismatch (corrupted on disk)")
    return sum(entry["size"] for entry in files.values())


def manifest_size(ckpt_dir: Path) -> int:
    """Bytes a complete checkpoint occupies per its manifest (0 if it has none)."""
    try:
        return sum(entry["size"] for entry in read_manifest(ckpt_dir).values())
    except CheckpointInvalid:
        return 0

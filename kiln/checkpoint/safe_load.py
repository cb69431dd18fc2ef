"""Reading a DCP checkpoint without unpickling anything the checkpoint's author chose.

A run directory may come from someone else (DESIGN seam 10). Stock DCP reads `.metadata` with
`pickle.load` and the non-tensor items of the state (ints, floats, lists in the optimizer's
param groups, the loader position) with `torch.load(weights_only=False)`: opening a crafted
checkpoint would run its code. Here:

- `.metadata` goes through `MetadataUnpickler`, a `pickle.Unpickler` whose `find_class` admits
  only the classes DCP itself writes there (found by recording the globals of real kiln saves)
  and refuses anything else before it is called;
- byte items go through `torch.load(weights_only=True)` (torch's own restricted unpickler);
  tensor items already do in `FileSystemReader.read_data`.

`SafeFileSystemReader` and `SafeLoadPlanner` are thin subclasses of DCP's reader and planner;
the loading logic itself stays DCP's.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint._traverse import set_element

from kiln import torch_compat
from kiln.errors import KilnError


class UnsafeCheckpointError(KilnError):
    """A checkpoint file references code that a checkpoint never needs; nothing was run."""


# Exactly what DCP's `.metadata` pickle references for kiln's state (plain and FSDP-sharded
# tensors, byte items): the metadata dataclasses, torch.Size, dtypes, layouts by name, and the
# path type of `storage_meta.checkpoint_id`. Constructing any of these runs no user code.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                 "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
}
_METADATA_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_METADATA_CLASSES[("torch", "Size")] = torch.Size
_METADATA_CLASSES[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_PATH_CLASSES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


class MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_CLASSES.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "pathlib" and name in _PATH_CLASSES:
            import pathlib

            # A Windows path on POSIX cannot be constructed; a pure path needs no OS.
            return pathlib.PurePosixPath if "Posix" in name else pathlib.PureWindowsPath
        raise UnsafeCheckpointError(
            f"{self.source}: refused to load: it references {module}.{name}, which DCP checkpoint "
            f"metadata never contains (a tampered or foreign file?); nothing in it was run")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refused to load: unexpected persistent id in metadata")


def load_metadata(data: bytes, source: str) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata with the allowlist; anything malformed is one KilnError line."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or garbled pickle: a corrupt file, never a traceback
        raise KilnError(f"{source}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{source}: refused to load: holds {type(metadata).__name__}, "
                                    f"not DCP metadata")
    # DCP opens `relative_path` under the checkpoint directory: only plain file names, so a
    # crafted entry cannot make it read (and load as weights) a file outside it.
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnsafeCheckpointError(f"{source}: refused to load: data file {name!r} is not a plain "
                                        f"file name inside the checkpoint")
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp_metadata.TensorStorageMetadata) and (problem := _tiling_problem(item)):
            raise UnsafeCheckpointError(f"{source}: refused to load: tensor {fqn!r} {problem}")
    return metadata


def _tiling_problem(item: dcp_metadata.TensorStorageMetadata) -> str:
    """Why `item`'s saved chunks do not tile its tensor exactly (empty when they do). DCP reads a
    tensor (or a rank's shard or boxes of it) from the chunks overlapping it, so a gap would leave
    part of it as it was and an overlap would read two sources. The same test as DCP's own check
    of a save plan (a chunk within bounds, no two overlapping, volumes summing to the tensor's)."""
    size = tuple(item.size)
    total = 0
    boxes = []
    for chunk in item.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            return f"has a chunk at {list(offsets)} of {list(sizes)} outside its shape {list(size)}"
        volume = math.prod(sizes)
        if volume:
            total += volume
            boxes.append((offsets, sizes))
    boxes.sort()
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1:]:
            if size and b_off[0] >= a_off[0] + a_size[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(bo < ao + an and ao < bo + bn for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size)):
                return f"has overlapping chunks at {list(a_off)} and {list(b_off)}"
    if total != math.prod(size):
        return f"has chunks of {total} elements for its {math.prod(size)} (a gap)"
    return ""


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read through the allowlist unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = torch_compat.dcp_metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte items load with `torch.load(weights_only=True)`
    (stock DCP: weights_only=False); the placement below mirrors DefaultLoadPlanner.load_bytes."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"refused to load checkpoint item {read_item.dest_index.fqn!r}: "
                                        f"{str(e).splitlines()[0]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

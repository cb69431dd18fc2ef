"""A ZeRO-1 rank's optimizer state as DCP saves it: of each parameter-shaped state tensor, only the
elements this rank steps, as the boxes of the parameter's global shape they cover. Every rank
writes its own share, nothing is gathered to save, and DCP reshards the boxes into any layout on
load (FSDP's DTensor shards, a plain optimizer's whole tensors, another ZeRO-1 partition) by their
overlaps.

torch's: ShardedTensor, the DCP form for shards of any rectangular extent (torch marks it
deprecated in favour of DTensor, whose shards follow a fixed chunking rule and cannot hold kiln's
runs: a run of the concatenated parameters starts and ends mid-row and ranks get unequal parts);
DCP's saving, loading and resharding. kiln's: `boxes` (a run of flat elements as the few boxes it
covers) and the bookkeeping between a rank's runs and its boxes.

Not supported: torch's `get_state_dict(..., options=StateDictOptions(full_state_dict=True))`, whose
gather takes one dim-0 chunk per rank (it fails in the all-gather, "invalid tensor size"); a whole
optimizer state comes from a checkpoint loaded into one process, or torch's
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` (DCP assembles the boxes; tested).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the import itself warns of the deprecation on some releases
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
        from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    MISSING = ""
except ImportError as e:  # torch deprecates ShardedTensor: a release without it leaves every other save working
    ShardedTensor = None
    MISSING = f"torch {torch.__version__} has no ShardedTensor ({e})"

# DCP's planners warn "Please use DTensor instead and we are deprecating ShardedTensor" at every
# save and load of one; kiln uses it where DTensor cannot say what it saves (above).
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The flat elements [start, end) of a row-major tensor of `shape` as boxes in that order: a
    partial row, the whole rows, a partial row (recursively, so at most 2 x dims - 1 boxes)."""
    if end <= start:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner, rest = math.prod(shape[1:]), tuple(shape[1:])
    out, row = [], start // inner
    if start % inner:  # the end of the first, partial row
        stop = min(end, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(rest, start - row * inner, stop - row * inner)]
        start, row = stop, row + 1
    whole = end // inner
    if start < end and whole > row:
        out.append(((row, *[0] * len(rest)), (whole - row, *rest)))
        start, row = whole * inner, whole
    if start < end:  # the start of the last, partial row
        out += [((row, *o), (1, *s)) for o, s in boxes(rest, 0, end - start)]
    return out


class RunBoxes:
    """One parameter's boxes in its global coordinates: of each run ((start, end, owner's global
    rank) over the local flat elements; the local tensor sits at `offset` in the global one, e.g.
    a tensor-parallel shard), and of the other tp coordinates' shards (`regions`, (offsets, sizes,
    a global rank holding it)), so that the boxes listed cover the tensor as ShardedTensor checks.
    Each rank saves and loads only its own (DCP plans from local shards)."""

    def __init__(self, local_shape: tuple[int, ...], global_shape: tuple[int, ...], offset: tuple[int, ...],
                 runs: list[tuple[int, int, int]], regions: list[tuple[tuple[int, ...], tuple[int, ...], int]] = ()):
        self.global_shape, me = tuple(global_shape), dist.get_rank()
        self.runs, self.per_run, self.listed = [], [], []  # this rank's runs, their boxes; every box (offsets, sizes, rank)
        for a, b, owner in runs:
            run_boxes = [(tuple(o + g for o, g in zip(offsets, offset)), sizes)
                         for offsets, sizes in boxes(tuple(local_shape), a, b)]
            self.listed += [(o, s, owner) for o, s in run_boxes]
            if owner == me:
                self.runs.append((a, b))
                self.per_run.append(run_boxes)
        self.listed += list(regions)

    def sharded(self, run_tensors: list[torch.Tensor]) -> ShardedTensor:
        """This rank's runs' state tensors (one per run, flat elements in order) as a ShardedTensor
        of the global shape whose local shards are views of them (DCP saves and loads in place)."""
        shards, device = [], run_tensors[0].device
        for t, (a, b), run_boxes in zip(run_tensors, self.runs, self.per_run):
            flat, at = t.reshape(-1), 0
            if flat.numel() != b - a:
                raise ValueError(f"a state tensor of {flat.numel()} elements for a run of {b - a}")
            for offsets, sizes in run_boxes:
                n = math.prod(sizes)
                shards.append(Shard(flat[at:at + n].view(sizes), _meta(offsets, sizes, dist.get_rank(), device)))
                at += n
        metas = [_meta(o, s, r, device) for o, s, r in self.listed]
        md = ShardedTensorMetadata(metas, torch.Size(self.global_shape), TensorProperties.create_from_tensor(run_tensors[0]))
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, sharding_spec=EnumerableShardingSpec(metas))

    def runs_of(self, value: ShardedTensor, name: object = "") -> list[torch.Tensor]:
        """A loaded ShardedTensor (DCP filled the template `sharded` made) back as one flat tensor per
        run; one line if its boxes are not this rank's."""
        got = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards()]
        expected = [box for run_boxes in self.per_run for box in run_boxes]
        if got != expected or tuple(value.size()) != self.global_shape:
            raise ValueError(f"optimizer state {name!r}: ZeRO-1 shards {got} of shape {tuple(value.size())}, "
                             f"this rank steps {expected} of shape {self.global_shape}")
        tensors, out = iter(s.tensor for s in value.local_shards()), []
        for run_boxes in self.per_run:
            out.append(torch.cat([next(tensors).reshape(-1) for _ in run_boxes]))
        return out


def largest_local_numel(p: torch.Tensor) -> int:
    """The elements of the largest tp coordinate's shard of `p` (DTensor shards follow torch.chunk:
    ceil(size / tp) along a sharded dim), the same number on every coordinate: partitions sized by
    it cut a tensor replicated over tp alike on every coordinate, so DCP writes its boxes once
    (it refuses overlapping ones)."""
    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    for size, placement in zip(p.device_mesh.shape, p.placements):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // size)
    return math.prod(shape)


def tp_regions(p: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, sizes, a global rank holding it) of the other tp coordinates' shards of `p`
    (none when replicated), by torch.chunk's rule as DTensor shards."""
    if not isinstance(p, DTensor) or not any(pl.is_shard() for pl in p.placements):
        return []
    ranks, me = p.device_mesh.mesh.flatten().tolist(), p.device_mesh.get_local_rank()
    out = []
    for c, global_rank in enumerate(ranks):
        offsets, sizes = [0] * p.dim(), list(p.shape)
        for placement in p.placements:
            if placement.is_shard():
                d, chunk = placement.dim, -(-p.shape[placement.dim] // len(ranks))
                offsets[d] = min(c * chunk, p.shape[d])
                sizes[d] = min(p.shape[d], offsets[d] + chunk) - offsets[d]
        if c != me and math.prod(sizes) > 0:
            out.append((tuple(offsets), tuple(sizes), global_rank))
    return out


def param_boxes(param: torch.Tensor, runs: list[tuple[int, int, int]], group) -> RunBoxes:
    """RunBoxes of `param` (a tensor-parallel DTensor's shard placed where it sits) for `runs`
    ((start, end, rank in `group`) over its local flat elements)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    offset = tuple(param.__create_chunk_list__()[0].offsets) if isinstance(param, DTensor) else (0,) * local.dim()
    return RunBoxes(local.shape, param.shape, offset, [(a, b, dist.get_global_rank(group, r)) for a, b, r in runs],
                    tp_regions(param))


def _meta(offsets, sizes, rank: int, device: torch.device) -> ShardMetadata:
    return ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}")


def require(what: str) -> None:
    """One line, before any work, where this torch cannot save boxes (`what` names the setting)."""
    if MISSING:
        raise ConfigError(f"{what} saves each rank's share of its state as boxes (torch's ShardedTensor), but "
                          f"{MISSING}; use parallel.dp_mode='fsdp' or 'zero2', or a torch that has it (2.6-2.13 do)")


def is_sharded(value) -> bool:
    return ShardedTensor is not None and isinstance(value, ShardedTensor)


def local_tensors(value: ShardedTensor) -> list[torch.Tensor]:
    return [s.tensor for s in value.local_shards()]


def unwrap(obj):
    """`obj` (a state dict) with each ShardedTensor as the list of its local tensors: the plain
    structure that torch's staging copies (torch 2.6 stages a ShardedTensor's shards by reference,
    not by copy) and `torch.save(weights_only)` takes."""
    if is_sharded(obj):
        return local_tensors(obj)
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unwrap(v) for v in obj)
    return obj


def rewrap(plain, like):
    """The inverse of `unwrap`: where `like` holds a ShardedTensor, one with its boxes over the
    tensors in `plain` (copies staged on another device keep the boxes, with their device)."""
    if is_sharded(like):
        device = plain[0].device if plain else torch.device("cpu")
        local = [Shard(t, _meta(s.metadata.shard_offsets, s.metadata.shard_sizes, s.metadata.placement.rank(), device))
                 for t, s in zip(plain, like.local_shards())]
        metas = [_meta(m.shard_offsets, m.shard_sizes, m.placement.rank(), device) for m in like.metadata().shards_metadata]
        props = TensorProperties.create_from_tensor(plain[0]) if plain else like.metadata().tensor_properties
        md = ShardedTensorMetadata(metas, like.size(), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, sharding_spec=EnumerableShardingSpec(metas))
    if isinstance(like, dict):
        return {k: rewrap(plain[k], v) for k, v in like.items()}
    if isinstance(like, (list, tuple)):
        return type(like)(rewrap(p, v) for p, v in zip(plain, like))
    return plain


def fill(live: ShardedTensor, saved: list[torch.Tensor]) -> None:
    """Copy `saved` (an `unwrap`ped copy) into `live`'s local shards; one line if they differ."""
    shards = local_tensors(live)
    if [tuple(t.shape) for t in shards] != [tuple(t.shape) for t in saved]:
        raise ValueError(f"ZeRO-1 shards of shapes {[tuple(t.shape) for t in saved]}, "
                         f"{[tuple(t.shape) for t in shards]} expected")
    for t, s in zip(shards, saved):
        t.copy_(s)

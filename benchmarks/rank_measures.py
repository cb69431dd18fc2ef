"""What benchmarks/parallel_memory.py measures inside each rank: exact tensor bytes (local shards
of DTensors), the bytes autograd saves for backward, bytes written to sockets, and the timed gloo
collectives that kiln/plan/calibrate.py fits the link to; and the peak tensor bytes of a profiled
region (benchmarks/tp_chunked_loss.py, activation_checkpointing.py)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from kiln.torch_compat import all_gather_single, reduce_scatter_single


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(obj) -> int:
    """Tensor bytes held in a (nested) state dict: a DTensor's local shard, a ZeRO-1 ShardedTensor's
    local boxes (kiln/parallel/zero1_shards.py)."""
    from kiln.parallel.zero1_shards import is_sharded, local_tensors

    if is_sharded(obj):
        return local_bytes(local_tensors(obj))
    if isinstance(obj, torch.Tensor):
        return local_bytes([obj])
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def profiled_peak_bytes(prof) -> int:
    """Most tensor bytes live at once above the start of a `torch.profiler.profile(profile_memory=
    True)` region, from its allocator events (all on the CPU: no accelerator is used)."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def optimizer_state(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's optimizer
    return [v for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


class SavedBytes:
    """Bytes of the tensors autograd saves for backward during a forward (torch's
    saved_tensors_hooks; each storage counted once, parameters - leaves that require grad and their
    views, gathered FSDP ones included - excluded): the activations. A DTensor counts its local
    tensor (tensor parallelism), unless it is a parameter or its local storage is in `exclude`
    (the parameters' local storages: a transposed weight DTensor is no leaf, yet no activation)."""

    def __init__(self, exclude: set[int] | None = None):
        self.seen: set[int] = set(exclude or ())
        self.total = 0

    def pack(self, t):
        self.count(t)
        return t

    def count(self, t) -> None:
        if hasattr(t, "to_local"):  # DTensor
            if not (t.is_leaf and t.requires_grad):
                self.count(t._local_tensor)
            return
        if hasattr(t, "__tensor_flatten__"):
            # A wrapper tensor without storage of its own (the functional collectives'
            # AsyncCollectiveTensor, e.g. expert parallelism's all-to-all output): its inner tensors.
            for name in t.__tensor_flatten__()[0]:
                self.count(getattr(t, name))
            return
        if not t.is_nested and t.device.type == "cpu":
            ptr = t.untyped_storage().data_ptr()
            base = t._base if t._base is not None else t  # weight.t() views save the parameter itself
            if not (base.is_leaf and base.requires_grad) and ptr not in self.seen:
                self.seen.add(ptr)
                self.total += t.untyped_storage().nbytes()


def sent_bytes() -> int:
    """Bytes this process has written (sockets and files: /proc/self/io wchar)."""
    return _io("wchar")


def read_bytes() -> int:
    """Bytes this process has read (sockets and files: /proc/self/io rchar)."""
    return _io("rchar")


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith(field))


COLLECTIVE_SIZES = (2**14, 2**18, 2**22, 2**24)  # bytes of the full (unsharded) tensor


def collective_times(rank: int, world: int, port: int, reps: int) -> list[dict]:
    """Median seconds of each gloo collective at each size (the slowest rank's)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gather, scatter = all_gather_single, reduce_scatter_single
    rows = []
    for nbytes in COLLECTIVE_SIZES:
        full = torch.ones(nbytes // 4)
        shard = torch.ones(nbytes // 4 // world)
        copy_to = torch.empty_like(full)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: gather(full, shard),
               "reduce_scatter": lambda: scatter(shard, full),
               "broadcast": lambda: dist.broadcast(full, src=0),
               "copy": lambda: copy_to.copy_(full)}  # every rank at once, as FSDP2's copy-in/out
        for op, call in ops.items():
            call()  # warm-up: connections and buffers
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            rows.append({"op": op, "ranks": world, "bytes": nbytes, "seconds": statistics.median(times)})
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    return [max((g[i] for g in gathered), key=lambda r: r["seconds"]) for i in range(len(rows))]

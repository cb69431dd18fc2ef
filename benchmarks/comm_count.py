"""Collectives this process hands to gloo, counted from torch's profiler.

Every collective and point-to-point call of ProcessGroupGloo is recorded by torch as a profiler
event named `gloo:<op>` (all_reduce, all_gather, broadcast, all_to_all, send, recv, ...) with its
tensors' shapes and dtypes, whichever API issued it: `torch.distributed` from Python, DDP's C++
reducer, FSDP2, DTensor and the functional collectives (tensor and expert parallelism), and
torch.distributed.pipelining's stage sends. Wrapping the Python `torch.distributed` functions would
miss the C++ and functional callers, so the profiler (torch's) is the source; the sums are ours.

Per op: the number of calls and the payload, the bytes of the tensors this rank hands in (an
all-reduce's tensor, an all-gather's input shard, an all-to-all's whole input, a send's tensor;
received tensors are counted apart). That is what the strategy asks gloo to move, not what gloo
writes to its sockets: a ring all-reduce sends about 2 (N-1)/N of its payload, an all-to-all keeps
this rank's own slot. gloo runs a reduce-scatter as an all-reduce of the full tensor, which shows
here as all_reduce (what it does, not what was asked).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from torch.profiler import ProfilerActivity, profile

PREFIX = "gloo:"
RECEIVE = ("recv", "recv_anysource")
# The profiler names dtypes as C++ does (torch/csrc/profiler: c10 scalar type names).
ITEM_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
              "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
              "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def event_bytes(shapes: list, dtypes: list) -> int:
    """Bytes of the tensors of one profiler event (inputs that are not tensors have no shape)."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if not shape and not dtype:
            continue
        if dtype not in ITEM_BYTES:
            raise ValueError(f"collective tensor of dtype {dtype!r}: add its size to comm_count.ITEM_BYTES")
        n = 1
        for d in shape:
            n *= d
        total += n * ITEM_BYTES[dtype]
    return total


def summarize(events) -> dict:
    """{"by_op": {op: {"calls", "bytes"}}, "calls", "sent_bytes", "received_bytes"} of gloo events
    (objects with .name, .input_shapes, .input_dtypes, as torch's FunctionEvent)."""
    by_op: dict[str, dict[str, int]] = {}
    for e in events:
        if not e.name.startswith(PREFIX):
            continue
        op = e.name[len(PREFIX):]
        row = by_op.setdefault(op, {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += event_bytes(e.input_shapes or [], e.input_dtypes or [])
    return {"by_op": by_op, "calls": sum(r["calls"] for r in by_op.values()),
            "sent_bytes": sum(r["bytes"] for op, r in by_op.items() if op not in RECEIVE),
            "received_bytes": sum(r["bytes"] for op, r in by_op.items() if op in RECEIVE)}


def scaled(summary: dict, per: int) -> dict:
    """`summary` of a window of `per` steps, as per-step figures (DiLoCo's H inner steps + sync)."""
    if per == 1:
        return summary
    return {"by_op": {op: {k: v / per for k, v in r.items()} for op, r in summary["by_op"].items()},
            **{k: summary[k] / per for k in ("calls", "sent_bytes", "received_bytes")}}


@contextmanager
def counting_collectives():
    """Profile the block; afterwards the yielded dict holds `summarize` of its gloo calls. Every
    collective in the block must have completed (waited on) before it exits."""
    counts: dict = {}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield counts
    events = prof.events()
    if events and not hasattr(events[0], "input_dtypes"):  # older torch (2.11): only the raw events carry dtypes
        events = [SimpleNamespace(name=e.name(), input_shapes=e.shapes(), input_dtypes=e.dtypes())
                  for e in prof.profiler.kineto_results.events()]
    counts.update(summarize(events))


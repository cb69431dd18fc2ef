"""Step traces: `metrics.profile_every = N` records every N-th training step with torch.profiler
(torchtitan's `profiling.profile_freq`), the step before it as warm-up, on every rank.

Each recorded step S writes, per rank R, into the run directory:
- `profile/step-S/rank-R.trace.json.gz`: the Chrome/Perfetto trace (open it in ui.perfetto.dev or
  chrome://tracing); with `metrics.profile_memory = true` it carries the allocator's events too;
- `profile/step-S/rank-R.top.txt`: torch's table of the ops that took the most self time
  (device time on a GPU, CPU time otherwise);
- on a GPU with `metrics.profile_memory = true`, `profile/step-S/rank-R.memory.pickle`: the CUDA
  caching allocator's snapshot with the history of its last 100 000 allocations and their stacks
  (torch.cuda.memory's `_record_memory_history` / `_dump_snapshot`; open it in
  pytorch.org/memory_viz), torchtitan's `enable_memory_snapshot`;
and rank 0 logs a `profile` row to metrics.jsonl: the step's wall time as the profiler saw it
(`step_ms`), the time collectives were in flight, overlapped with compute or not (`collective_ms`:
NCCL's kernels on a GPU; on the CPU gloo's ranges from enqueue to done, which include waiting for
the other ranks), and the five ops with the most self time (`top`).

The step numbers follow the training step, across resumes and loss-spike restores. Exporting the
trace takes time inside the loop: the metrics window holding a recorded step is slower by it. With
the default 0 nothing is created and the loop is as before.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from kiln.io import atomic_file, atomic_path

TOP_OPS = 25  # rows of the per-rank table
SNAPSHOT_ENTRIES = 100_000  # allocations a CUDA memory snapshot keeps the history of (torchtitan's default)


class StepProfiler:
    def __init__(self, every: int, memory: bool, run_dir: Path, start_step: int, rank: int,
                 device: torch.device, log: Callable[[dict], None]):
        self.every, self.run_dir, self.rank, self.log = every, Path(run_dir), rank, log
        self.device_time = device.type == "cuda"
        self._next = start_step + 1  # the step the profiler's schedule is asked about
        self._discard = False
        self._prof = None
        if not every:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_time else [])
        self.snapshots = memory and self.device_time
        if self.snapshots:  # from now on, so the first recorded step's snapshot holds its allocations
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self._prof = profile(activities=activities, schedule=self._action, on_trace_ready=self._save,
                             profile_memory=memory)
        self._prof.start()

    def _action(self, _profiler_step: int):
        from torch.profiler import ProfilerAction

        if self._next % self.every == 0:
            return ProfilerAction.RECORD_AND_SAVE
        if self.every > 1 and (self._next + 1) % self.every == 0:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def step_done(self, step: int) -> None:
        """After training step `step` (also after a restore set the step back)."""
        if self._prof is not None:
            self._recorded, self._next = step, step + 1
            self._prof.step()

    def close(self, step: int) -> None:
        """After the loop; `step` is the last step run. Its trace is saved if it was a recorded
        step the loop left without `step_done` (a pause, an early stop, an error); the window the
        profiler opened for the step after it, which never ran, is dropped."""
        if self._prof is not None:
            self._discard = self._next != step
            self._recorded = step
            self._prof.stop()
            self._prof = None
            if self.snapshots:
                torch.cuda.memory._record_memory_history(enabled=None)

    def _save(self, prof) -> None:
        if self._discard:
            return
        try:
            self._write(prof, self._recorded)
        except OSError as e:  # a full disk costs the trace, never the run
            self.log({"kind": "event", "step": self._recorded,
                      "message": f"profile of step {self._recorded} not written: {e}"})

    def _write(self, prof, step: int) -> None:
        folder = self.run_dir / "profile" / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(plain))
            with atomic_file(folder / f"rank-{self.rank}.trace.json.gz", "wb", fsync=False) as out, \
                    gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as packed, open(plain, "rb") as f:
                shutil.copyfileobj(f, packed)
        ops = prof.key_averages()
        by = "self_device_time_total" if self.device_time else "self_cpu_time_total"
        with atomic_file(folder / f"rank-{self.rank}.top.txt", fsync=False) as f:
            f.write(ops.table(sort_by=by, row_limit=TOP_OPS) + "\n")
        if self.snapshots:
            with atomic_path(folder / f"rank-{self.rank}.memory.pickle", fsync=False) as snapshot:
                torch.cuda.memory._dump_snapshot(str(snapshot))
        self_ms = {op.key: getattr(op, by) / 1e3 for op in ops if not op.key.startswith("ProfilerStep")}
        step_ms = sum(op.cpu_time_total for op in ops if op.key.startswith("ProfilerStep")) / 1e3
        top = sorted(self_ms.items(), key=lambda kv: -kv[1])[:5]
        if self.device_time:  # NCCL's kernels (ncclDevKernel_AllReduce_...) on the device
            in_flight = sum(ms for name, ms in self_ms.items() if name.startswith("nccl"))
        else:  # gloo's ranges (gloo:all_reduce), enqueued to done, on its own threads
            in_flight = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("gloo:")) / 1e3
        self.log({"kind": "profile", "step": step, "trace": str(folder.relative_to(self.run_dir)),
                  "step_ms": round(step_ms, 3), "time": "device" if self.device_time else "cpu",
                  "collective_ms": round(in_flight, 3), "top": [[name, round(ms, 3)] for name, ms in top]})

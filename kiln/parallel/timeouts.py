"""How long a rank waits in one collective before it fails instead of hanging.

A rank that stops (a stuck loader, a dead host, a deadlock) leaves every other rank waiting in its
next collective, and the job holds its whole allocation until something gives. torch bounds each
wait per process group, set when the group is created: 30 minutes on gloo, 10 on NCCL, and the
groups DeviceMesh and `new_group` create get torch's default, not the world group's.

kiln sets two bounds on every group, torchtitan's pair (`comm.init_timeout_seconds` /
`train_timeout_seconds`):
- `parallel.init_timeout_s` (default 1800) until the first training step is done on every rank.
  It covers rank 0 tokenizing the corpus while the others wait for the shards, the checkpoint
  load and the first step's compile.
- `parallel.train_timeout_s` (default 300) from then on, for every group the loop uses; a group
  created later (e.g. a mesh dimension flattened on first use) gets it when the step that made it
  ends.
- Checkpoint saves and loads wait on the checkpoint manager's own gloo group
  (kiln/checkpoint/manager.py), which keeps the init bound: rank 0 writes the manifest (it hashes
  every file) while the other ranks wait for it.

On gloo the waiting ranks' collective raises; `train` turns that into one line naming the bound, the
last finished step and the ranks that did not time out with the others (`CollectiveTimeout`,
`ranks_not_waiting`). On NCCL torch's watchdog aborts the process
("Watchdog caught collective operation timeout") and torchrun's summary names the rank; NCCL's
flight recorder (`record_nccl_collectives`) has each rank dump its last collectives first, which
say which rank never joined which collective. Either way torchrun can restart the job, which
resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from kiln import torch_compat
from kiln.errors import KilnError

# what a timed-out collective says: gloo ("Timed out waiting 5000ms for recv operation to
# complete"), NCCL ("Watchdog caught collective operation timeout: WorkNCCL(...) ran for 300000
# milliseconds before timing out", also raised in the rank under TORCH_NCCL_BLOCKING_WAIT)
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|collective operation timeout|milliseconds before timing out")


class CollectiveTimeout(KilnError):
    """A collective waited longer than its bound: another rank is stuck or gone."""


class CollectiveTimeouts:
    def __init__(self, init_s: float, train_s: float):
        self.init_s, self.train_s = init_s, train_s
        self.training = False  # the train bound applies (the first step is done on every rank)
        self.last_step: int | None = None
        self._kept: set[int] = set()  # ids of groups that keep the init bound
        self._set: set[int] = set()  # ids of groups already at the train bound
        self.fixed = False  # some group's bound cannot change here (gloo before torch 2.9)
        self._told = False

    def start(self, keep_init=()) -> None:
        """Every group this rank is in waits `init_s`; the groups in `keep_init` keep it after the
        first step too."""
        if not _distributed():
            return
        self._kept.update(id(g) for g in keep_init if g is not None)
        for group in torch_compat.process_groups():
            self.fixed |= not torch_compat.set_group_timeout(group, self.init_s)

    def step_done(self, step: int) -> str | None:
        """After each training step. The first time, once every rank has finished it, the loop's
        groups drop to `train_s`; later, only groups created since (a dictionary walk per step).
        Returns a line to log the first time a group's bound cannot change here."""
        self.last_step = step
        if not _distributed():
            return None
        fresh = [g for g in torch_compat.process_groups() if id(g) not in self._kept and id(g) not in self._set]
        if not fresh:
            return None
        if not self.training:
            # A rank that set the short bound while another is still in its first step (compile,
            # a slow first batch) would time out waiting for it.
            dist.barrier()
            self.training = True
        for group in fresh:
            self.fixed |= not torch_compat.set_group_timeout(group, self.train_s)
            self._set.add(id(group))
        if self.fixed and not self._told:
            self._told = True
            return (f"parallel.train_timeout_s={self.train_s:g} is not applied: gloo under torch "
                    f"{torch.__version__} keeps each group's bound from its creation (torch's 30 minutes; "
                    f"parallel.init_timeout_s for the world group); torch >= 2.9 applies it")
        return None

    def explain(self, error: BaseException) -> CollectiveTimeout | None:
        """The one-line error for a collective's timeout, or None when `error` is something else.
        It names the ranks that did not time out too (`ranks_not_waiting`)."""
        if not _TIMED_OUT.search(str(error)):
            return None
        key, seconds = ("train_timeout_s", self.train_s) if self.training else ("init_timeout_s", self.init_s)
        where = f"after step {self.last_step}" if self.last_step is not None else "before the first step"
        if self.fixed:  # gloo before 2.9: the bound the group was created with
            bound = (f"its group's bound (torch {torch.__version__}'s gloo keeps the one it was created with: "
                     f"parallel.init_timeout_s for the world group, torch's default for the others)")
        else:
            bound = f"parallel.{key}={seconds:g} s"
        missing = ranks_not_waiting(min(seconds, GRACE_S))
        if missing is None:  # the store did not answer (its host rank may be the one gone)
            who = "another rank is stuck or gone (the launcher's summary and that rank's log name it)"
        elif missing:
            who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not time out with "
                   f"the others: stuck before the collective, or gone (its log has the cause)")
        else:
            who = ("every rank timed out waiting: they wait in different collectives (a rank took another "
                   "code path), or the bound is shorter than a collective legitimately takes")
        advice = "" if self.fixed else (f"; raise parallel.{key} if the ranks can legitimately drift that far "
                                        f"apart")
        return CollectiveTimeout(f"a collective {where} waited longer than {bound}: {who}{advice}")


GRACE_S = 30.0  # at most this long, a timed-out rank waits for the others' timeouts to name the missing ranks


def ranks_not_waiting(grace_s: float) -> list[int] | None:
    """After this rank's collective timed out: every rank that times out says so in the process
    group's store (torch's rendezvous store; one key each, nothing while training runs), and the
    ranks that have not within `grace_s` (the others enter their wait up to that much later) are
    returned: the stuck or gone ones. None where the store does not answer."""
    import datetime
    import time

    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=max(1.0, grace_s)))
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"kiln/timed_out/{rank}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world) if not store.check([f"kiln/timed_out/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.2)
    except (RuntimeError, ValueError, OSError):
        return None


def record_nccl_collectives(folder: Path, entries: int) -> None:
    """NCCL's flight recorder (torchtitan's `comm.trace_buf_size`): each rank keeps its last
    `entries` collectives and dumps them to `folder/rank_R` when one times out; torch's
    `torchfrtrace FOLDER` lines them up across ranks. Set before the first NCCL group is made;
    what the user exported wins (torch reads the TORCH_FR_* names from 2.13, TORCH_NCCL_* before)."""
    if not entries:
        return
    folder.mkdir(parents=True, exist_ok=True)
    settings = {("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(entries),
                ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): f"{folder}/rank_",
                ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1"}
    for names, value in settings.items():
        if not any(name in os.environ for name in names):
            os.environ.update(dict.fromkeys(names, value))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()

"""Checkpoints with torch.distributed.checkpoint (DCP): the only writer of training state.

Everything that must survive a crash is Stateful (state_dict / load_state_dict) and saved as one
dict. DCP writes each rank's shards in parallel and can load into a different sharding later.

Save: DCP writes into `checkpoints/.step-N.tmp` (fsyncing each file), rank 0 then writes the
manifest of checksums (manifest.py), fsyncs, renames the directory to `step-N` and fsyncs the
parent; with `async_save` the loop blocks only while DCP copies the state to host memory
(`dcp.async_save`) and the write, the manifest and the rename run in a background thread; at most
one save is in flight (a new one waits for it). A failed write is one line, the partial directory
is removed and the previous checkpoints stay. Load: the newest checkpoint whose manifest verifies
is read through DCP with the safe reader and planner (safe_load.py); a bad one is one warning line
and the next older one is tried. `restore` (resume, spike recovery) first tries the in-memory
replicas (replica.py). Retention: retention.py; staging buffers: staging.py; interval: interval.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from kiln import torch_compat
from kiln.checkpoint import manifest, retention
from kiln.checkpoint.errors import describe_write_error
from kiln.checkpoint.manifest import CheckpointInvalid
from kiln.checkpoint.replica import MemoryReplicas
from kiln.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError, load_metadata
from kiln.checkpoint.staging import ReusedStaging, StagingFileSystemWriter
from kiln.errors import KilnError
from kiln.parallel.pipeline_tied import optimizer_state_for_load, optimizer_state_for_save

# DCP warns on every single-process save/load that it "assumes" single-process intent; we pass
# no_dist explicitly, so the warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

list_checkpoints = retention.list_checkpoints
# A checkpoint holding model weights only (written by `kiln import-hf`): resuming from it loads the
# weights and starts the optimizer, schedule, data position and counters fresh.
WEIGHTS_ONLY_MARKER = "weights-only.json"


class ModelOptimizerState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (FQN-keyed, sharding-aware)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        # set by CheckpointManager.load from the checkpoint's metadata: the keys of each saved param
        # group, so a checkpoint whose groups differ from this optimizer's still loads (`_regroup`)
        self.saved_groups: list[set[str]] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        torch_compat.optimizer_state_like_parameters(optim_sd, model_sd)  # torch 2.8's FSDP'd experts
        if self.saved_groups is not None:  # the template to load into: the groups as they were saved
            optim_sd = {**optim_sd, "param_groups": [dict.fromkeys(sorted(keys)) for keys in self.saved_groups]}
        return {"model": model_sd, "optim": optimizer_state_for_save(optim_sd, self._aliases())}

    def _aliases(self) -> dict[str, str]:
        """Parameters whose optimizer state is saved under another one's name: under pp, a tied
        model's head copy on the last stage, under the embedding's (kiln/parallel/pipeline_tied.py)."""
        aliases = getattr(self.model, "optimizer_state_aliases", None)
        return aliases() if aliases is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optim = optimizer_state_for_load(state.get("optim", {}), self._aliases())
        self.saved_groups = None
        if self.optimizer is not None and optim.get("param_groups"):
            optim = {**optim, "param_groups": self._own_param_names(optim["param_groups"])}
        set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"], optim_state_dict=optim)

    def _own_param_names(self, groups: list[dict]) -> list[dict]:
        """A pipeline-parallel checkpoint holds one stage's parameter names per param group (DCP
        saves the non-tensor group entry once, from one rank); on another stage's ranks torch's
        set_state_dict then finds none of their parameters in any group and drops the group's
        hyper-parameters (initial_lr, betas...). kiln builds the groups alike on every rank (same
        order, same name), so each loaded group takes this rank's parameter names; groups other
        than this optimizer's are regrouped (`_regroup`)."""
        current = get_state_dict(self.model, self.optimizer)[1]["param_groups"]
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            return groups  # not kiln's groups: left to torch's own checks, unchanged
        if len(current) != len(groups) or any(g.get("name") != c.get("name") for g, c in zip(groups, current)):
            return _regroup(groups, current)
        return [{**g, "params": c["params"]} for g, c in zip(groups, current)]


def _regroup(saved: list[dict], current: list[dict]) -> list[dict]:
    """This optimizer's groups, each with the hyper-parameters of the saved group of the same name,
    else of the saved group holding its first parameter (a checkpoint from before a group was
    split off, e.g. Muon's "muon_experts" out of "muon"), else its own; only keys it has itself.
    The per-parameter state loads by parameter name whatever the groups."""
    # a saved group's entries are checked for their type: a damaged checkpoint's odd values fall back
    by_name = {g["name"]: g for g in saved if isinstance(g.get("name"), str)}
    by_param = {name: g for g in saved if isinstance(g.get("params"), list)
                for name in g["params"] if isinstance(name, str)}
    out = []
    for c in current:
        source = by_name.get(c.get("name")) or next((by_param[n] for n in c["params"] if n in by_param), None) or c
        out.append({**c, **{k: v for k, v in source.items() if k in c and k not in ("params", "name")}})
    return out


class RNGState(Stateful):
    """The CPU generator, and the GPU's when the run trains on one. Keyed to the run's device, not
    to whether CUDA happens to be initialized (pinned memory initializes it in a CPU run on a GPU
    machine), so every rank of a layout saves the same keys. A checkpoint without a GPU state (taken
    on a CPU) continues on a GPU with the GPU generator as seeded: `load` clears `cuda_saved`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda_saved = True  # set by CheckpointManager.load from the checkpoint's metadata

    def _with_cuda(self) -> bool:
        return self.device.type == "cuda" and self.cuda_saved

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self._with_cuda():
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if self._with_cuda() and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


@dataclass
class SaveResult:
    """One finished (or failed) save. block_s: time the training loop was held; background_s:
    time the write, manifest and rename took after the loop went on (0 for a synchronous save);
    staged_bytes: this rank's host copy of the state an async save wrote from (staging.py)."""

    step: int
    path: Path
    block_s: float
    background_s: float = 0.0
    size_bytes: int = 0
    error: str | None = None  # one line, e.g. "checkpoint at step 8 not written: no space left on ..."
    note: str = ""  # e.g. that it waited for the previous save, or made room first
    staged_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    def row(self) -> dict[str, Any]:
        row = {"kind": "checkpoint", "step": self.step, "path": str(self.path), "ok": self.ok,
               "save_block_s": self.block_s, "save_background_s": self.background_s,
               "save_s": self.block_s + self.background_s, "size_bytes": self.size_bytes,
               "staged_bytes": self.staged_bytes}
        if self.error:
            row["message"] = self.error
        elif self.note:
            row["message"] = f"{self.path} ({self.note})"
        return row


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_last: int = 2, is_main: bool = True, *, keep_every: int = 0,
                 async_save: bool = False, make_room: bool = True, stop_on_error: bool = False,
                 replica_dir: str | None = None, log: Callable[[str], None] = _stderr):
        self.dir = Path(ckpt_dir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.is_main = is_main
        self.make_room = make_room
        self.stop_on_error = stop_on_error  # after a failed save, start no other (the trainer stops)
        self.log = log
        self.async_save = async_save
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._saved_step: int | None = None
        self._finished: list[SaveResult] = []
        # Saves and loads run DCP's collectives and their barriers on a gloo group of their own:
        # async ones from a background thread never interleave with the loop's collectives, and
        # the group keeps the long init bound while rank 0 hashes the manifest and the others
        # wait (kiln/parallel/timeouts.py; the loop's groups get the shorter train bound).
        self.group = dist.new_group(backend="gloo") if _distributed() else None
        self.replicas = None  # in-memory replicas need the async path's staged snapshot
        if replica_dir and async_save:
            rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
            self.replicas = MemoryReplicas(self.dir, replica_dir, rank, world, self.group)
        # each rank stages only the tensors it writes, unless replicas keep its whole snapshot
        self._staging = ReusedStaging(self.group if self.replicas is None else None)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # ---- state of the directory
    def latest_step(self) -> int | None:
        """The save in flight, else the newest this manager wrote, else the newest complete one on
        disk (manifest present; not hashed). The first two are the same on every rank, so ranks
        that ask whether to save agree even before rank 0 has renamed the directory."""
        if self._pending_step is not None:
            return self._pending_step
        if self._saved_step is not None:
            return self._saved_step
        steps = retention.complete_steps(self.dir)
        return steps[-1] if steps else None

    def clean_stray(self) -> list[Path]:
        """Remove `.step-N.tmp` directories a crashed save left (only the trainer calls this:
        eval and generate never change the run directory they read)."""
        removed = []
        if self.is_main and self.dir.is_dir():
            for tmp in self.dir.glob(".step-*.tmp"):
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
                self.log(f"checkpoint: removed {tmp} (left by an interrupted save)")
        return removed

    # ---- save
    def save(self, step: int, states: dict[str, Any], extra_files: dict[str, str] | None = None) -> list[SaveResult]:
        """Start (async) or do (sync) a save of `states` as step-N. Returns the saves that finished
        since the last call, this one included when synchronous; failures are results with an
        `error` line, never exceptions."""
        t0 = time.perf_counter()
        note = self._wait_pending()
        if self.stop_on_error and any(not r.ok for r in self._finished):
            return self._take_finished()
        final, tmp = self.dir / f"step-{step}", self.dir / f".step-{step}.tmp"
        try:
            if self.is_main:
                self.dir.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                freed = self._make_room(step)
                if freed:
                    note = "; ".join(filter(None, [note, freed]))
            self._barrier()
            if self.async_save:
                kwargs = {"storage_writer": StagingFileSystemWriter(str(tmp), self._staging),
                          "process_group": self.group}
                kwargs.update(_no_dist(dcp.async_save))
                dcp_future = dcp.async_save(states, **kwargs)
                block_s = time.perf_counter() - t0
                self._executor = self._executor or ThreadPoolExecutor(1, thread_name_prefix="kiln-ckpt")
                self._pending_step = step
                self._pending = self._executor.submit(self._finish, step, tmp, final, extra_files, block_s,
                                                      dcp_future, note)
                return self._take_finished()
            dcp.save(states, checkpoint_id=str(tmp), process_group=self.group, **_no_dist(dcp.save))
        except (Exception, CheckpointException) as e:
            self._finished.append(self._failed(step, tmp, e, time.perf_counter() - t0))
            return self._take_finished()
        self._finished.append(self._finish(step, tmp, final, extra_files, time.perf_counter() - t0, None, note))
        self._barrier()  # the other ranks see step-N only once rank 0 has renamed it
        return self._take_finished()

    def wait(self) -> list[SaveResult]:
        """Block until the save in flight (if any) is done; returns the saves finished since the last call."""
        self._wait_pending()
        return self._take_finished()

    def close(self) -> list[SaveResult]:
        results = self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return results

    def _wait_pending(self) -> str:
        if self._pending is None:
            return ""
        t0 = time.perf_counter()
        waited_for = self._pending_step
        self._finished.append(self._pending.result())  # _finish never raises
        self._pending, self._pending_step = None, None
        waited = time.perf_counter() - t0
        return f"waited {waited:.2f} s for the step-{waited_for} save to finish" if waited > 0.01 else ""

    def _take_finished(self) -> list[SaveResult]:
        done, self._finished = self._finished, []
        for result in done:
            if result.ok:
                self._saved_step = max(result.step, self._saved_step or 0)
        return done

    def _finish(self, step: int, tmp: Path, final: Path, extra_files: dict[str, str] | None, block_s: float,
                dcp_future: Future | None, note: str) -> SaveResult:
        """Everything after DCP's write: manifest, rename, retention. Runs in the background for
        async saves; turns any failure into a result line and removes the partial directory."""
        t0 = time.perf_counter()
        try:
            if dcp_future is not None:
                dcp_future.result()
                if self.replicas is not None:  # DCP's write succeeded on every rank: same on all
                    self.replicas.publish(step, self._staging.last)
            size = 0
            if self.is_main:
                for name, text in (extra_files or {}).items():
                    with open(tmp / name, "w", encoding="utf-8") as f:
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                size = manifest.write_manifest(tmp, step)
                final_old = final.with_name(f".{final.name}.old.tmp")
                if final.exists():  # re-saving a step (e.g. after a fallback): swap, then drop the old
                    final.rename(final_old)
                tmp.rename(final)
                manifest.fsync_path(self.dir)
                shutil.rmtree(final_old, ignore_errors=True)
                self._prune()
        except (Exception, CheckpointException) as e:
            failed = self._failed(step, tmp, e, block_s)
            failed.background_s = time.perf_counter() - t0 if dcp_future is not None else 0.0
            return failed
        background = time.perf_counter() - t0
        if dcp_future is None:  # synchronous: everything blocked the loop
            return SaveResult(step, final, block_s + background, 0.0, size, note=note)
        return SaveResult(step, final, block_s, background, size, note=note, staged_bytes=self._staging.nbytes)

    def _failed(self, step: int, tmp: Path, error: BaseException, block_s: float) -> SaveResult:
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        line = f"checkpoint at step {step} not written: {describe_write_error(error, tmp)}"
        self.log(line)
        return SaveResult(step, self.dir / f"step-{step}", block_s, error=line)

    # ---- retention
    def _prune(self) -> None:
        for step in retention.to_prune(retention.complete_steps(self.dir), self.keep_last, self.keep_every):
            shutil.rmtree(self.dir / f"step-{step}", ignore_errors=True)

    def _make_room(self, step: int) -> str:
        """Before a save, when the free space is less than the newest checkpoint's size, delete
        the checkpoints retention would delete after this save anyway (never the newest complete one)."""
        if not self.make_room:
            return ""
        steps = retention.complete_steps(self.dir)
        if not steps:
            return ""
        needed = manifest.manifest_size(self.dir / f"step-{steps[-1]}")
        if shutil.disk_usage(self.dir).free >= needed:
            return ""
        doomed = [s for s in retention.to_prune(sorted(set(steps) | {step}), self.keep_last, self.keep_every)
                  if s != steps[-1] and s != step]
        for old in doomed:
            shutil.rmtree(self.dir / f"step-{old}", ignore_errors=True)
        if doomed:
            return f"disk short: pruned step(s) {', '.join(map(str, doomed))} before saving"
        return ""

    # ---- load
    def saved_state_names(self, step: int) -> set[str] | None:
        """The top-level state names (`app`, `loader`, ...) checkpoint `step` holds, from its
        `.metadata` read through the allowlist unpickler (no tensor data read, nothing hashed);
        None when it is unreadable (`load` then reports it and falls back to an older one)."""
        path = self.dir / f"step-{step}" / ".metadata"
        try:
            metadata = load_metadata(path.read_bytes(), str(path))
        except UnsafeCheckpointError:
            raise
        except (OSError, KilnError):
            return None
        return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}

    def restore(self, states: dict[str, Any]) -> tuple[int, str, float]:
        """Resume: from host memory when a replica at least as new as storage's newest is there
        (replica.py), else from storage. Returns (step, "own memory" | "peer memory" | "storage", seconds)."""
        storage_step = self.latest_step()
        if self.replicas is not None:
            recovered = self.replicas.restore(states, storage_step)
            if recovered is not None:
                return recovered
        t0 = time.perf_counter()
        step = self.load(states)
        return step, "storage", time.perf_counter() - t0

    def load(self, states: dict[str, Any], step: int | None = None) -> int:
        """Load `states` from `step`, or from the newest checkpoint that verifies. Each one passed
        over is one warning line; if none is good, a KilnError lists why."""
        found = dict(list_checkpoints(self.dir))
        if not found:
            raise KilnError(f"{self.dir}: no checkpoint to load (expected step-N directories)")
        if step is not None and step not in found:
            raise KilnError(f"{self.dir}: no checkpoint for step {step}; have {sorted(found)}")
        candidates = [step] if step is not None else sorted(found, reverse=True)
        problems = []
        for candidate in candidates:
            path = found[candidate]
            try:
                manifest.verify(path)
                # Refuse a hostile .metadata here, in one line: inside dcp.load the reader's
                # refusal (same allowlist) would come back wrapped in DCP's own errors.
                metadata = load_metadata((path / ".metadata").read_bytes(), str(path / ".metadata"))
                wanted = dict(states)
                for name, value in states.items():  # a CPU checkpoint continuing on a GPU
                    if isinstance(value, RNGState):
                        value.cuda_saved = f"{name}.cuda" in metadata.state_dict_metadata
                    if isinstance(value, ModelOptimizerState) and value.optimizer is not None:
                        value.saved_groups = saved_param_groups(metadata, f"{name}.optim.param_groups.")
                    # A state that reads this checkpoint's keys under its name first (DiLoCo's outer
                    # state, its layout entry): False leaves it out of this checkpoint's load.
                    match = getattr(value, "match_checkpoint", None)
                    if match is not None:
                        prefix = f"{name}."
                        own = {k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)}
                        if not match(own, str(path)):
                            del wanted[name]
                dcp.load(wanted, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                         process_group=self.group, **_no_dist(dcp.load))
                states.update(wanted)  # DCP puts loaded non-tensor values into the dict it was given
                return candidate
            except UnsafeCheckpointError:
                raise  # a tampered checkpoint is refused outright, never silently skipped
            except CheckpointInvalid as e:
                problem = str(e)
            except CheckpointException as e:  # DCP wraps per-rank failures in a BaseException
                problem = f"{path}: unreadable ({_first_failure(e)})"
            except (KilnError, OSError, RuntimeError, ValueError, KeyError) as e:
                problem = f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            problems.append(problem)
            self.log(f"checkpoint skipped: {problem}")
        raise KilnError(f"{self.dir}: no usable checkpoint ({'; '.join(problems)})")


def saved_param_groups(metadata, prefix: str) -> list[set[str]] | None:
    """The keys of each param group a checkpoint saved under `prefix` ("app.optim.param_groups."),
    in order; None when it saved none."""
    groups: dict[int, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            index, _, field = key[len(prefix):].partition(".")
            if index.isdigit() and field and "." not in field:
                groups.setdefault(int(index), set()).add(field)
    if not groups or sorted(groups) != list(range(len(groups))):
        return None
    return [groups[i] for i in range(len(groups))]


def _first_failure(e: CheckpointException) -> str:
    for exc, _ in e.failures.values():
        if isinstance(exc, UnsafeCheckpointError):
            raise exc
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "unknown DCP failure"


def _no_dist(dcp_call) -> dict:
    return torch_compat.dcp_no_dist(dcp_call, _distributed())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()

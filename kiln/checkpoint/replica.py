"""In-memory checkpoint replicas (Gemini): recover from host memory, not storage, after a restart.

After each successful async save, every rank writes the snapshot it staged for that save (its own
shards, DTensors as their local tensors) to host memory that outlives the worker process: a file
in tmpfs (`checkpoint.replica_dir`, default /dev/shm), which torchrun's elastic agent leaves in
place when it restarts the workers. It also sends the same bytes to its peer rank (rank + 1 mod
world, over the checkpoint gloo group), which keeps them as `peer-of-R`. On a restart with the same
world size, ranks agree (one all-gather) on the newest step every rank can get from memory, its
own copy or its peer's (the peer then sends it back); they load that if it is at least as new as
the newest checkpoint on storage, else storage is used. Which path was taken, and its time, is
returned for the trainer to log. Replica files are read with `torch.load(weights_only=True)` and
checked against their SHA-256; a different world size or layout falls back to storage (DCP).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from torch.distributed.tensor import DTensor

from kiln.parallel import zero1_shards


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _plain(obj: Any) -> Any:
    """A copy-free view of a staged state dict that weights_only loading accepts."""
    if zero1_shards.is_sharded(obj):  # ZeRO-1's share of an optimizer state: its local tensors
        return zero1_shards.local_tensors(obj)
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _fill(live: Any, saved: Any) -> Any:
    """Copy `saved` into the live state dict's tensors in place (DTensors: their local shard)."""
    if zero1_shards.is_sharded(live):
        zero1_shards.fill(live, saved)
        return live
    if isinstance(live, DTensor):
        live.to_local().copy_(saved)
        return live
    if isinstance(live, torch.Tensor):
        if live.shape != saved.shape:
            raise ValueError(f"shape {tuple(saved.shape)} in memory, {tuple(live.shape)} expected")
        live.copy_(saved)
        return live
    if isinstance(live, dict):
        if set(live) != set(saved):
            raise ValueError("state keys differ from the replica's")
        return {k: _fill(live[k], saved[k]) for k in live}
    return saved


class MemoryReplicas:
    def __init__(self, run_dir: Path, root: str | Path, rank: int, world: int, group=None):
        run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        self.dir = Path(root) / f"kiln-replicas-{run_id}"
        self.rank, self.world, self.group = rank, world, group
        self.peer, self.source = (rank + 1) % world, (rank - 1) % world

    # ---- files: DATA.pt + DATA.json ({"step", "sha256", "world"}), written data first
    def _private(self) -> bool:
        """The replica directory is ours alone: /dev/shm is shared by every local user, so a
        directory someone else created (or made readable/writable to others) is never used."""
        try:
            st = os.lstat(self.dir)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077

    def _write(self, name: str, step: int, data: bytes) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self._private():
            raise OSError(f"{self.dir}: not a private directory of this user; replica not written")
        for suffix, payload in ((".pt", data), (".json", json.dumps(
                {"step": step, "world": self.world, "sha256": hashlib.sha256(data).hexdigest()}).encode())):
            tmp = self.dir / f".{name}{suffix}.tmp"
            tmp.write_bytes(payload)
            os.replace(tmp, self.dir / f"{name}{suffix}")

    def _read(self, name: str) -> tuple[int, bytes] | None:
        if not self._private():
            return None
        try:
            info = json.loads((self.dir / f"{name}.json").read_text())
            data = (self.dir / f"{name}.pt").read_bytes()
        except (OSError, ValueError):
            return None
        if (not isinstance(info, dict) or info.get("world") != self.world or not isinstance(info.get("step"), int)
                or hashlib.sha256(data).hexdigest() != info.get("sha256")):
            return None
        return info["step"], data

    def _step_of(self, name: str) -> int:
        if not self._private():
            return -1
        try:
            info = json.loads((self.dir / f"{name}.json").read_text())
            return int(info["step"]) if info.get("world") == self.world else -1
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def discard(self) -> None:
        """Free the host memory (the run finished; storage holds its checkpoints)."""
        for f in self.dir.glob(f"*-{self.rank}.*"):
            f.unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass  # another rank's files are still there

    # ---- publish (every rank, after a save succeeded; collective when world > 1)
    def publish(self, step: int, staged: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(_plain(staged), buf)
        data = buf.getvalue()
        self._write_or_warn(f"own-{self.rank}", step, data)
        if self.world > 1:  # always reached on every rank: the ring is collective
            self._write_or_warn(f"peer-of-{self.source}", step, self._ring(data))

    def _write_or_warn(self, name: str, step: int, data: bytes) -> None:
        """A replica that cannot be written (tmpfs full, foreign directory) costs only the fast
        recovery path; the checkpoint on storage is unaffected."""
        try:
            self._write(name, step, data)
        except OSError as e:
            print(f"memory replica {name} of step {step} not written: {e}", file=sys.stderr, flush=True)

    def _ring(self, data: bytes) -> bytes:
        """Send `data` to the peer, receive the source rank's bytes (gloo point-to-point)."""
        size_out = torch.tensor([len(data)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        reqs = [dist.isend(size_out, self._global(self.peer), group=self.group),
                dist.irecv(size_in, self._global(self.source), group=self.group)]
        for r in reqs:
            r.wait()
        into = torch.empty(int(size_in.item()), dtype=torch.uint8)
        reqs = [dist.isend(_bytes_tensor(data), self._global(self.peer), group=self.group),
                dist.irecv(into, self._global(self.source), group=self.group)]
        for r in reqs:
            r.wait()
        return into.numpy().tobytes()

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # ---- restore (every rank; collective when world > 1)
    def restore(self, states: dict[str, Any], storage_step: int | None) -> tuple[int, str, float] | None:
        """Load the newest step every rank has in memory, if it is not older than storage's.
        Returns (step, "own memory" | "peer memory for rank(s) ...", seconds), or None for storage."""
        t0 = time.perf_counter()
        own, held = self._step_of(f"own-{self.rank}"), self._step_of(f"peer-of-{self.source}")
        if self.world > 1:
            table = torch.tensor([own, held], dtype=torch.int64)
            gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(gathered, table, group=self.group)
            owns = [int(t[0]) for t in gathered]
            helds = [int(t[1]) for t in gathered]  # helds[r] is rank r's copy of rank r-1's state
        else:
            owns, helds = [own], [-1]
        # Rank r's state at step s is available if its own copy or its peer's (held by r+1) has s.
        candidates = {s for s in owns + helds if s >= 0}
        usable = [s for s in sorted(candidates, reverse=True)
                  if all(owns[r] == s or helds[(r + 1) % self.world] == s for r in range(self.world))]
        if not usable or (storage_step is not None and usable[0] < storage_step):
            return None
        step = usable[0]
        mine = self._read(f"own-{self.rank}") if owns[self.rank] == step else None
        need_from_peer = [owns[r] != step for r in range(self.world)]
        if self.world > 1 and any(need_from_peer):
            mine = self._return_copies(step, need_from_peer, mine)
        filled = None
        # On every rank, before anything that may fail on one: a state_dict may be a collective
        # (DCP's get_state_dict steps a never-stepped ZeRO-1 optimizer on zero gradients: broadcasts).
        live = _stateful_to_state_dict(states)
        try:  # into the live state dicts' tensors; load_state_dict only once every rank succeeded
            if mine is None or mine[0] != step:
                raise ValueError("replica vanished or corrupted")
            saved = torch.load(io.BytesIO(mine[1]), weights_only=True)
            filled = {key: _fill(value, saved[key]) for key, value in live.items()}
        except Exception:
            filled = None
        ok = torch.tensor([0 if filled is None else 1], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(ok.item()):
            return None
        for key, value in filled.items():
            if hasattr(states[key], "load_state_dict"):
                states[key].load_state_dict(value)
        from_peer = [r for r, missing in enumerate(need_from_peer) if missing]
        how = f"peer memory for rank(s) {', '.join(map(str, from_peer))}" if from_peer else "own memory"
        return step, how, time.perf_counter() - t0

    def _return_copies(self, step: int, need: list[bool], mine):
        """Ranks whose own copy is gone get it back from their peer (which holds it as peer-of)."""
        for r, missing in enumerate(need):
            if not missing:
                continue
            holder = (r + 1) % self.world
            if self.rank == holder:
                _, data = self._read(f"peer-of-{r}") or (None, b"")
                dist.send(torch.tensor([len(data)], dtype=torch.int64), self._global(r), group=self.group)
                dist.send(_bytes_tensor(data), self._global(r), group=self.group)
            elif self.rank == r:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, self._global(holder), group=self.group)
                into = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(into, self._global(holder), group=self.group)
                mine = (step, into.numpy().tobytes())
        return mine

"""Batches of contiguous token windows from memory-mapped shards, with exact resume.

Window i of a shard is tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs plus the shifted
targets). Each epoch visits every window once in an order fixed by (seed, epoch).

The loader's state is a *global* position: (epoch, samples consumed by all data-parallel ranks
together). A micro-batch step takes the next `batch_size * dp_size` positions of the epoch's
permutation and rank r keeps its slice, so resuming - even with a different number of ranks -
continues on exactly the next unseen samples. A background thread prepares batches ahead; the
state reports what the trainer has consumed, not what the thread has prepared.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from kiln.data.shards import ShardSet
from kiln.errors import DataError


class TokenWindows:
    """Index of all seq_len+1 windows across the shards of one split."""

    def __init__(self, shards: ShardSet, seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (t.shape[0] - 1) // seq_len) for t in shards.tokens]
        self.offsets = np.cumsum([0] + counts)
        if self.offsets[-1] == 0:
            raise DataError(
                f"{shards.dir}: split {shards.split!r} has {shards.n_tokens} tokens, fewer than "
                f"seq_len+1={seq_len + 1}; lower data.seq_len or add data")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 array of the windows."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        shard_ids = np.searchsorted(self.offsets, indices, side="right") - 1
        for row, (i, s) in enumerate(zip(indices, shard_ids)):
            start = (int(i) - int(self.offsets[s])) * self.seq_len
            out[row] = self.shards.tokens[s][start:start + self.seq_len + 1]
        return out


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class Loader:
    """Yields (inputs, targets) micro-batches of shape (batch_size, seq_len) for one dp rank."""

    def __init__(self, windows: TokenWindows, batch_size: int, *, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, prefetch: int = 4, device: torch.device | str = "cpu"):
        self.windows, self.batch_size = windows, batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.global_batch = batch_size * dp_size
        if self.global_batch > len(windows):
            raise DataError(f"a global micro-batch of {self.global_batch} sequences needs more than the "
                            f"{len(windows)} windows of seq_len={windows.seq_len} the training split has")
        self.prefetch = max(1, prefetch)
        self.device = torch.device(device)
        self.epoch, self.position = 0, 0  # consumed so far
        self.wait_s = 0.0  # time the trainer spent blocked on data, reset by the caller
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._shutdown()
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state["seed"])
        # A checkpoint from a different dp size may sit mid global batch; the next batch simply
        # starts there, so nothing is skipped or repeated.

    # ------------------------------------------------------------------ batches
    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, epoch_order(len(self.windows), self.seed, epoch))
        return self._order_cache[1]

    def _advance(self, epoch: int, position: int) -> tuple[int, int, np.ndarray]:
        if position + self.global_batch > len(self.windows):  # drop the epoch's ragged tail
            epoch, position = epoch + 1, 0
        idx = self._order(epoch)[position:position + self.global_batch]
        mine = idx[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
        return epoch, position + self.global_batch, mine

    def _make(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(self.windows.gather(indices))
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch[:, :-1], batch[:, 1:]

    def _worker(self, epoch: int, position: int) -> None:
        try:
            while not self._stop.is_set():
                epoch, position, idx = self._advance(epoch, position)
                item = (epoch, position, self._make(idx))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surface worker failures in the trainer's thread
            self._queue.put(e)

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
            self._stop.clear()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._worker, args=(self.epoch, self.position),
                                            daemon=True, name="kiln-loader")
            self._thread.start()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        self.epoch, self.position, (x, y) = item
        non_blocking = self.device.type == "cuda"
        return x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking)

    def close(self) -> None:
        self._shutdown()


def eval_batches(windows: TokenWindows, batch_size: int, max_batches: int):
    """A fixed set of validation windows spread evenly over the split, in batches (no shuffling)."""
    n = min(len(windows), batch_size * max_batches)
    idx = np.linspace(0, len(windows) - 1, n).round().astype(np.int64)
    for i in range(0, n, batch_size):
        batch = torch.from_numpy(windows.gather(idx[i:i + batch_size]))
        yield batch[:, :-1], batch[:, 1:]

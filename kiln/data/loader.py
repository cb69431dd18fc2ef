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
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from kiln.data.shards import ShardSet

if TYPE_CHECKING:
    from kiln.data.mixture import MixtureWindows
from kiln.errors import DataError


def checked_doc_offsets(doc_offsets: np.ndarray, n_tokens: int, where: str) -> np.ndarray:
    """A stream's document offsets, or DataError naming `where` unless they rise strictly from 0
    to its n_tokens."""
    if doc_offsets.ndim != 1 or len(doc_offsets) < 2 or doc_offsets[0] != 0 or doc_offsets[-1] != n_tokens \
            or (np.diff(doc_offsets) <= 0).any():
        raise DataError(f"{where}: corrupted document index: offsets must rise strictly from 0 to the stream's "
                        f"{n_tokens} tokens")
    return doc_offsets


class TokenWindows:
    """Index of the seq_len+1 windows of one split's shards, or of in-memory token streams.

    Window k of a stream starts at token k*seq_len; windows never cross from one stream (shard)
    into the next. With `ragged_tail`, each stream's last, shorter window (at least 2 tokens: one
    input, one target) is kept too, so every token but a stream's first is scored once - what
    held-out evaluation wants; training and the trainer's validation use full windows only.

    With `doc_starts` (shards only), windows start at document starts instead: a document of n
    tokens gets windows at its start and every seq_len after it, ceil(n / seq_len) of them, each
    still seq_len+1 tokens long (a short document's window runs on into the next ones) and dropped
    if it would run past the end of its shard. No window begins mid-sentence at an arbitrary
    offset, at the price of some tokens being seen twice in an epoch.

    With `doc_ids` (`data.windows = "packed_masked"`), windows stay contiguous but
    `gather_doc_ids` also gives, per window token, the index of its document within the window
    (0 for the document the window starts in), from the shard's `.docs.npy` offsets or, for
    in-memory streams, `doc_offsets` (each stream's document start offsets and its length, rising
    from 0); the model turns it into a block-diagonal causal mask so attention does not cross
    documents. Training, the trainer's evaluation and `kiln eval` all mask the same way.
    """

    def __init__(self, streams: ShardSet | Sequence[np.ndarray], seq_len: int, *, ragged_tail: bool = False,
                 source: str = "token stream", doc_starts: bool = False, doc_ids: bool = False,
                 doc_offsets: Sequence[np.ndarray] | None = None):
        self.seq_len, self.ragged_tail = seq_len, ragged_tail
        self.doc_offsets: list[np.ndarray] | None = None  # doc_ids: each stream's document offsets
        self.starts: np.ndarray | None = None  # doc_starts: global window -> start token in its stream
        self.shards = streams if isinstance(streams, ShardSet) else None
        self.tokens = list(streams.tokens) if self.shards is not None else [np.asarray(t) for t in streams]
        sizes = [int(t.shape[0]) for t in self.tokens]
        if doc_starts:
            if self.shards is None or ragged_tail:
                raise ValueError("doc_starts needs a ShardSet (for its document index) and no ragged tail")
            per_stream = [self._doc_window_starts(np.asarray(d, dtype=np.int64), n, seq_len,
                                                  f"{self.shards.dir}/{self.shards.shard_files(i)[1]}")
                          for i, (d, n) in enumerate(zip(self.shards.docs, sizes))]
            counts = [len(p) for p in per_stream]
            self.starts = np.concatenate(per_stream) if per_stream else np.zeros(0, np.int64)
        elif ragged_tail:
            counts = [max(0, -(-(n - 1) // seq_len)) for n in sizes]  # ceil((n - 1) / seq_len)
        else:
            counts = [max(0, (n - 1) // seq_len) for n in sizes]
        self.offsets = np.cumsum([0] + counts)
        if doc_ids or doc_offsets is not None:
            if doc_starts or (self.shards is None) == (doc_offsets is None):
                raise ValueError("doc_ids needs contiguous windows and a ShardSet (its document index) or, for "
                                 "in-memory streams, doc_offsets")
            if doc_offsets is not None and len(doc_offsets) != len(sizes):
                raise ValueError(f"doc_offsets: {len(doc_offsets)} arrays for {len(sizes)} streams")
            wheres = ([f"{self.shards.dir}/{self.shards.shard_files(i)[1]}" for i in range(len(sizes))]
                      if self.shards is not None else [f"{source} (stream {i})" for i in range(len(sizes))])
            self.doc_offsets = [checked_doc_offsets(np.asarray(d, dtype=np.int64), n, where)
                                for d, n, where in zip(self.shards.docs if self.shards is not None else doc_offsets,
                                                       sizes, wheres)]
        if self.remote:
            self._plan_cache()
        if self.offsets[-1] == 0:
            need = "2" if ragged_tail else f"seq_len+1={seq_len + 1}"
            if self.shards is not None:
                raise DataError(f"{streams.dir}: split {streams.split!r} has {streams.n_tokens} tokens, fewer than "
                                f"{need}; lower data.seq_len or add data")
            raise DataError(f"{source} has {sum(sizes)} tokens, fewer than {need}")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @staticmethod
    def _doc_window_starts(doc_offsets: np.ndarray, n_tokens: int, seq_len: int, where: str) -> np.ndarray:
        """Window starts of one shard: each document's start and every seq_len into it (numpy)."""
        checked_doc_offsets(doc_offsets, n_tokens, where)
        lengths = np.diff(doc_offsets)
        per_doc = -(-lengths // seq_len)  # ceil
        first = np.repeat(doc_offsets[:-1], per_doc)
        within = np.arange(per_doc.sum()) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        starts = first + within * seq_len
        return starts[starts + seq_len + 1 <= n_tokens]

    @property
    def remote(self) -> bool:
        """True when the windows read shards through a download cache (worth prefetching)."""
        return self.shards is not None and self.shards.store.remote

    def _plan_cache(self) -> None:
        """Let the store pick whole-shard or window caching for this split's bytes (the first
        split planned decides; the trainer plans the train split first)."""
        itemsize = self.shards.tokens[0].dtype.itemsize if self.tokens else 1
        header = 128  # what numpy writes before the data of a 1-D array
        tokens = sum(int(t.shape[0]) * itemsize + header for t in self.tokens)
        docs = sum(int(d.shape[0]) * 8 + header for d in self.shards.docs)
        self.shards.store.plan(tokens + docs, docs, (self.seq_len + 1) * itemsize)

    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the shard store's cache so far; (0, 0) for local or in-memory data."""
        return self.shards.store.counts() if self.remote else (0, 0)

    def prefetch(self, indices: np.ndarray) -> None:
        """Start fetching what these windows need, without waiting: their bytes when the store
        caches windows, else the files of their shards."""
        if not (self.remote and len(indices)):
            return
        indices = np.asarray(indices)
        store = self.shards.store
        if store.mode == "window":
            stream, start = self._locate(indices)
            stop = start + self.lengths(indices)
            store.prefetch_ranges([(self.shards.shard_files(s)[0], a, b, self.tokens[s].shape[0], self.tokens[s].dtype)
                                   for s, a, b in zip(stream.tolist(), start.tolist(), stop.tolist())])
        else:
            streams = np.unique(self._locate(indices)[0])
            store.prefetch([f for s in streams.tolist() for f in self.shards.shard_files(s)])

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, start token) of each window index."""
        stream = np.searchsorted(self.offsets, indices, side="right") - 1
        if self.starts is not None:
            return stream, self.starts[np.asarray(indices, dtype=np.int64)]
        return stream, (np.asarray(indices, dtype=np.int64) - self.offsets[stream]) * self.seq_len

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        """Tokens in each window: seq_len + 1, less for a ragged tail."""
        stream, start = self._locate(indices)
        sizes = np.array([t.shape[0] for t in self.tokens], dtype=np.int64)
        return np.minimum(self.seq_len + 1, sizes[stream] - start)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), length) int64 array of windows that all have the same length."""
        length = self.seq_len + 1
        if self.ragged_tail:
            lengths = self.lengths(indices)
            if len(lengths) and lengths.min() != lengths.max():
                raise ValueError("gather: windows of different lengths; batch a ragged tail on its own")
            length = int(lengths[0]) if len(lengths) else length
        out = np.empty((len(indices), length), dtype=np.int64)
        if self.remote and self.shards.store.mode == "window":
            self.prefetch(indices)  # the batch's missing windows in parallel, not one after another
        stream, start = self._locate(indices)
        for row, (s, a) in enumerate(zip(stream.tolist(), start.tolist())):
            out[row] = self.tokens[s][a:a + length]
        return out

    @property
    def carries_doc_ids(self) -> bool:
        return self.doc_offsets is not None

    def gather_doc_ids(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), length) int64, shaped as `gather`'s windows: each window token's
        document, counted from the window's first (0), by binary search in the stream's document
        offsets (numpy)."""
        if self.doc_offsets is None:
            raise ValueError("gather_doc_ids needs TokenWindows(..., doc_ids=True) or doc_offsets")
        length = self.seq_len + 1
        if self.ragged_tail and len(indices):
            length = int(self.lengths(indices)[0])  # gather refuses mixed lengths
        stream, start = self._locate(indices)
        span = np.arange(length, dtype=np.int64)
        out = np.empty((len(indices), length), dtype=np.int64)
        for row, (s, a) in enumerate(zip(stream.tolist(), start.tolist())):
            ids = np.searchsorted(self.doc_offsets[s], a + span, side="right")
            out[row] = ids - ids[0]
        return out


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class Loader:
    """Yields (inputs, targets) micro-batches of shape (batch_size, seq_len) for one dp rank, plus
    the inputs' document ids when the windows carry them (data.windows = "packed_masked")."""

    def __init__(self, windows: TokenWindows | MixtureWindows, batch_size: int, *, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, prefetch: int = 4, device: torch.device | str = "cpu",
                 lookahead: int = 16):
        self.windows, self.batch_size = windows, batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.global_batch = batch_size * dp_size
        if self.global_batch > len(windows):
            raise DataError(f"a global micro-batch of {self.global_batch} sequences needs more than the "
                            f"{len(windows)} windows of seq_len={windows.seq_len} the training split has")
        self.prefetch = max(1, prefetch)
        # Remote shards: batches ahead of the one being built whose shards are fetched already.
        self.lookahead = max(0, lookahead) if windows.remote else 0
        self.device = torch.device(device)
        self.epoch, self.position = 0, 0  # consumed so far
        self.wait_s = 0.0  # time the trainer spent blocked on data, reset by the caller
        # epoch -> [hits, misses] of the shard cache while preparing that epoch's batches
        self.cache_by_epoch: dict[int, list[int]] = {}
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
        if getattr(self.windows, "ordered", False):
            # a mixture is one endless stream with its own shuffle: the position is all the state
            idx = np.arange(position, position + self.global_batch, dtype=np.int64)
        else:
            if position + self.global_batch > len(self.windows):  # drop the epoch's ragged tail
                epoch, position = epoch + 1, 0
            idx = self._order(epoch)[position:position + self.global_batch]
        mine = idx[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
        return epoch, position + self.global_batch, mine

    def _prefetch_ahead(self, cursor: tuple[int, int], batches: int) -> tuple[int, int]:
        """Ask the store for what this rank's next `batches` batches from `cursor` need (same
        sampler); the cursor after them."""
        ahead = []
        for _ in range(batches):
            epoch, position, idx = self._advance(*cursor)
            cursor = (epoch, position)
            ahead.append(idx)
        self.windows.prefetch(np.concatenate(ahead))
        return cursor

    def _make(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), plus the inputs' document ids when the windows carry them."""
        batch = torch.from_numpy(self.windows.gather(indices))
        if getattr(self.windows, "carries_doc_ids", False):
            doc_ids = torch.from_numpy(self.windows.gather_doc_ids(indices))
            batch = torch.cat([batch, doc_ids])  # one pinned buffer, one copy to the device
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        if batch.shape[0] > len(indices):
            n = len(indices)
            return batch[:n, :-1], batch[:n, 1:], batch[n:, :-1]
        return batch[:, :-1], batch[:, 1:]

    def _worker(self, epoch: int, position: int) -> None:
        # Prefetch in refills of half the lookahead, not one batch at a time: the store then sees
        # many windows at once and can merge neighbours of one shard into one range request.
        cursor, ahead = (epoch, position), 0  # batches from the current one on already asked for
        try:
            while not self._stop.is_set():
                if self.lookahead and ahead <= self.lookahead // 2:
                    cursor = self._prefetch_ahead(cursor, self.lookahead + 1 - ahead)
                    ahead = self.lookahead + 1
                ahead -= 1
                epoch, position, idx = self._advance(epoch, position)
                hits, misses = self._cache_counts()
                item = (epoch, position, self._make(idx))
                if self.windows.remote:  # per-epoch hit rates, for loader-bench and benchmarks
                    now = self._cache_counts()
                    counts = self.cache_by_epoch.setdefault(epoch, [0, 0])
                    counts[0] += now[0] - hits
                    counts[1] += now[1] - misses
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surface worker failures in the trainer's thread
            self._queue.put(e)

    def _cache_counts(self) -> tuple[int, int]:
        counts = getattr(self.windows, "cache_counts", None)  # a mixture has no single store
        return counts() if counts is not None else (0, 0)

    def cache_hit_rates(self) -> dict[int, float]:
        """Share of each epoch's cache reads (windows, or shard files) that hit, for remote shards."""
        return {e: h / max(1, h + m) for e, (h, m) in sorted(self.cache_by_epoch.items())}

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
            self._stop.clear()

    def next(self) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), or (inputs, targets, doc_ids) for packed_masked windows."""
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
        self.epoch, self.position, tensors = item
        non_blocking = self.device.type == "cuda"
        return tuple(t.to(self.device, non_blocking=non_blocking) for t in tensors)

    def close(self) -> None:
        self._shutdown()


def window_batches(windows: TokenWindows, indices: np.ndarray, batch_size: int):
    """(inputs, targets) batches of the given windows, in order, `batch_size` at a time; a window
    shorter than seq_len + 1 (a ragged tail) is scored as a batch of its own. Windows that carry
    document ids give (inputs, targets, rows, inputs' document ids): the batch format of
    kiln.eval.scoring.score_batches, all of whose `rows` are counted."""
    indices = np.asarray(indices, dtype=np.int64)
    for i in range(0, len(indices), batch_size):
        chunk = indices[i:i + batch_size]
        groups = [chunk]
        if windows.ragged_tail:
            full = windows.lengths(chunk) == windows.seq_len + 1
            groups = [chunk[full]] + [chunk[j:j + 1] for j in np.flatnonzero(~full)]
        for group in groups:
            if len(group):
                batch = torch.from_numpy(windows.gather(group))
                if windows.carries_doc_ids:
                    doc_ids = torch.from_numpy(windows.gather_doc_ids(group))
                    yield batch[:, :-1], batch[:, 1:], len(group), doc_ids[:, :-1]
                else:
                    yield batch[:, :-1], batch[:, 1:]


def eval_batches(windows: TokenWindows, batch_size: int, max_batches: int, share: tuple[int, int] | None = None):
    """A fixed set of validation windows spread evenly over the split, in batches (no shuffling).
    `share` = (rank, size): `max_batches` batches of `batch_size` windows per rank, split as
    `rank_batches` does (the set is then that of one process with batch_size x size)."""
    size = share[1] if share else 1
    n = min(len(windows), batch_size * size * max_batches)
    indices = np.linspace(0, len(windows) - 1, n).round().astype(np.int64)
    return rank_batches(windows, indices, batch_size, share) if share else window_batches(windows, indices, batch_size)


def leading_batches(windows: TokenWindows, batch_size: int, max_batches: int = 0,
                    share: tuple[int, int] | None = None):
    """The first windows in stream order, at most `batch_size * max_batches` of them per rank (0: all)."""
    size = share[1] if share else 1
    n = min(len(windows), batch_size * size * max_batches) if max_batches else len(windows)
    indices = np.arange(n)
    return rank_batches(windows, indices, batch_size, share) if share else window_batches(windows, indices, batch_size)


def rank_batches(windows: TokenWindows, indices: np.ndarray, batch_size: int, share: tuple[int, int]):
    """(inputs, targets, rows[, document ids]) batches of rank `share[0]`'s contiguous block of `indices`, of
    ceil(len / size) windows on every rank: a short block is padded with copies of the first
    window, which are not counted (only the first `rows` rows of a batch are), so the k-th batch
    has the same shape on every rank (under FSDP, DDP and expert parallelism a forward is a
    collective). Full-length windows only (a ragged tail would be a batch of its own on one rank)."""
    if windows.ragged_tail:
        raise ValueError("rank_batches takes full-length windows only (ragged_tail=False)")
    rank, size = share
    per = -(-len(indices) // size)
    mine = np.asarray(indices[rank * per:(rank + 1) * per], dtype=np.int64)
    real = len(mine)
    mine = np.concatenate([mine, np.repeat(np.asarray(indices[:1], dtype=np.int64), per - real)])
    for at, (x, y, *doc_ids) in zip(range(0, per, batch_size), window_batches(windows, mine, batch_size)):
        yield x, y, max(0, min(len(x), real - at)), *doc_ids[1:]

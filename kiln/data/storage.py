"""Shard access through one storage layer: local paths, `s3://` and any fsspec URL.

`ShardStore(url)` serves the files of one shard directory. A local directory is read in place
(the files are memory-mapped, exactly as before). A remote one is copied, whole file by whole
file, into a bounded on-disk cache (`ShardCache`) and memory-mapped from there; files larger than
`range_bytes` are fetched as parallel byte ranges. `prefetch(names)` starts downloads on a thread
pool so the loader can ask for the shards its sampler will need next, before it needs them.

Every remote read is retried with exponential backoff; when the retries run out the error is a
`DataError` naming the URL of the file (and the byte range, for range reads). A downloaded file
whose size differs from what the store reports is treated as truncated and fetched again.

What is library code and what is ours: fsspec (`fsspec.core.url_to_fs`, `cat_file`, `get_file`,
`size`) does all I/O and protocol handling, s3fs the S3 protocol; the cache accounting, the
eviction order (least recently used, never a file being read right now), retries and the
parallel range split are written here.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from kiln.data.cache import make_policy
from kiln.errors import DataError
from kiln.io import atomic_file

T = TypeVar("T")
DEFAULT_CACHE_DIR = Path(os.environ.get("KILN_SHARD_CACHE", Path.home() / ".cache" / "kiln" / "shards"))


def is_url(path: str | os.PathLike) -> bool:
    """True for `proto://...` (s3, gcs, http, memory, file, ...); plain paths are local."""
    return "://" in str(path)


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def with_retries(what: str, fn: Callable[[], T], retries: int, backoff_s: float) -> T:
    """fn() retried `retries` times with exponential backoff; then a DataError naming `what`."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except DataError:
            raise
        except Exception as e:  # fsspec backends raise OSError, botocore and aiohttp errors alike
            if attempt == retries:
                raise DataError(f"{what}: {type(e).__name__}: {e} (after {retries + 1} attempts)") from None
            time.sleep(backoff_s * (2 ** attempt))
    raise AssertionError("unreachable")


class ShardCache:
    """A directory of downloaded files bounded to `max_bytes` by a policy (kiln/data/cache.py).

    "lru" evicts the least recently used file; "static" (CoorDL) keeps the files that filled the
    cache first for good and passes later ones through a scratch area of the last
    `scratch_files` of them. The file just admitted is never evicted (a single file larger than
    the bound still lands; `overflow_bytes` says by how much). An evicted file that is
    memory-mapped stays readable through its mapping (POSIX unlink semantics); the next read
    through `ShardStore.array` fetches it again. Files are keyed by a hash of their URL, so two
    datasets never collide in one cache directory. `hits`/`misses` count lookups.
    """

    def __init__(self, directory: str | Path, max_bytes: int, policy: str = "lru", scratch_files: int = 8):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.policy = make_policy(policy, self.max_bytes)
        self.scratch: OrderedDict[str, int] = OrderedDict()  # files the policy did not keep
        self.scratch_files = max(1, scratch_files)
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self.overflow_bytes = 0
        for f in sorted(self.dir.glob("*.cached"), key=lambda p: p.stat().st_mtime):  # survive restarts
            kept, evicted = self.policy.admit(f.stem, f.stat().st_size)
            for old in evicted + ([] if kept else [f.stem]):
                (self.dir / f"{old}.cached").unlink(missing_ok=True)

    @staticmethod
    def key(url: str) -> str:
        return hashlib.sha256(url.encode()).hexdigest()[:32]

    def path(self, url: str) -> Path:
        return self.dir / f"{self.key(url)}.cached"

    @property
    def used_bytes(self) -> int:
        """Bytes the policy keeps (the scratch area comes on top)."""
        return self.policy.used

    def lookup(self, url: str) -> Path | None:
        key = self.key(url)
        with self._lock:
            if self.policy.contains(key) or key in self.scratch:
                if self.path(url).is_file():
                    self.hits += 1
                    return self.path(url)
                self.policy.forget(key)  # removed behind our back
                self.scratch.pop(key, None)
            self.misses += 1
            return None

    def admit(self, url: str, size: int) -> None:
        """Record a file just written at `path(url)` and evict what the policy says."""
        key = self.key(url)
        with self._lock:
            kept, evicted = self.policy.admit(key, size)
            if not kept:
                self.scratch[key] = size
                self.scratch.move_to_end(key)
                while len(self.scratch) > self.scratch_files:
                    evicted.append(self.scratch.popitem(last=False)[0])
            for old in evicted:
                (self.dir / f"{old}.cached").unlink(missing_ok=True)  # open mmaps stay valid (POSIX)
                self.evictions += 1
            self.overflow_bytes = max(0, self.policy.used - self.max_bytes)


class ShardStore:
    """The files of one shard directory at `url`, read in place (local) or via the cache (remote)."""

    def __init__(self, url: str | os.PathLike, *, cache_dir: str | Path | None = None,
                 cache_bytes: int = 50 << 30, cache_policy: str = "lru", workers: int = 8, retries: int = 4, backoff_s: float = 0.5,
                 range_bytes: int = 64 << 20, storage_options: dict[str, Any] | None = None):
        self.url = str(url)
        self.remote = is_url(url) and not self.url.startswith("file://")
        self.retries, self.backoff_s, self.range_bytes = retries, backoff_s, max(1, range_bytes)
        self.cache: ShardCache | None = None
        if self.remote:
            import fsspec.core  # only remote stores need fsspec

            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
            self.cache = ShardCache(cache_dir or DEFAULT_CACHE_DIR, cache_bytes, cache_policy)
            self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kiln-fetch")
            self._range_pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kiln-range")
            self._pending: dict[str, Future] = {}
            # reentrant: a download that finishes before add_done_callback runs its callback
            # (_forget, which takes this lock) at once, in the thread that still holds it
            self._lock = threading.RLock()
        else:
            self.root = self.url[len("file://"):] if self.url.startswith("file://") else self.url
        self._arrays: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return self.url

    # ------------------------------------------------------------------ small files
    def read_text(self, name: str) -> str:
        """A small file (meta.json) read whole, never cached: it says what the shards are."""
        if not self.remote:
            path = Path(self.root) / name
            if not path.is_file():
                raise DataError(f"{self.url} is not a kiln shard directory (no {name})")
            return path.read_text(encoding="utf-8")
        remote = join(self.root, name)
        if not with_retries(f"{join(self.url, name)}: cannot check", lambda: self.fs.exists(remote),
                            self.retries, self.backoff_s):
            raise DataError(f"{self.url} is not a kiln shard directory (no {name})")
        data = with_retries(f"{join(self.url, name)}: cannot read", lambda: self.fs.cat_file(remote),
                            self.retries, self.backoff_s)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{join(self.url, name)}: not UTF-8 text ({e})") from None

    # ------------------------------------------------------------------ shards
    def local_path(self, name: str) -> Path:
        """A local file with the content of `name`: the file itself, or its cached download."""
        if not self.remote:
            return Path(self.root) / name
        url = join(self.url, name)
        cached = self.cache.lookup(url)
        if cached is not None:
            return cached
        return self._fetch_shared(name).result()

    def prefetch(self, names: list[str]) -> None:
        """Start downloading files not yet cached, without waiting for them."""
        if self.remote:
            for name in names:
                if not self.cache.path(join(self.url, name)).is_file():
                    self._fetch_shared(name)

    def _fetch_shared(self, name: str) -> Future:
        """One download per file at a time: a prefetch and a read of the same file share it."""
        with self._lock:
            fut = self._pending.get(name)
            if fut is None:
                fut = self._pool.submit(self._download, name)
                self._pending[name] = fut
                fut.add_done_callback(lambda _f, n=name: self._forget(n))
            return fut

    def _forget(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)

    def _download(self, name: str) -> Path:
        url, remote = join(self.url, name), join(self.root, name)
        size = with_retries(f"{url}: cannot stat", lambda: self.fs.size(remote), self.retries, self.backoff_s)
        if size is None:
            raise DataError(f"{url}: the store does not report a size")
        dest = self.cache.path(url)

        def fetch_range(start: int, end: int) -> bytes:
            data = self.fs.cat_file(remote, start=start, end=end)
            if len(data) != end - start:  # a short read: the object shrank or the connection broke
                raise OSError(f"got {len(data)} of {end - start} bytes")
            return data

        starts = list(range(0, size, self.range_bytes)) or [0]
        with atomic_file(dest, "wb") as f:
            if len(starts) == 1:
                f.write(with_retries(f"{url}: cannot read", lambda: fetch_range(0, size), self.retries,
                                     self.backoff_s))
            else:  # large file: parallel range requests, written in order as they arrive
                futures = [self._range_pool.submit(
                    with_retries, f"{url}: cannot read bytes {s}-{min(s + self.range_bytes, size)}",
                    lambda s=s: fetch_range(s, min(s + self.range_bytes, size)), self.retries, self.backoff_s)
                    for s in starts]
                for fut in futures:
                    f.write(fut.result())
        self.cache.admit(url, size)
        return dest

    def array(self, name: str, expect_len: int | None = None) -> np.ndarray:
        """The .npy file `name` memory-mapped, checked against the length meta.json declares."""
        arr = self._arrays.get(name)
        if arr is not None and (not self.remote or self.cache.lookup(join(self.url, name)) is not None):
            return arr  # remote: the lookup counts the hit and tells the policy the file was used
        where = join(self.url, name) if self.remote else str(Path(self.root) / name)
        for attempt in range(2):  # a cached copy that fails to parse is dropped and fetched once more
            path = self.local_path(name)
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
                break
            except (OSError, ValueError) as e:
                if not self.remote or attempt == 1:
                    raise DataError(f"{where}: cannot read shard: {e}") from None
                path.unlink(missing_ok=True)
        if arr.ndim != 1:
            raise DataError(f"{where}: expected a 1-D array, got shape {arr.shape}")
        if expect_len is not None and arr.shape[0] != expect_len:
            raise DataError(f"{where}: has {arr.shape[0]} entries, meta.json says {expect_len} "
                            f"(a truncated or replaced shard)")
        self._arrays[name] = arr
        return arr

    def close(self) -> None:
        if self.remote:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._range_pool.shutdown(wait=True, cancel_futures=True)


def open_store(url: str | os.PathLike, data_cfg) -> ShardStore:
    """The ShardStore for `url` with the `[data]` cache and fetch settings."""
    return ShardStore(url, cache_dir=data_cfg.cache_dir or None, cache_bytes=int(data_cfg.cache_gb * (1 << 30)),
                      cache_policy=data_cfg.cache_policy,
                      workers=data_cfg.fetch_workers, retries=data_cfg.fetch_retries)


class LazyShard:
    """A 1-D token or offset array of a remote shard, fetched on first access.

    Its length comes from meta.json, so windows can be indexed without downloading anything; a
    slice reads through `ShardStore.array`, which fetches the file (or finds it in the cache).
    A file evicted from the cache is fetched again on its next read.
    """

    def __init__(self, store: ShardStore, name: str, length: int, dtype: np.dtype):
        self.store, self.name, self.dtype = store, name, np.dtype(dtype)
        self.shape = (int(length),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        return self.store.array(self.name, self.shape[0])[key]

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self.store.array(self.name, self.shape[0]))
        return arr.astype(dtype) if dtype is not None else arr

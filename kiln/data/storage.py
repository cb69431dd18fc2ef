"""Shard access through one storage layer: local paths, `s3://` and any fsspec URL.

`ShardStore(url)` serves the files of one shard directory. A local directory is read in place
(the files are memory-mapped, exactly as before). A remote one is cached on disk, at one of two
granularities that `plan` picks once (data.cache_granularity, "auto" by default):

- "shard", when the cache holds the whole dataset: files are copied whole into a bounded cache
  (`ShardCache`) and memory-mapped from there; files larger than `range_bytes` come as parallel
  byte ranges. `prefetch(names)` starts downloads of the shards the sampler needs next.
- "window", when it does not: a miss reads only the bytes of the window asked for (a range
  request; the .npy header is read once per file), and the windows the sampler will need next
  come in parallel (`prefetch_ranges`, fsspec `cat_ranges`). The cache holds single windows
  (`WindowCache`), the unit the shuffled loader reads once per epoch, so CoorDL's static policy
  keeps the same resident windows every epoch; a window the policy does not keep is handed to its
  reader from memory and dropped. Document indexes (.docs.npy, 8 bytes a document) stay whole files.

Every remote read is retried with exponential backoff; when the retries run out the error is a
`DataError` naming the URL of the file (and the byte range, for range reads). A downloaded file
whose size differs from what the store reports is treated as truncated and fetched again.

What is library code and what is ours: fsspec (`fsspec.core.url_to_fs`, `cat_file`, `get_file`,
`size`) does all I/O and protocol handling, s3fs the S3 protocol; the cache accounting, the
eviction order (least recently used, never a file being read right now), retries, the
parallel range split and the window bookkeeping are written here; .npy headers are parsed by
numpy (`np.lib.format.read_magic`, `read_array_header_*`). `drop_page_cache` makes the next read
of local files cold (`os.posix_fadvise`), for the stall analyzers (kiln/train/stall.py,
kiln/data/stall_image.py).
"""

from __future__ import annotations

import io
import itertools
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from kiln.data.cache import ShardCache, WindowCache
from kiln.errors import DataError
from kiln.io import atomic_file

T = TypeVar("T")
GRANULARITIES = ("auto", "shard", "window")
HEADER_MAX = 4096  # bytes read for a .npy header; a longer one is refused (numpy writes 128)
WINDOWS_PER_TASK = 256  # a prefetch task's windows (one cat_ranges call)
MAX_INFLIGHT = 1 << 16  # prefetched windows nobody read (a stopped loader) are dropped beyond this
DEFAULT_CACHE_DIR = Path(os.environ.get("KILN_SHARD_CACHE", Path.home() / ".cache" / "kiln" / "shards"))


def is_url(path: str | os.PathLike) -> bool:
    """True for `proto://...` (s3, gcs, http, memory, file, ...); plain paths are local."""
    return "://" in str(path)


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def with_retries(what: str, fn: Callable[[], T], retries: int, backoff_s: float,
                 failed: BaseException | None = None) -> T:
    """fn() retried `retries` times with exponential backoff; then a DataError naming `what`.
    `failed`: the error of a first attempt made elsewhere (a batched request), which counts."""
    first = 0 if failed is None else 1
    for attempt in range(first, retries + 1):
        if attempt:
            time.sleep(backoff_s * (2 ** (attempt - 1)))
        try:
            return fn()
        except DataError:
            raise
        except Exception as e:  # fsspec backends raise OSError, botocore and aiohttp errors alike
            failed = e
    raise DataError(f"{what}: {type(failed).__name__}: {failed} (after {retries + 1} attempts)") from None


class ShardStore:
    """The files of one shard directory at `url`, read in place (local) or via the cache (remote)."""

    def __init__(self, url: str | os.PathLike, *, cache_dir: str | Path | None = None,
                 cache_bytes: int = 50 << 30, cache_policy: str = "auto", workers: int = 8, retries: int = 4, backoff_s: float = 0.5,
                 range_bytes: int = 64 << 20, storage_options: dict[str, Any] | None = None,
                 granularity: str = "auto", merge_gap: int = 1 << 20):
        if granularity not in GRANULARITIES:
            raise ValueError(f"cache granularity {granularity!r}: expected one of {GRANULARITIES}")
        self.url = str(url)
        self.remote = is_url(url) and not self.url.startswith("file://")
        self.retries, self.backoff_s, self.range_bytes = retries, backoff_s, max(1, range_bytes)
        self.cache_bytes, self.cache_policy, self.granularity = int(cache_bytes), cache_policy, granularity
        self.workers = max(1, workers)
        self.merge_gap = max(0, int(merge_gap))  # window mode: ranges of one file this close share a request
        self.mode = "local" if not self.remote else None  # "shard" or "window" once planned
        self.cache: ShardCache | None = None
        self.windows: WindowCache | None = None
        self._layouts: dict[str, tuple[int, np.dtype]] = {}  # window mode: file -> (data offset, dtype)
        self._inflight: OrderedDict[tuple, Future] = OrderedDict()  # prefetched windows not yet read
        if self.remote:
            import fsspec.core  # only remote stores need fsspec

            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
            # "auto": LRU for whole files (a cache dir shared by datasets must turn over), static for
            # windows (each read once per epoch: the same resident windows hit every epoch)
            self.cache = ShardCache(cache_dir or DEFAULT_CACHE_DIR, cache_bytes,
                                    "lru" if cache_policy == "auto" else cache_policy)
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

    def plan(self, dataset_bytes: int, whole_file_bytes: int, window_bytes: int) -> str:
        """Fix, once, how remote token files are cached: "shard" (whole files) when the cache
        holds `dataset_bytes` or granularity="shard", else "window"; then `whole_file_bytes` (the
        document indexes) of the bound stay for whole files and the rest holds windows of
        `window_bytes`. Later calls return the first answer. Local stores: "local"."""
        if not self.remote:
            return self.mode
        with self._lock:
            if self.mode is None:
                mode = self.granularity
                if mode == "auto":
                    mode = "shard" if self.cache_bytes >= dataset_bytes else "window"
                if mode == "window":
                    files = min(int(whole_file_bytes), self.cache_bytes // 2)
                    self.cache.resize(files)
                    self.windows = WindowCache(self.cache.dir, self.cache_bytes - files, window_bytes,
                                               "static" if self.cache_policy == "auto" else self.cache_policy)
                self.mode = mode
            return self.mode

    def counts(self) -> tuple[int, int]:
        """(hits, misses) of the cache reads so far (windows in window mode, files otherwise)."""
        if not self.remote:
            return 0, 0
        if self.windows is not None:
            return self.windows.hits, self.windows.misses
        return self.cache.hits, self.cache.misses

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

    # ------------------------------------------------------------------ windows (byte ranges)
    def _layout(self, name: str, expect_len: int, dtype: np.dtype) -> tuple[int, np.dtype]:
        """(byte offset of element 0, dtype) of a remote .npy file, from its header, checked
        against meta.json's length and dtype and against the object's size (truncation)."""
        found = self._layouts.get(name)
        if found is not None:
            return found
        url, remote = join(self.url, name), join(self.root, name)
        size = with_retries(f"{url}: cannot stat", lambda: self.fs.size(remote), self.retries, self.backoff_s)
        if size is None:
            raise DataError(f"{url}: the store does not report a size")
        head = with_retries(f"{url}: cannot read bytes 0-{min(size, HEADER_MAX)}",
                            lambda: self.fs.cat_file(remote, start=0, end=min(size, HEADER_MAX)),
                            self.retries, self.backoff_s)
        try:
            fp = io.BytesIO(head)
            version = np.lib.format.read_magic(fp)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy version {version}")
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, found_dtype = read(fp, max_header_size=HEADER_MAX)
        except (OSError, ValueError, SyntaxError, TypeError) as e:
            raise DataError(f"{url}: cannot read shard: {e}") from None
        offset = fp.tell()
        if len(shape) != 1 or found_dtype.hasobject:
            raise DataError(f"{url}: expected a 1-D array of numbers, got shape {shape} dtype {found_dtype}")
        if shape[0] != expect_len or found_dtype != np.dtype(dtype):
            raise DataError(f"{url}: has {shape[0]} entries of {found_dtype}, meta.json says {expect_len} of "
                            f"{np.dtype(dtype)} (a truncated or replaced shard)")
        if size != offset + expect_len * found_dtype.itemsize:
            raise DataError(f"{url}: cannot read shard: {size} bytes, its header says "
                            f"{offset + expect_len * found_dtype.itemsize} (truncated or replaced)")
        self._layouts[name] = (offset, found_dtype)
        return offset, found_dtype

    def _fetch_ranges(self, items: list[tuple[str, int, int, int, np.dtype]]) -> list[bytes]:
        """The bytes of elements [start, stop) of each (name, start, stop, file length, dtype):
        one batched `cat_ranges` call (concurrent requests on async filesystems such as s3fs),
        then each failed or short range retried alone with backoff."""
        paths, starts, ends = [], [], []
        for name, start, stop, n, dtype in items:
            offset, dt = self._layout(name, n, dtype)
            paths.append(join(self.root, name))
            starts.append(offset + start * dt.itemsize)
            ends.append(offset + stop * dt.itemsize)
        from fsspec.utils import merge_offset_ranges  # only remote stores need fsspec

        # Nearby windows of one file become one request (fsspec's merge_offset_ranges): a request
        # costs a round trip, and a gap under merge_gap bytes costs less than one. A merged request
        # stays under 2 x merge_gap, so one slow request holds up few windows.
        m_paths, m_starts, m_ends = merge_offset_ranges(paths, starts, ends, max_gap=self.merge_gap,
                                                        max_block=2 * self.merge_gap if self.merge_gap else None)
        try:
            merged = self.fs.cat_ranges(m_paths, m_starts, m_ends, on_error="return")
        except Exception as e:  # the whole batch failed: every range is retried alone
            merged = [e] * len(m_paths)
        by_path: dict[str, list[tuple[int, int, Any]]] = {}
        for path, a, b, got in zip(m_paths, m_starts, m_ends, merged):
            by_path.setdefault(path, []).append((a, b, got))
        results: list[Any] = []
        for path, a, b in zip(paths, starts, ends):  # each window's bytes out of the request that covers it
            ma, mb, got = next(m for m in by_path[path] if m[0] <= a and b <= m[1])
            if isinstance(got, bytes) and len(got) == mb - ma:
                got = got[a - ma:b - ma]
            elif isinstance(got, bytes):
                got = OSError(f"got {len(got)} of {mb - ma} bytes")  # a short read: retried alone below
            results.append(got)
        out = []
        for (name, *_), remote, a, b, got in zip(items, paths, starts, ends, results):
            if isinstance(got, bytes):
                out.append(got)
                continue
            error = got

            def fetch(remote=remote, a=a, b=b) -> bytes:
                data = self.fs.cat_file(remote, start=a, end=b)
                if len(data) != b - a:  # a short read: the object shrank or the connection broke
                    raise OSError(f"got {len(data)} of {b - a} bytes")
                return data

            out.append(with_retries(f"{join(self.url, name)}: cannot read bytes {a}-{b}", fetch, self.retries,
                                    self.backoff_s, failed=error))
        return out

    def _fetch_into(self, keys: list[tuple], items: list[tuple], futures: list[Future]) -> None:
        """Pool task: fetch windows, offer them to the cache, hand them to their futures."""
        try:
            for key, data, fut in zip(keys, self._fetch_ranges(items), futures):
                self.windows.put(key, data)
                fut.set_result(data)
        except BaseException as e:  # the reader of each window sees the error (naming file and bytes)
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)

    def prefetch_ranges(self, items: list[tuple[str, int, int, int, np.dtype]]) -> None:
        """Start fetching windows (name, start, stop, file length, dtype) not cached or on their
        way, split over the fetch workers; `read_range` picks them up."""
        if self.mode != "window":
            return
        todo: list[tuple] = []
        with self._lock:
            for item in items:
                key = item[:3]
                if key in self._inflight or self.windows.peek(key):
                    continue
                fut: Future = Future()
                self._inflight[key] = fut
                todo.append((key, item, fut))
            while len(self._inflight) > MAX_INFLIGHT:
                self._inflight.popitem(last=False)
        # One task per file (at most WINDOWS_PER_TASK windows), sorted by offset: the windows of a
        # task are the neighbours its requests can merge. Files go in parallel over the pool; the
        # requests of one task go concurrently too on async filesystems (s3fs, gcsfs, http).
        todo.sort(key=lambda t: t[0])
        share = WINDOWS_PER_TASK
        for _, group in itertools.groupby(todo, key=lambda t: t[0][0]):
            group = list(group)
            for i in range(0, len(group), share):
                chunk = group[i:i + share]
                self._pool.submit(self._fetch_into, [c[0] for c in chunk], [c[1] for c in chunk],
                                  [c[2] for c in chunk])

    def read_range(self, name: str, start: int, stop: int, expect_len: int, dtype: np.dtype) -> np.ndarray:
        """Elements [start, stop) of a remote .npy file: from the window cache, a prefetch on its
        way, or one range request now."""
        self._layout(name, expect_len, dtype)  # refuses a truncated or replaced file before any read
        key = (name, start, stop)
        with self._lock:
            fut = self._inflight.pop(key, None)
        if fut is not None:  # fetched for this read (a miss), whether or not the policy kept it
            self.windows.count_miss()
            data = fut.result()
        else:
            data = self.windows.get(key)
            if data is None:
                data = self._fetch_ranges([(name, start, stop, expect_len, dtype)])[0]
                self.windows.put(key, data)
        return np.frombuffer(data, dtype=self._layouts[name][1])

    def close(self) -> None:
        if self.remote:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._range_pool.shutdown(wait=True, cancel_futures=True)
            if self.windows is not None:
                self.windows.close()


def open_store(url: str | os.PathLike, data_cfg) -> ShardStore:
    """The ShardStore for `url` with the `[data]` cache and fetch settings."""
    return ShardStore(url, cache_dir=data_cfg.cache_dir or None, cache_bytes=int(data_cfg.cache_gb * (1 << 30)),
                      cache_policy=data_cfg.cache_policy, granularity=data_cfg.cache_granularity,
                      merge_gap=data_cfg.fetch_merge_kib << 10,
                      workers=data_cfg.fetch_workers, retries=data_cfg.fetch_retries)


class LazyShard:
    """A 1-D token or offset array of a remote shard, fetched on first access.

    Its length comes from meta.json, so windows can be indexed without downloading anything. A
    slice reads through `ShardStore.read_range` when the store caches windows (only those bytes),
    else through `ShardStore.array`, which fetches the whole file (or finds it in the cache).
    A file evicted from the cache is fetched again on its next read.
    """

    def __init__(self, store: ShardStore, name: str, length: int, dtype: np.dtype):
        self.store, self.name, self.dtype = store, name, np.dtype(dtype)
        self.shape = (int(length),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice) and self.store.mode == "window":
            start, stop, step = key.indices(self.shape[0])
            if step == 1:
                return self.store.read_range(self.name, start, max(start, stop), self.shape[0], self.dtype)
        return self.store.array(self.name, self.shape[0])[key]

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self.store.array(self.name, self.shape[0]))
        return arr.astype(dtype) if dtype is not None else arr


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the cached pages of these (clean) files: the next read is cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

"""Image-text pairs from WebDataset-style tar shards, preprocessed in CPU workers or on the device.

A shard is a tar of `KEY.jpg|.jpeg|.png` + `KEY.txt` members (WebDataset's convention: the key is
the member path up to the first dot of its file name). `TarIndex` scans each shard's headers once
(`tarfile`, reading headers and seeking over the data) into a table of (shard, key, byte range of
the image, byte range of the caption); samples are then read by byte range, so an epoch can visit
them in any order and the loader's state is a global position (epoch, samples consumed, seed) as
for token windows (docs/loading.md): resume is exact for any worker count. Remote shards (any
fsspec URL) are read through `ShardStore`, which downloads each tar once into its bounded cache.

Two places to preprocess (NVIDIA DALI's idea, with torch parts):
- mode "cpu": `torch.utils.data.DataLoader` workers read, decode, resize, crop and normalize;
  the main process gets finished float batches.
- mode "device": workers only read raw bytes and tokenize; the main process decodes the batch on
  `device` (`torchvision.io.decode_jpeg(list, device="cuda")`, nvJPEG, batched; PNG decodes on the
  CPU) and runs the same resize/crop/normalize there on the device's tensors.
Both modes call the same `transform` code, so on CPU they give the same pixels.

Decoding and the transform live in kiln/data/image_ops.py (torchvision.io or Pillow, torch ops).
Library code vs ours: `tarfile` parses the tars, DataLoader runs the worker processes and their
prefetching, ShardStore (fsspec) the remote reads; indexing, sampling, retries, skipping and
collation are written here.

Bad input: a truncated tar, an image without caption (or caption without image), an undecodable
image or a non-UTF-8 caption fail with one `DataError` naming the shard and the member's header
offset; reads and decodes are retried with backoff first (a remote shard is fetched again). With
`skip_bad=True` each bad item is logged (`log`) and counted in `skipped` instead, and a batch with
a skipped image is that much smaller.
"""

from __future__ import annotations

import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from kiln.data.image_ops import ImageSpec, decode, decode_batch, pad_captions, transform
from kiln.data.loader import epoch_order
from kiln.data.storage import ShardStore, is_url, join, with_retries
from kiln.errors import DataError, KilnError

IMAGE_EXTS = {"jpg": "jpeg", "jpeg": "jpeg", "png": "png"}
MAX_IMAGE_BYTES = 32 << 20  # a member larger than this is refused, not read
MAX_CAPTION_BYTES = 1 << 20


class Sample(NamedTuple):
    shard: int
    key: str
    image_offset: int  # header offset of the image member (what errors name)
    image_range: tuple[int, int]  # (data offset, size)
    kind: str  # "jpeg" | "png", from the member's extension (decoding goes by the magic bytes)
    caption_range: tuple[int, int]


# ---------------------------------------------------------------------------- index


class TarIndex:
    """The samples of a list of tar shards at `url` (a local directory or fsspec URL)."""

    def __init__(self, url: str | Path, shards: list[str] | None = None, *, store: ShardStore | None = None,
                 skip_bad: bool = False, log: Callable[[str], None] = print):
        self.store = store or ShardStore(url)
        self.url, self.skip_bad, self.log = str(url), skip_bad, log
        self.shards = sorted(shards) if shards is not None else self._list()
        if not self.shards:
            raise DataError(f"{self.url}: no .tar shards")
        self.skipped: list[str] = []  # one line per skipped item
        self.samples: list[Sample] = []
        for i, name in enumerate(self.shards):
            self.samples.extend(self._scan(i, name))
        if not self.samples:
            raise DataError(f"{self.url}: no image-text samples in {len(self.shards)} shard(s)")

    def __len__(self) -> int:
        return len(self.samples)

    def _list(self) -> list[str]:
        if self.store.remote:
            return sorted(p.rsplit("/", 1)[-1] for p in self.store.fs.glob(join(self.store.root, "*.tar")))
        root = Path(self.store.root)
        if not root.is_dir():
            raise DataError(f"{self.url}: not a directory of .tar shards")
        return sorted(p.name for p in root.glob("*.tar"))

    def where(self, shard: int) -> str:
        return join(self.url, self.shards[shard]) if is_url(self.url) else str(Path(self.url) / self.shards[shard])

    def bad(self, message: str) -> None:
        """Raise `message` as a DataError, or log and count it when skipping bad items."""
        if not self.skip_bad:
            raise DataError(message)
        self.skipped.append(message)
        self.log(f"skipped: {message}")

    def _scan(self, shard: int, name: str) -> list[Sample]:
        """Headers of one tar (seeking over the data), grouped into samples by key."""
        where = self.where(shard)
        path = self.store.local_path(name)
        size = path.stat().st_size
        members: dict[str, dict[str, tarfile.TarInfo]] = {}
        last = 0
        try:
            with tarfile.open(path, mode="r:") as tar:
                for m in tar:
                    last = m.offset
                    if m.isdir():
                        continue
                    if m.offset_data + m.size > size:  # tarfile seeks past the end without noticing
                        raise tarfile.ReadError(f"member {m.name!r} needs {m.size} bytes, the file ends first")
                    base = m.name.rsplit("/", 1)[-1]
                    if "." not in base:
                        continue  # not a sample field (WebDataset ignores these too)
                    key = m.name[:len(m.name) - len(base)] + base.split(".", 1)[0]
                    ext = base.split(".", 1)[1].lower()
                    if ext in IMAGE_EXTS or ext == "txt":
                        if not m.isfile():
                            self.bad(f"{where}: member {m.name!r} at offset {m.offset} is not a regular file")
                            continue
                        members.setdefault(key, {})[ext] = m
        except (tarfile.TarError, OSError, EOFError) as e:
            self.bad(f"{where}: truncated or corrupt tar after offset {last} ({e}); "
                     f"{len(members)} keys before it are kept")
        out = []
        for key, fields in members.items():
            images = [(ext, m) for ext, m in fields.items() if ext in IMAGE_EXTS]
            first = min(m.offset for m in fields.values())
            if len(images) != 1 or "txt" not in fields:
                what = "no caption (.txt)" if "txt" not in fields else \
                    "no image (.jpg/.jpeg/.png)" if not images else "more than one image"
                self.bad(f"{where}: sample {key!r} at offset {first} has {what}")
                continue
            ext, img = images[0]
            cap = fields["txt"]
            if img.size > MAX_IMAGE_BYTES or cap.size > MAX_CAPTION_BYTES:
                self.bad(f"{where}: sample {key!r} at offset {first} is too large (image {img.size} bytes, "
                         f"caption {cap.size}; limits {MAX_IMAGE_BYTES}, {MAX_CAPTION_BYTES})")
                continue
            out.append(Sample(shard, key, img.offset, (img.offset_data, img.size), IMAGE_EXTS[ext],
                              (cap.offset_data, cap.size)))
        return out

    def read(self, shard: int, byte_range: tuple[int, int]) -> bytes:
        """Bytes of one member; a short read is an OSError (the caller retries)."""
        path = self.store.local_path(self.shards[shard])
        start, size = byte_range
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"short read: {len(data)} of {size} bytes")
        return data

    def refetch(self, shard: int) -> None:
        """Drop a remote shard's cached copy so the next read downloads it again."""
        if self.store.remote:
            self.store.cache.path(join(self.store.url, self.shards[shard])).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- dataset + loader


class BatchPositions(torch.utils.data.Sampler):
    """Endless (epoch, position after, sample indices) of one dp rank's micro-batches, in the
    order `epoch_order(n, seed, epoch)` (the token loader's sampler); an epoch's ragged tail is
    dropped."""

    def __init__(self, n: int, batch_size: int, seed: int, epoch: int, position: int, dp_rank: int = 0,
                 dp_size: int = 1):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.position, self.dp_rank, self.global_batch = epoch, position, dp_rank, batch_size * dp_size
        if self.global_batch > n:
            raise DataError(f"a global batch of {self.global_batch} samples needs more than the {n} samples")

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        epoch, position = self.epoch, self.position
        order = epoch_order(self.n, self.seed, epoch)
        while True:
            if position + self.global_batch > self.n:
                epoch, position = epoch + 1, 0
                order = epoch_order(self.n, self.seed, epoch)
            idx = order[position:position + self.global_batch]
            position += self.global_batch
            mine = idx[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
            yield epoch, position, mine.tolist()


@dataclass
class ImageTextBatch:
    images: torch.Tensor  # (B, 3, size, size) float32, normalized
    tokens: torch.Tensor  # (B, caption_len) int64, padded with the tokenizer's eos id
    lengths: torch.Tensor  # (B,) caption tokens before padding
    indices: list[int]  # sample index of each row
    epoch: int = 0
    position: int = 0  # global position after this batch
    skipped: list[str] = field(default_factory=list)


class ImageTextDataset(torch.utils.data.Dataset):
    """What one DataLoader worker does with (epoch, position, indices): read, tokenize and - in
    mode "cpu" - decode and transform; in mode "device" it returns the raw bytes instead."""

    def __init__(self, index: TarIndex, tokenizer, spec: ImageSpec, caption_len: int, mode: str, seed: int,
                 retries: int = 2, backoff_s: float = 0.05):
        if mode not in ("cpu", "device"):
            raise KilnError(f"preprocessing mode {mode!r} is not one of cpu, device")
        self.index, self.tokenizer, self.spec, self.caption_len = index, tokenizer, spec, caption_len
        self.mode, self.seed, self.retries, self.backoff_s = mode, seed, retries, backoff_s

    def _read_checked(self, s: Sample, decode_it: bool):
        """(image bytes or decoded tensor, caption text), retried with backoff (refetching a
        remote shard); the final failure names the shard, the key and the member's offset."""
        what = f"{self.index.where(s.shard)}: sample {s.key!r} at offset {s.image_offset}"

        def attempt():
            try:
                data = self.index.read(s.shard, s.image_range)
                caption = self.index.read(s.shard, s.caption_range).decode("utf-8")
                return (decode(data) if decode_it else data), caption
            except Exception:
                self.index.refetch(s.shard)
                raise
        return with_retries(what, attempt, self.retries, self.backoff_s)

    def __getitem__(self, item: tuple[int, int, list[int]]) -> dict:
        epoch, position, indices = item
        images, captions, kept, skipped = [], [], [], []
        for i in indices:
            s = self.index.samples[i]
            try:
                img, caption = self._read_checked(s, decode_it=self.mode == "cpu")
            except DataError as e:
                if not self.index.skip_bad:  # returned, not raised: DataLoader would wrap it in a traceback
                    return {"error": str(e)}
                skipped.append(str(e))
                continue
            images.append(img)
            captions.append(caption)
            kept.append(i)
        tokens, lengths = pad_captions(self.tokenizer.encode_batch(captions), self.caption_len,
                                       self.tokenizer.eos_id)
        out = {"epoch": epoch, "position": position, "indices": kept, "tokens": tokens, "lengths": lengths,
               "skipped": skipped}
        if self.mode == "cpu":
            out["images"] = transform(images, self.spec, self.seed, epoch, kept)
        else:
            out["raw"] = images
        return out


def _as_is(batch: dict) -> dict:
    return batch  # the dataset collates; a module-level function so spawned workers can pickle it


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)  # workers are the parallelism; intra-op threads would oversubscribe


class ImageTextLoader:
    """Batches of `ImageTextBatch` with a resumable global position (`state_dict`).

    `workers` DataLoader processes (0: in the calling thread) prepare `prefetch` batches each
    ahead. mode "cpu" preprocesses in them; mode "device" decodes and transforms on `device` in
    the calling process (`decode_batch` + `transform`). `skipped` counts skipped bad items (the
    index's and the batches'); each is also passed to `log`.
    """

    def __init__(self, index: TarIndex, tokenizer, *, batch_size: int, spec: ImageSpec = ImageSpec(),
                 caption_len: int = 32, mode: str = "cpu", device: str | torch.device = "cpu", workers: int = 0,
                 prefetch: int = 2, seed: int = 0, dp_rank: int = 0, dp_size: int = 1, retries: int = 2,
                 backoff_s: float = 0.05, log: Callable[[str], None] = print):
        if batch_size < 1 or caption_len < 1 or workers < 0 or prefetch < 1 or retries < 0:
            raise KilnError(f"image-text loader: batch_size={batch_size}, caption_len={caption_len}, prefetch="
                            f"{prefetch} must be >= 1 and workers={workers}, retries={retries} >= 0")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise KilnError("image preprocessing on device 'cuda' asked, but torch sees no CUDA device")
        self.index, self.batch_size, self.spec, self.mode, self.log = index, batch_size, spec, mode, log
        self.dataset = ImageTextDataset(index, tokenizer, spec, caption_len, mode, seed, retries, backoff_s)
        self.workers, self.prefetch = workers, prefetch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.epoch, self.position = 0, 0
        self.skipped = len(index.skipped)
        self.wait_s = self.device_s = 0.0  # blocked on the workers / decoding on the device (stall analyzer)
        self._it: Iterator | None = None
        BatchPositions(len(index), batch_size, seed, 0, 0, dp_rank, dp_size)  # validate the batch size now

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self.dataset.seed = self.seed

    def _start(self) -> Iterator:
        sampler = BatchPositions(len(self.index), self.batch_size, self.seed, self.epoch, self.position,
                                 self.dp_rank, self.dp_size)
        kw = {"prefetch_factor": self.prefetch, "worker_init_fn": _worker_init} if self.workers else {}
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, sampler=sampler,
                                             num_workers=self.workers, collate_fn=_as_is,
                                             pin_memory=self.device.type == "cuda" and self.mode == "cpu", **kw)
        return iter(loader)

    def next(self) -> ImageTextBatch:
        if self._it is None:
            self._it = self._start()
        t0 = time.perf_counter()
        out = next(self._it)
        self.wait_s += time.perf_counter() - t0
        if "error" in out:
            self.close()
            raise DataError(out["error"])
        for line in out["skipped"]:
            self.log(f"skipped: {line}")
        self.skipped += len(out["skipped"])
        if self.mode == "cpu":
            images = out["images"].to(self.device, non_blocking=True)
        else:
            t0 = time.perf_counter()
            images = self._device_images(out)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the decode is done, not just queued
            self.device_s += time.perf_counter() - t0
        self.epoch, self.position = out["epoch"], out["position"]
        return ImageTextBatch(images, out["tokens"].to(self.device), out["lengths"].to(self.device), out["indices"],
                              out["epoch"], out["position"], out["skipped"])

    def _device_images(self, out: dict) -> torch.Tensor:
        """Decode on the device in one batch. When the batch fails, each image is read and decoded
        again on its own (with retries) so the bad one is named - or skipped, its row dropped."""
        try:
            decoded = decode_batch(out["raw"], self.device)
        except KilnError:
            raise
        except Exception:  # noqa: BLE001 - a decoder failure is bad input, found below
            decoded, good = [], []
            for row, i in enumerate(out["indices"]):
                s = self.index.samples[i]
                what = f"{self.index.where(s.shard)}: sample {s.key!r} at offset {s.image_offset}"
                def attempt(s=s):
                    try:
                        return decode_batch([self.index.read(s.shard, s.image_range)], self.device)[0]
                    except Exception:
                        self.index.refetch(s.shard)  # as in the workers: a remote shard is fetched again
                        raise
                try:
                    decoded.append(with_retries(what, attempt, self.dataset.retries, self.dataset.backoff_s))
                    good.append(row)
                except DataError as e:
                    if not self.index.skip_bad:
                        raise
                    self.log(f"skipped: {e}")
                    out["skipped"].append(str(e))
                    self.skipped += 1
            out["tokens"], out["lengths"] = out["tokens"][good], out["lengths"][good]
            out["indices"] = [out["indices"][r] for r in good]
        return transform(decoded, self.spec, self.seed, out["epoch"], out["indices"])

    def __iter__(self) -> Iterator[ImageTextBatch]:
        while True:
            yield self.next()

    def close(self) -> None:
        """Stop the workers now (an exception's traceback may keep the iterator alive for a while)."""
        shutdown = getattr(self._it, "_shutdown_workers", None)  # DataLoader's own (private) shutdown
        if shutdown is not None:
            shutdown()
        self._it = None

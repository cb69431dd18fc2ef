"""A tiny image-text sample in WebDataset-style tar shards, generated (tests, benchmarks, demos).

`write_sample_shards(out_dir, n, shards)` writes `n` pairs - smooth random pictures of varying size
(gradients plus a coloured rectangle, so JPEG sizes are realistic), about one in three PNG and the
rest JPEG, each with a caption naming its colour and shape - as `sample-00000.tar`, ... Each tar
holds `KEY.jpg|.png` and `KEY.txt` with KEY = `%08d` of the global sample number. Encoding is
Pillow's; the tar layout is `tarfile`'s; files land through `kiln.io.atomic_file`.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

from kiln.io import atomic_file

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "purple": (140, 50, 170), "orange": (240, 140, 30)}
PLACES = ("on a grey field", "at the top", "near the corner", "in the middle", "against the sky")


def sample_picture(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, str]:
    """(H, W, 3) uint8 picture and its caption."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(40, 200, size=3)
    slope = rng.uniform(-1, 1, size=(2, 3)) * 80
    img = base + (yy[..., None] / height) * slope[0] + (xx[..., None] / width) * slope[1]
    colour = str(rng.choice(list(COLOURS)))
    top, left = int(rng.integers(0, height // 2)), int(rng.integers(0, width // 2))
    bottom, right = top + int(rng.integers(height // 4, height // 2 + 1)), left + int(rng.integers(width // 4, width // 2 + 1))
    img[top:bottom, left:right] = COLOURS[colour]
    img += rng.normal(0, 4, size=img.shape)
    shape = "square" if abs((bottom - top) - (right - left)) <= 2 else "rectangle"
    return np.clip(img, 0, 255).astype(np.uint8), f"a {colour} {shape} {rng.choice(PLACES)}"


def encode_picture(img: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG" if fmt == "jpg" else "PNG", **({"quality": 90} if fmt == "jpg" else {}))
    return buf.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_sample_shards(out_dir: str | Path, n: int = 64, shards: int = 4, *, seed: int = 0, min_side: int = 24,
                        max_side: int = 64, png_every: int = 3) -> list[Path]:
    """Write `n` image-caption pairs into `shards` tars under `out_dir`; the tar paths."""
    if n < 1 or shards < 1 or shards > n or not 1 <= min_side <= max_side:
        raise ValueError(f"write_sample_shards: need 1 <= shards={shards} <= n={n} and 1 <= min_side <= max_side")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, n, shards + 1).round().astype(int)
    paths = []
    for s in range(shards):
        path = out_dir / f"sample-{s:05d}.tar"
        with atomic_file(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(bounds[s], bounds[s + 1]):
                h, w = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
                img, caption = sample_picture(rng, h, w)
                fmt = "png" if png_every and i % png_every == png_every - 1 else "jpg"
                add_member(tar, f"{i:08d}.{fmt}", encode_picture(img, fmt))
                add_member(tar, f"{i:08d}.txt", caption.encode("utf-8"))
        paths.append(path)
    return paths

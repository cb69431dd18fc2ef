"""Decode and transform images for kiln/data/image_text.py: the same code on the CPU (in DataLoader
workers) and on the device (in the training process).

Library code vs ours: decoding is `torchvision.io` (libjpeg-turbo/libpng; `decode_jpeg(list,
device="cuda")` is nvJPEG, batched) when torchvision imports, else Pillow (a CUDA-linked
torchvision wheel cannot load next to a CPU torch, so CPU-only machines may lack it). Resize is
`torch.nn.functional.interpolate(mode="bilinear", antialias=True)` - the kernel torchvision's
`transforms.v2.functional.resize` calls for tensors - crop is indexing and normalize arithmetic,
so the transform is identical with or without torchvision. Crop placement, the size limits and
caption padding are ours.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import KilnError

MAX_PIXELS = 1 << 26  # a decoded image larger than this (64 Mpx) is refused: decompression bombs


@functools.lru_cache(maxsize=1)  # probe once: Python retries a failed import on every call
def torchvision_io():
    """`torchvision.io`, or None where torchvision is missing or cannot load (a CUDA-linked wheel
    next to a CPU torch fails at import with a RuntimeError, not an ImportError)."""
    try:
        import torchvision.io

        return torchvision.io
    except Exception:  # noqa: BLE001 - any failure to load means: decode with Pillow
        return None


def image_format(data: bytes) -> str:
    """"jpeg" or "png" from the magic bytes (not the member's name); anything else is refused, so
    only these two decoders ever see untrusted bytes (Pillow and torchvision read more formats)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    raise ValueError(f"not a JPEG or PNG image (starts with {data[:8].hex()})")


def decode(data: bytes) -> torch.Tensor:
    """(3, H, W) uint8 RGB from JPEG/PNG bytes, on the CPU."""
    image_format(data)
    tvio = torchvision_io()
    if tvio is not None:
        img = tvio.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tvio.ImageReadMode.RGB)
    else:
        from PIL import Image

        try:
            im = Image.open(io.BytesIO(data))  # lazy: the size is known before decoding
        except Image.UnidentifiedImageError:
            raise ValueError("not a JPEG or PNG image Pillow can identify") from None
        with im:
            if im.width * im.height > MAX_PIXELS:
                raise ValueError(f"{im.width}x{im.height} pixels exceed the limit of {MAX_PIXELS}")
            img = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
    if img.shape[1] * img.shape[2] > MAX_PIXELS:
        raise ValueError(f"{img.shape[2]}x{img.shape[1]} pixels exceed the limit of {MAX_PIXELS}")
    return img


def decode_batch(datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """Decode a batch for the device path: JPEGs in one `decode_jpeg(list, device=...)` call (nvJPEG
    on CUDA), the rest one by one on the CPU and moved; raises on the first bad image."""
    tvio = torchvision_io()
    if device.type == "cuda" and tvio is None:
        raise KilnError("device preprocessing on cuda needs torchvision (pip install 'kiln-lm[image]' matching "
                        "your torch)")
    if device.type != "cuda" or tvio is None:
        return [decode(d).to(device) for d in datas]
    kinds = [image_format(d) for d in datas]
    jpegs = [i for i, k in enumerate(kinds) if k == "jpeg"]
    out: list[torch.Tensor | None] = [None] * len(datas)
    if jpegs:
        raw = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in jpegs]
        for i, img in zip(jpegs, tvio.decode_jpeg(raw, mode=tvio.ImageReadMode.RGB, device=device)):
            out[i] = img
    for i, k in enumerate(kinds):
        if k != "jpeg":
            out[i] = decode(datas[i]).to(device, non_blocking=True)
    return out


@dataclass(frozen=True)
class ImageSpec:
    """Resize the shorter side to `resize` (default size * 8/7, as ImageNet eval), crop `size`
    square (center, or random per sample from (seed, epoch, index)), normalize by mean/std."""

    size: int = 224
    resize: int = 0
    crop: str = "center"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def __post_init__(self):
        if self.size < 1 or self.resize < 0 or (self.resize and self.resize < self.size):
            raise KilnError(f"image size={self.size}, resize={self.resize}: expected size >= 1 and resize 0 "
                            f"(automatic) or >= size")
        if self.crop not in ("center", "random"):
            raise KilnError(f"image crop={self.crop!r} is not one of center, random")

    @property
    def shorter(self) -> int:
        return self.resize or max(self.size, round(self.size * 8 / 7))


def crop_origin(spec: ImageSpec, h: int, w: int, seed: int, epoch: int, index: int) -> tuple[int, int]:
    """Top-left corner of the crop of an (h, w) image after resizing (deterministic per sample)."""
    if spec.crop == "center":
        return (h - spec.size) // 2, (w - spec.size) // 2
    rng = np.random.default_rng([seed, epoch, index])
    return int(rng.integers(0, h - spec.size + 1)), int(rng.integers(0, w - spec.size + 1))


def transform(images: list[torch.Tensor], spec: ImageSpec, seed: int, epoch: int,
              indices: list[int]) -> torch.Tensor:
    """(B, 3, size, size) float32 on the images' device: resize (shorter side), crop, normalize."""
    out = []
    for img, index in zip(images, indices):
        h, w = img.shape[-2:]
        scale = spec.shorter / min(h, w)
        nh, nw = max(spec.size, round(h * scale)), max(spec.size, round(w * scale))
        x = F.interpolate(img[None].float(), size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255)  # back to uint8 values, as resizing a uint8 image does
        top, left = crop_origin(spec, nh, nw, seed, epoch, index)
        out.append(x[0, :, top:top + spec.size, left:left + spec.size])
    if not out:
        return torch.empty(0, 3, spec.size, spec.size)
    batch = torch.stack(out).div_(255.0)
    mean = torch.tensor(spec.mean, device=batch.device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, device=batch.device).view(1, 3, 1, 1)
    return batch.sub_(mean).div_(std)


def pad_captions(token_lists: list[np.ndarray], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, length) int64 tokens, truncated or padded with pad_id, and (B,) lengths before padding."""
    tokens = torch.full((len(token_lists), length), pad_id, dtype=torch.int64)
    lengths = torch.zeros(len(token_lists), dtype=torch.int64)
    for row, ids in enumerate(token_lists):
        n = min(length, len(ids))
        tokens[row, :n] = torch.as_tensor(np.asarray(ids[:n], dtype=np.int64))
        lengths[row] = n
    return tokens, lengths

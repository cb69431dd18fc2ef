"""Process facts for metrics: memory in use."""

from __future__ import annotations

import psutil
import torch


def memory_mb(device: torch.device) -> float:
    """CUDA max allocated on GPU; resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def resolve_dtype(name: str, device: torch.device) -> str:
    """`auto` -> bf16 where the hardware computes it natively, else fp32."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"

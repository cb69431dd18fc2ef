"""Peak FLOP/s for MFU: a configured number, a table of known GPUs, or a CPU matmul probe.

On CPU there is no datasheet number that holds for every machine, so kiln measures one: the best
of several large square matmuls in the training dtype (bf16 autocast -> bf16 matmuls). MFU on CPU
therefore means "fraction of what this machine's matmul kernel reaches", which is the ceiling a
training step can approach.
"""

from __future__ import annotations

import time

import torch

# Dense bf16/fp16 tensor-core peaks (no sparsity), FLOP/s; fp32 uses TF32 where the GPU has it.
GPU_PEAKS_BF16 = {
    "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "H800": 989e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12, "B200": 2250e12,
    "MI300X": 1307e12, "MI250X": 383e12,
}


def gpu_peak(name: str) -> float | None:
    for key in sorted(GPU_PEAKS_BF16, key=len, reverse=True):  # most specific name first
        if key in name:
            return GPU_PEAKS_BF16[key]
    return None


def cpu_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1536, seconds: float = 1.0) -> float:
    gen = torch.Generator().manual_seed(0)  # never touch the global RNG: resume must stay exact
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    for _ in range(3):
        a @ b  # warm up the kernel and the caches
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype_name: str, configured: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number came from)."""
    if configured > 0:
        return configured, "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name)
        if peak is not None:
            return (peak if dtype_name != "fp32" else peak / 2), f"table:{name}"
        return gpu_matmul_probe(device, dtype_name), f"probe:{name}"
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    # Cache blocking favours some sizes; the best of a few keeps MFU from flattering us.
    sizes = (1024, 2048) if dtype == torch.float32 else (256, 512)
    return max(cpu_matmul_peak(dtype, n=n, seconds=0.6) for n in sizes), f"probe:cpu-{dtype_name}"


def gpu_matmul_probe(device: torch.device, dtype_name: str, n: int = 8192) -> float:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name, torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t0)

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


def compute_dtype(name: str) -> torch.dtype:
    """The dtype matmuls run in for a resolved `train.dtype`."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)


def resolve_fused_projections(value: bool | str, device: torch.device, fsdp: bool) -> bool:
    """`auto` -> q/k/v (and w1/w3) as one GEMM on CUDA unless FSDP shards the weights. Measured on
    one H100 (benchmarks/README.md, "One GPU"): 1.13x the step at GPT-2 124M shapes with the
    default (gated) architecture, 1.02x with GPT-2's, equal at Llama-1B, for 0.4-1.3 GiB more
    peak memory. Under FSDP the concatenated weight autograd keeps for backward would outlive the
    reshard after forward (a layer's unsharded input weights each, for the whole backward); on
    CPU fused is neither faster nor slower and costs that copy too."""
    if value != "auto":
        return bool(value)
    return device.type == "cuda" and not fsdp


def resolve_loss(name: str, device: torch.device, whole_model_compiled: bool = False, tp: int = 1) -> str:
    """`auto` -> the chunked LM head + loss on CUDA unless the whole model (head and loss included)
    is compiled: there inductor fuses the cross-entropy itself and the plain loss measured 2%
    faster at GPT-2 124M shapes on an H200 (benchmarks/README.md, "One GPU"); eager or per-block
    compiled, chunking keeps the fp32 logits (2.5 GB at 124M shapes) out of GPU memory. CPU: the
    plain loss (no GPU memory to save, and one matmul beats many small ones). Tensor parallel:
    the full loss on vocab-sharded logits ("parallel"), or the vocab-parallel chunked one if asked."""
    if tp > 1:  # vocab-sharded logits under loss_parallel, or chunks of them (kiln/model/loss.py)
        return "chunked" if name == "chunked" else "parallel"
    if name != "auto":
        return name
    return "chunked" if device.type == "cuda" and not whole_model_compiled else "full"

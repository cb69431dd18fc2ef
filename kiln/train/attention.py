"""Which scaled-dot-product-attention kernel a run uses, chosen and checked once at startup.

`F.scaled_dot_product_attention` picks a kernel per call (flash, cuDNN, memory-efficient, math)
from the shapes, dtype and flags. A silent fall to the math kernel costs a large factor on a
GPU, so kiln asks torch's own dispatcher (`torch._fused_sdp_choice`, what SDPA itself calls)
with the run's real shapes, logs the answer, and, for grouped-query attention where only the
expanded-heads call gets the fast kernel, repeats K/V heads instead. `train.attention_backend`
restricts SDPA to one kernel; one that cannot run these shapes is a one-line ConfigError.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.errors import ConfigError

BACKENDS = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3}
_NAMES = {v: k for k, v in BACKENDS.items()}
_FAST = ("flash", "cudnn")


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, dropout: float, enable_gqa: bool) -> str:
    try:  # private, but it is the dispatcher SDPA calls; absent or changed -> "unknown"
        choice = int(torch._fused_sdp_choice(q, k, k, dropout_p=dropout, is_causal=True, enable_gqa=enable_gqa))
    except (AttributeError, TypeError, RuntimeError):
        return "unknown"
    return _NAMES.get(choice, f"backend-{choice}")


def _restrict(name: str) -> None:
    """Allow only one SDPA kernel for the rest of the process (torch's global switches)."""
    b = torch.backends.cuda
    b.enable_flash_sdp(name == "flash")
    b.enable_mem_efficient_sdp(name == "efficient")
    b.enable_math_sdp(name == "math")
    if hasattr(b, "enable_cudnn_sdp"):
        b.enable_cudnn_sdp(name == "cudnn")


def configure_attention(model: nn.Module, requested: str, device: torch.device, dtype: torch.dtype,
                        batch: int, seq_len: int) -> dict[str, object]:
    """Pick the kernel for `model`'s attention shapes; returns what the run row records."""
    cfg = model.cfg
    heads, kv_heads = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    head_dim = cfg.attention_head_dim()
    if requested != "auto":
        if device.type != "cuda":
            raise ConfigError(f"train.attention_backend={requested!r} selects a CUDA kernel; use 'auto' on {device.type}")
        _restrict(requested)
    shape = dict(device=device, dtype=dtype)
    q = torch.empty(batch, heads, seq_len, head_dim, **shape)
    k = torch.empty(batch, kv_heads, seq_len, head_dim, **shape)
    gqa = kv_heads != heads
    backend = sdpa_choice(q, k, cfg.dropout, gqa)
    expand = False
    if gqa and backend not in _FAST:
        # The fused kernels of some torch versions take no enable_gqa; expanded heads they do.
        expanded = sdpa_choice(q, torch.empty_like(q), cfg.dropout, False)
        if expanded in _FAST:
            backend, expand = expanded, True
    if requested != "auto" and backend != requested:
        raise ConfigError(f"train.attention_backend={requested!r} cannot run these shapes (head_dim {head_dim}, "
                          f"{dtype}, dropout {cfg.dropout}) on this device; use 'auto'")
    for module in model.modules():
        if hasattr(module, "expand_kv"):
            module.expand_kv = expand
    return {"attention_backend": backend, "attention_expand_kv": expand}

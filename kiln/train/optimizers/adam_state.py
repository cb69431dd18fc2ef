"""The Adam-style state both LAMB and Muon's AdamW part keep, laid out like torch.optim.AdamW."""

from __future__ import annotations

from typing import Any

import torch

try:  # private in torch; the fallback is its list as of torch 2.6-2.13
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
except ImportError:  # pragma: no cover - depends on the torch version
    def _get_fused_kernels_supported_devices() -> list[str]:
        return ["mps", "cuda", "xpu", "hpu", "cpu"]


def fused_adam_supported(params: list[torch.Tensor], device_type: str | None = None) -> bool:
    """Whether torch's fused Adam/AdamW kernels can step these params (on `device_type` too, if given)."""
    supported = _get_fused_kernels_supported_devices()
    return (device_type is None or device_type in supported) and all(
        p.device.type in supported and torch.is_floating_point(p) for p in params)


def adam_state_lists(optimizer: torch.optim.Optimizer, group: dict[str, Any], who: str):
    """(params, grads, exp_avgs, exp_avg_sqs, steps) of a group's params that have gradients.

    State is created on first use: the two moments zeros like the parameter, and `step` a float32
    0-d tensor on the parameter's device, as torch's fused Adam keeps it (a tensor, so DCP saves it
    as state; on the device, so a step never reads it on the host and a skipped step can leave it
    unchanged there). A step loaded onto the CPU (torch's load_state_dict keeps it where it was
    saved; kiln's optimizers kept it on the CPU before they could skip a step on the device) moves
    to the device on first use.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{who} does not support sparse gradients")
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps

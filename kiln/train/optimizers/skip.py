"""Skipping a non-finite step on the device, for kiln's own optimizers.

kiln's optimizers speak torch's `found_inf` protocol, the one `torch.amp.GradScaler` and torch's
fused Adam/AdamW/SGD use: a class that sets `_step_supports_amp_scaling = True` has its step()
called with `optimizer.found_inf` (a 0-d device tensor, non-zero when the gradients are not
finite) and `optimizer.grad_scale` set as attributes; the step then leaves parameters and state
untouched when found_inf is non-zero, without the host ever reading it.

How a kiln step masks itself (kiln's code; torch has no public helper for this): when the step is
skipped, (1) the gradients are made exactly zero in place (`zero_if_skipped_`: nan_to_num_ then a
multiply by 0, so NaN and inf cannot leak; train_step drops them next), (2) the factors that
update the state in place become their identity (`unless_skipped`: a decay of 1, an interpolation
weight of 0: `m * 1 + 0` is m), and (3) the parameter update becomes exactly 0 (computed from
zeroed inputs, or multiplied by 0 once finite). When the step is not skipped each of these
multiplies by exactly 1 or uses the same float32 factor the plain step uses, so the result is bit
for bit the plain step's (on CPU; tests/train/test_step.py). The cost is two cheap passes over the
gradients (and one over LAMB's and Muon's update). Computing new values and selecting them with
`torch.where(skip, old, new)` instead needs a new tensor per state tensor and was much slower on
CPU, whose `where` kernel is not vectorized (benchmarks/README.md, "Optimizer step").

One caveat of (2): a state element that is exactly -0.0 can come back as +0.0 (equal as numbers).
Factors are float32 tensors, exact for float32 state only: `supports_device_skip` says whether an
optimizer's parameters qualify (others keep the host check in kiln.train.step.step_unless).
train_step hands `found_inf` over only where the parameters are off the CPU: on the CPU its host
check is free and this mask is not (kiln.train.step.skips_on_device).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def supports_device_skip(params: Iterable[torch.Tensor]) -> bool:
    """True when every parameter is float32 (the factors below are float32: exact for it)."""
    return all(p.dtype == torch.float32 for p in params)


def skip_flag(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The device bool "skip this step" from the optimizer's `found_inf`, or None when none was given.

    GradScaler passes the scale as `grad_scale` unless its `unscale_` already ran (kiln's
    train_step always calls it first); kiln's optimizers do not unscale themselves.
    """
    if getattr(optimizer, "grad_scale", None) is not None:
        raise RuntimeError(f"{type(optimizer).__name__} does not unscale gradients: call "
                           "GradScaler.unscale_(optimizer) before GradScaler.step(optimizer)")
    found_inf = getattr(optimizer, "found_inf", None)
    return None if found_inf is None else found_inf != 0  # the scaler sums per-device flags


def unless_skipped(skip: torch.Tensor | None, value: float, identity: float) -> float | torch.Tensor:
    """`value` as the plain step uses it (a Python float) when nothing can be skipped, else a 0-d
    float32 device tensor: `identity` when `skip`, else `value`."""
    if skip is None:
        return value
    return torch.where(skip, identity, value).to(torch.float32)


def zero_if_skipped_(skip: torch.Tensor | None, tensors: list[torch.Tensor]) -> None:
    """In place: every element exactly 0 when `skip`, unchanged otherwise (finite values only are
    unchanged: a non-finite one becomes finite, which only a skipped step should produce)."""
    if skip is None or not tensors:
        return
    for t in tensors:
        t.nan_to_num_()
    torch._foreach_mul_(tensors, (~skip).to(torch.float32))

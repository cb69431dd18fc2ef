"""Skipping a non-finite step on the device, for kiln's own optimizers.

kiln's optimizers speak torch's `found_inf` protocol, the one `torch.amp.GradScaler` and torch's
fused Adam/AdamW/SGD use: a class that sets `_step_supports_amp_scaling = True` has its step()
called with `optimizer.found_inf` (a 0-d device tensor, non-zero when the gradients are not
finite) and `optimizer.grad_scale` set as attributes; the step then leaves parameters and state
untouched when found_inf is non-zero, without the host ever reading it.

How a kiln step masks itself (kiln's code; torch has no public helper for it): each tensor the step
would overwrite (a parameter, a moment, a step count) gets its new value computed into a fresh
tensor, then `torch.where(skip, old, new, out=old)` writes it back. `where` selects; it computes
nothing from the discarded value, so a skipped step leaves every bit of the old one (NaN or inf in
the new value cannot leak), and a step that is not skipped writes exactly what the unmasked step
would. Without found_inf (a plain `optimizer.step()`), `updated` works in place and `commit_`
does nothing, so that path costs what it did before masking existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


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


def updated(skip: torch.Tensor | None, in_place: Callable, out_of_place: Callable,
            targets, *args, **kwargs):
    """`targets` after one update: modified in place when nothing can be skipped (skip is None), else
    new tensors (`out_of_place(targets, ...)`) for `commit_` to write back.

    Works for a list of tensors with a torch._foreach_* pair, or a single tensor with e.g.
    (torch.Tensor.lerp_, torch.lerp).
    """
    if skip is None:
        in_place(targets, *args, **kwargs)
        return targets
    return out_of_place(targets, *args, **kwargs)


def commit_(skip: torch.Tensor | None, targets: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
    """targets[i] <- new[i], unless `skip`; a no-op when skip is None (`updated` then worked in place)."""
    if skip is None:
        return
    for target, value in zip(targets, new, strict=True):
        if target is not value:
            torch.where(skip, target, value, out=target)

"""Tensor lists cut to what one foreach op takes.

A foreach op takes plain tensors, or DTensors of one mesh and placements: torch raises on a mix
("got mixed torch.Tensor and DTensor"). One param group holds both where expert parallelism meets
DDP (the dense parameters plain, the experts DTensors on the ep mesh) and DTensors of several
meshes where it meets tp (the dense ones on tp's, the experts on ep's). kiln's foreach optimizers
(Lion, LAMB) update each layout's tensors apart; their updates are per element or per tensor, so
the cut changes no value.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def by_layout(*lists: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], ...]]:
    """The lists (parallel: position i of each belongs together) cut by the layout of the first
    list's tensors; the lists themselves when they share one."""
    positions: dict[object, list[int]] = {}
    for i, t in enumerate(lists[0]):
        key = (id(t.device_mesh), tuple(t.placements)) if isinstance(t, DTensor) else None
        positions.setdefault(key, []).append(i)
    if len(positions) <= 1:
        yield lists
        return
    for at in positions.values():
        yield tuple([lst[i] for i in at] for lst in lists)

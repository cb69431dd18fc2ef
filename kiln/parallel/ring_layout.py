"""Which ranks' K/V a context-parallel rank needs, in plain Python, so that kiln plan
(kiln/plan/timing.py) counts the messages with the very rule ring attention runs
(kiln/parallel/ring_attention.py). kiln's own."""

from __future__ import annotations


def window_hops(cp: int, chunk: int, window: int) -> int | None:
    """How far along the ring, either way, the keys a sliding `window` reaches can be held, for
    zig-zag slices of `chunk`-token chunks: a query chunk attends to key chunks up to
    ceil((window - 1) / chunk) chunks back, and two chunks d apart are held by ranks at most d
    apart (rank r holds chunks r and 2 cp - 1 - r). None where the full ring is no dearer than
    that neighbourhood: no window, or 2 hops + 1 >= cp ranks."""
    if not window or cp == 1:
        return None
    hops = -(-(window - 1) // chunk)
    return hops if 2 * hops < cp else None


def ring_messages(cp: int, hops: int | None) -> int:
    """Blocks one rank sends per attention layer, forward and backward: K/V once round the ring
    (cp - 1) forward and again backward, with the dK/dV accumulators travelling along (cp, the
    last shift home); in a window's neighbourhood K/V go `hops` steps both ways forward and
    backward, and each block's dK/dV share goes straight home (2 hops)."""
    if cp == 1:
        return 0
    return 3 * cp - 2 if hops is None else 6 * hops

"""Checkpoint interval from the save cost and the cluster's mean time between failures.

`young_daly_interval` is the one place of this formula (the checkpoint engine's
`checkpoint.every = "auto"` calls it too). Young 1974: T = sqrt(2 * delta * M); Daly 2006
(eq. 37, "A higher order estimate of the optimum checkpoint interval"):
T = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta for delta < 2M, else M.
"""

from __future__ import annotations

import math

from kiln.errors import KilnError


def young_daly_interval(save_seconds: float, mtbf_seconds: float, *, method: str = "daly") -> float:
    """Seconds of work between checkpoints that minimise expected lost time, for a checkpoint
    that takes `save_seconds` (delta) and a job-wide MTBF of `mtbf_seconds` (M)."""
    if not (math.isfinite(save_seconds) and save_seconds > 0):
        raise KilnError(f"checkpoint save time {save_seconds} s must be a positive number")
    if not (math.isfinite(mtbf_seconds) and mtbf_seconds > 0):
        raise KilnError(f"mean time between failures {mtbf_seconds} s must be a positive number")
    young = math.sqrt(2 * save_seconds * mtbf_seconds)
    if method == "young":
        return young
    if method != "daly":
        raise KilnError(f"checkpoint interval method {method!r}: expected young or daly")
    if save_seconds >= 2 * mtbf_seconds:
        return mtbf_seconds
    r = save_seconds / (2 * mtbf_seconds)
    return young * (1 + math.sqrt(r) / 3 + r / 9) - save_seconds


def interval_steps(save_seconds: float, mtbf_seconds: float, step_seconds: float) -> int:
    """The interval in optimizer steps (at least 1)."""
    if not (math.isfinite(step_seconds) and step_seconds > 0):
        raise KilnError(f"step time {step_seconds} s must be a positive number")
    return max(1, round(young_daly_interval(save_seconds, mtbf_seconds) / step_seconds))

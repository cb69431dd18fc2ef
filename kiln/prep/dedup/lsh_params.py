"""LSH banding math: the S-curve P(candidate | Jaccard s) = 1 - (1 - s^r)^b and a (b, r) chooser.

With b bands of r rows, two documents become candidates when all r MinHash values of at least
one band agree. The chooser minimizes the weighted area of false positives (the S-curve below
the threshold) plus false negatives (one minus it above), over all b * r <= num_perm -- the same
criterion as datasketch's `_optimal_param`, computed here by vectorized numerical integration.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import ConfigError


def candidate_probability(s: np.ndarray | float, bands: int, rows: int) -> np.ndarray:
    """P(two documents with Jaccard s share at least one band bucket)."""
    s = np.asarray(s, dtype=np.float64)
    return 1.0 - (1.0 - s**rows) ** bands


def s_curve(bands: int, rows: int, points: np.ndarray | None = None) -> list[tuple[float, float]]:
    """(similarity, candidate probability) at s = 0.5, 0.55, ..., 1.0 (or the given points)."""
    if points is None:
        points = np.round(np.arange(0.5, 1.0001, 0.05), 2)
    return [(float(s), float(p)) for s, p in zip(points, candidate_probability(points, bands, rows))]


def format_s_curve(bands: int, rows: int, threshold: float | None = None) -> str:
    """A printable table of the S-curve, e.g. for `kiln prep` logs and the docs."""
    head = f"MinHash LSH: {bands} bands x {rows} rows"
    if threshold is not None:
        head += f" (threshold {threshold:g}; curve midpoint ~{(1 / bands) ** (1 / rows):.3f})"
    lines = [head, "  jaccard  P(candidate)"]
    lines += [f"  {s:7.2f}  {p:12.4f}" for s, p in s_curve(bands, rows)]
    return "\n".join(lines)


def lsh_error_areas(threshold: float, bands: np.ndarray, rows: np.ndarray,
                    grid: int = 201) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive area below threshold, false-negative area above) for each (b, r) pair."""
    below = np.linspace(0.0, threshold, grid)
    above = np.linspace(threshold, 1.0, grid)
    b, r = bands[:, None].astype(np.float64), rows[:, None].astype(np.float64)
    fp = np.trapezoid(1.0 - (1.0 - below[None, :] ** r) ** b, below, axis=1)
    fn = np.trapezoid((1.0 - above[None, :] ** r) ** b, above, axis=1)
    return fp, fn


def optimal_bands_rows(threshold: float, num_perm: int, fp_weight: float = 0.5,
                       fn_weight: float = 0.5) -> tuple[int, int]:
    """The (bands, rows) with b * r <= num_perm minimizing fp_weight*FP + fn_weight*FN areas."""
    if not 0.0 < threshold < 1.0:
        raise ConfigError(f"dedup threshold={threshold} must be in (0, 1)")
    if num_perm < 2:
        raise ConfigError(f"dedup num_perm={num_perm} must be >= 2")
    pairs = [(b, r) for b in range(1, num_perm + 1) for r in range(1, num_perm // b + 1)]
    bands = np.array([p[0] for p in pairs])
    rows = np.array([p[1] for p in pairs])
    fp, fn = lsh_error_areas(threshold, bands, rows)
    best = int(np.argmin(fp_weight * fp + fn_weight * fn))
    return int(bands[best]), int(rows[best])

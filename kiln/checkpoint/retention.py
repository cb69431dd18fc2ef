"""Which checkpoint directories exist, which are complete, and which retention keeps.

Retention keeps the newest `keep_last` complete checkpoints plus every one whose step is a
multiple of `keep_every` (0: none), and never the newest complete one. Directories without a
manifest (a stray `step-99/`, a damaged copy) are not counted and not deleted here: loading
reports them, and deleting what we cannot identify is not retention's call.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln.checkpoint.manifest import MANIFEST

STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every `step-N` directory, complete or not, sorted by step."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps whose directory has a manifest (written last, so the save finished), sorted."""
    return [step for step, path in list_checkpoints(ckpt_dir) if (path / MANIFEST).is_file()]


def retained(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    steps = sorted(steps)
    keep = set(steps[-max(keep_last, 1):])  # the newest is always kept
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def to_prune(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    keep = retained(steps, keep_last, keep_every)
    return [s for s in sorted(steps) if s not in keep]

"""Exact deduplication by normalized-content hash: whole documents, paragraphs or lines.

Content is normalized (case-folded, whitespace collapsed: `hashing.normalize_text`) and hashed
with xxh3-128, so the chance that two different texts collide is ~n^2 / 2^129 -- nil for any
corpus. The first occurrence is kept. In memory a Python set costs ~100 bytes per distinct unit;
the pipeline step keeps 16 bytes per unit on disk and a sorted numpy array in `prepare`, or a
Bloom filter (`bloom`) for a fixed memory budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kiln.prep.dedup.hashing import normalize_text, xxh128
from kiln.errors import ConfigError

UNITS = ("document", "paragraph", "line")
_PARAGRAPH_BREAK = re.compile(r"(\n[ \t\r\f\v]*\n\s*)")  # a blank line (kept as the separator)


@dataclass
class ExactConfig:
    unit: str = "document"  # document | paragraph | line
    # paragraph/line units whose normalized text is shorter than this are never removed (blank
    # lines, "}" or "---" repeat everywhere and carry no duplicated content)
    min_unit_chars: int = 16

    def validate(self, where: str = "exact") -> None:
        if self.unit not in UNITS:
            raise ConfigError(f"{where}.unit={self.unit!r} is not one of {', '.join(UNITS)}")
        if self.min_unit_chars < 0:
            raise ConfigError(f"{where}.min_unit_chars={self.min_unit_chars} must be >= 0")


def split_units(text: str, unit: str) -> list[str]:
    """Pieces whose concatenation is `text`: even indices are units, odd ones separators."""
    if unit == "document":
        return [text]
    if unit == "paragraph":
        return _PARAGRAPH_BREAK.split(text)
    parts: list[str] = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        parts += [body, line[len(body):]]
    return parts or [""]


def content_hash(text: str) -> int:
    """128-bit hash of the normalized text."""
    return xxh128(normalize_text(text))


def unit_hashes(text: str, config: ExactConfig) -> tuple[list[str], list[int | None]]:
    """(pieces, hash of each unit piece or None where the piece is exempt or a separator)."""
    pieces = split_units(text, config.unit)
    hashes: list[int | None] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            hashes.append(None)
            continue
        norm = normalize_text(piece)
        exempt = config.unit != "document" and len(norm) < config.min_unit_chars
        hashes.append(None if exempt else xxh128(norm))
    return pieces, hashes


def join_kept(pieces: list[str], keep: list[bool]) -> str:
    """Text from the kept unit pieces; a removed unit takes its following separator with it."""
    out: list[str] = []
    for i in range(0, len(pieces), 2):
        if keep[i // 2]:
            out.append(pieces[i])
            if i + 1 < len(pieces):
                out.append(pieces[i + 1])
    return "".join(out)


class ExactDeduper:
    """Streaming exact dedup in one process: remembers every unit hash it has seen."""

    def __init__(self, config: ExactConfig | None = None):
        self.config = config or ExactConfig()
        self.config.validate()
        self.seen: set[int] = set()

    def process(self, text: str) -> tuple[str | None, int]:
        """(text without already-seen units, or None if nothing is left; units removed)."""
        pieces, hashes = unit_hashes(text, self.config)
        keep: list[bool] = []
        removed = 0
        for h in hashes[::2]:
            new = h is None or h not in self.seen
            if h is not None:
                self.seen.add(h)
            keep.append(new)
            removed += not new
        if removed == 0:
            return text, 0
        if self.config.unit == "document":
            return None, 1
        result = join_kept(pieces, keep)
        return (result if result.strip() else None), removed


def split_hash(h: int) -> tuple[int, int]:
    """A 128-bit hash as two uint64 halves (for numpy storage)."""
    return h >> 64, h & 0xFFFFFFFFFFFFFFFF


def first_occurrences(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Boolean mask of entries whose (hi, lo) key did not occur at an earlier index."""
    if not len(hi):
        return np.zeros(0, dtype=bool)
    order = np.lexsort((lo, hi))  # stable: equal keys stay in index order, the earliest first
    h, l = hi[order], lo[order]
    first = np.zeros(len(hi), dtype=bool)
    first[order[np.r_[True, (h[1:] != h[:-1]) | (l[1:] != l[:-1])]]] = True
    return first

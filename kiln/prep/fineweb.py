"""FineWeb's quality filter (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for the
Finest Text Data at Scale", section 3.3 "additional heuristic filters").

Defaults are the published thresholds, as in datatrove's `FineWebQualityFilter`
(src/datatrove/pipeline/filters/fineweb_quality_filter.py): line_punct_thr 0.12,
short_line_thr 0.67 with short_line_length 30, char_duplicates_ratio 0.01, new_line_ratio 0.3.
Written here (not imported from datatrove, which would pull its whole dependency tree). Lines are
the non-blank `\\n`-separated lines, not stripped, as in the reference; words are whitespace tokens.
Each rule drops with its own reason: `fineweb:line_punct_ratio`, `fineweb:short_line_ratio`,
`fineweb:char_dup_ratio`, `fineweb:list_ratio` (and `fineweb:empty`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config import check_fields, ranged
from kiln.prep.base import Doc, Filter, register

# FineWeb's original stop characters (the paper's "lines ending in punctuation").
FINEWEB_STOP_CHARS = (".", "'", '"', "!", "?")


@dataclass
class FineWebQualityConfig:
    # drop if fewer than 12% of lines end with a stop character
    line_punct_thr: float = ranged(0.12, ge=0.0, le=1.0)
    line_punct_exclude_zero: bool = False  # True: a document with no such line at all is kept
    stop_chars: list[str] = field(default_factory=lambda: list(FINEWEB_STOP_CHARS))
    # drop if more than 67% of lines have at most 30 characters
    short_line_thr: float = ranged(0.67, ge=0.0, le=1.0)
    short_line_length: int = ranged(30, ge=0)
    # drop if characters in repeated lines (after the first occurrence) exceed 1% of the text
    char_duplicates_ratio: float = ranged(0.01, ge=0.0, le=1.0)
    # drop if newlines per word exceed 0.3 (list-like documents)
    new_line_ratio: float = ranged(0.3, ge=0.0)

    def validate(self, source: str) -> None:
        check_fields(self, "", source)


def duplicated_line_chars(lines: list[str]) -> int:
    """Characters in lines that repeat an earlier line (the first occurrence is not counted)."""
    seen: set[str] = set()
    chars = 0
    for line in lines:
        if line in seen:
            chars += len(line)
        else:
            seen.add(line)
    return chars


@register
class FineWebQuality(Filter):
    """FineWeb's line-punctuation, short-line, duplicated-line-characters and list-like rules."""

    type = "fineweb_quality"
    Config = FineWebQualityConfig

    def reason(self, doc: Doc) -> str | None:
        c = self.config
        lines = [ln for ln in doc.text.split("\n") if ln.strip()]
        if not lines:
            return "fineweb:empty"
        stop = tuple(c.stop_chars)
        ratio = sum(1 for ln in lines if ln.endswith(stop)) / len(lines)
        if ratio < c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero):
            return "fineweb:line_punct_ratio"
        if sum(1 for ln in lines if len(ln) <= c.short_line_length) / len(lines) > c.short_line_thr:
            return "fineweb:short_line_ratio"
        if duplicated_line_chars(lines) / len(doc.text) > c.char_duplicates_ratio:
            return "fineweb:char_dup_ratio"
        words = doc.text.split()
        if doc.text.count("\n") / max(len(words), 1) > c.new_line_ratio:
            return "fineweb:list_ratio"
        return None

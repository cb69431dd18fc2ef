"""Heuristic quality filters in the style of Gopher (Rae et al. 2021, "Scaling Language Models:
Methods, Analysis & Insights from Training Gopher", appendix A.1.1) and C4 (Raffel et al. 2020,
"Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer", section 2.2).

Defaults are the published thresholds. Every drop has a specific reason (`gopher:word_count`,
`gopher_rep:dup_line_frac`, `c4:lorem_ipsum`, ...). Words are whitespace-separated tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from kiln.prep.base import Doc, Filter, Step, StepContext, register

# A whitespace-delimited word without any letter (only digits, punctuation, symbols, "_").
_NO_LETTER_WORD = re.compile(r"(?<!\S)(?:[^\w\s]|[\d_])+(?!\S)")
STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
BULLETS = ("•", "●", "○", "▪", "◦", "‣", "⁃", "-", "*", "·")
ELLIPSES = ("...", "…")


@dataclass
class GopherQualityConfig:
    min_words: int = 50  # Gopher: 50 <= words <= 100,000
    max_words: int = 100_000
    min_mean_word_length: float = 3.0  # Gopher: mean word length in [3, 10] characters
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # Gopher: "#" and ellipsis each < 0.1 per word
    max_bullet_lines_frac: float = 0.9  # Gopher: drop if > 90% of lines start with a bullet
    max_ellipsis_lines_frac: float = 0.3  # Gopher: drop if > 30% of lines end with an ellipsis
    min_alpha_words_frac: float = 0.8  # Gopher: >= 80% of words contain an alphabetic character
    min_stop_words: int = 2  # Gopher: at least two of the, be, to, of, and, that, have, with
    stop_words: list[str] = field(default_factory=lambda: list(STOP_WORDS))


@register
class GopherQuality(Filter):
    """Gopher's quality rules: length, word shape, symbols, bullets/ellipses, alphabetic words, stop words."""

    type = "gopher_quality"
    Config = GopherQualityConfig

    def reason(self, doc: Doc) -> str | None:
        c = self.config
        words = doc.text.split()
        n = len(words)
        if n < c.min_words or n > c.max_words:
            return "gopher:word_count"
        mean_len = sum(map(len, words)) / n
        if not c.min_mean_word_length <= mean_len <= c.max_mean_word_length:
            return "gopher:mean_word_length"
        if doc.text.count("#") / n > c.max_symbol_word_ratio:
            return "gopher:hash_ratio"
        if (doc.text.count("...") + doc.text.count("…")) / n > c.max_symbol_word_ratio:
            return "gopher:ellipsis_ratio"
        lines = [ln.strip() for ln in doc.text.splitlines() if ln.strip()]
        if lines:
            if sum(ln.startswith(BULLETS) for ln in lines) / len(lines) > c.max_bullet_lines_frac:
                return "gopher:bullet_lines"
            if sum(ln.endswith(ELLIPSES) for ln in lines) / len(lines) > c.max_ellipsis_lines_frac:
                return "gopher:ellipsis_lines"
        if (n - len(_NO_LETTER_WORD.findall(doc.text))) / n < c.min_alpha_words_frac:
            return "gopher:alpha_words"
        stop = set(c.stop_words)
        if c.min_stop_words > 0:
            found = 0
            for w in words:
                if w.lower() in stop:
                    found += 1
                    if found >= c.min_stop_words:
                        break
            else:
                return "gopher:stop_words"
        return None


@dataclass
class GopherRepetitionConfig:
    # Gopher table A1: duplicate lines / paragraphs by count and by characters.
    max_dup_line_frac: float = 0.30
    max_dup_para_frac: float = 0.30
    max_dup_line_char_frac: float = 0.20
    max_dup_para_char_frac: float = 0.20
    # Most frequent 2/3/4-gram's share of characters: 0.20, 0.18, 0.16.
    top_ngram_max_frac: list[list[float]] = field(
        default_factory=lambda: [[2, 0.20], [3, 0.18], [4, 0.16]])
    # Share of characters in duplicated 5..10-grams: 0.15, 0.14, 0.13, 0.12, 0.11, 0.10.
    dup_ngram_max_frac: list[list[float]] = field(
        default_factory=lambda: [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11], [10, 0.10]])


def _dup_fractions(parts: list[str]) -> tuple[float, float]:
    """(duplicated items / items, characters in duplicated items / characters); the first
    occurrence of an item is not a duplicate."""
    if not parts:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_count = dup_chars = total_chars = 0
    for p in parts:
        total_chars += len(p)
        if p in seen:
            dup_count += 1
            dup_chars += len(p)
        else:
            seen.add(p)
    return dup_count / len(parts), dup_chars / max(total_chars, 1)


# n-gram statistics run on 64-bit n-gram hashes in numpy: one vectorised pass per n instead of
# a Python loop per word (~10x faster on article-sized documents). A hash collision (odds ~N^2/2^64)
# could only merge two distinct n-grams.
_MULT = np.uint64(0x9E3779B97F4A7C15)


def word_arrays(words: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(per-word hashes as uint64, word lengths)."""
    hashes = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    return hashes, lengths


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash of the n-gram starting at each position (len(words) - n + 1 values)."""
    h = word_hashes.copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            h = h[:-1] * _MULT + word_hashes[k:]
    return h


def top_ngram_char_frac(words: list[str], n: int, arrays: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Characters covered by the most frequent n-gram (counting every occurrence) / all word characters."""
    if len(words) < n:
        return 0.0
    hashes, lengths = arrays or word_arrays(words)
    grams = ngram_hashes(hashes, n)
    uniq, first, counts = np.unique(grams, return_index=True, return_counts=True)
    best = int(np.argmax(counts))
    if counts[best] < 2:
        return 0.0
    start = int(first[best])
    return float(lengths[start:start + n].sum()) * int(counts[best]) / max(int(lengths.sum()), 1)


def dup_ngram_char_frac(words: list[str], n: int, arrays: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Characters of words inside any repeated occurrence of an n-gram / all word characters."""
    if len(words) < n:
        return 0.0
    hashes, lengths = arrays or word_arrays(words)
    grams = ngram_hashes(hashes, n)
    _, first = np.unique(grams, return_index=True)  # index of each n-gram's first occurrence
    repeat = np.ones(grams.size, dtype=np.int64)
    repeat[first] = 0
    # Word j is covered when a repeated n-gram starts in [j-n+1, j]: a windowed sum of starts.
    starts = np.concatenate([[0], np.cumsum(np.concatenate([repeat, np.zeros(n - 1, dtype=np.int64)]))])
    idx = np.arange(len(words))
    covered = (starts[idx + 1] - starts[np.maximum(idx - n + 1, 0)]) > 0
    return float(lengths[covered].sum()) / max(int(lengths.sum()), 1)


@register
class GopherRepetition(Filter):
    """Gopher's repetition rules: duplicated lines/paragraphs and repeated n-grams."""

    type = "gopher_repetition"
    Config = GopherRepetitionConfig

    def reason(self, doc: Doc) -> str | None:
        c = self.config
        text = doc.text
        paras = [p.strip() for p in re.split(r"\n{2,}", text) if p.strip()]
        frac, chars = _dup_fractions(paras)
        if frac > c.max_dup_para_frac:
            return "gopher_rep:dup_para_frac"
        if chars > c.max_dup_para_char_frac:
            return "gopher_rep:dup_para_char_frac"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        frac, chars = _dup_fractions(lines)
        if frac > c.max_dup_line_frac:
            return "gopher_rep:dup_line_frac"
        if chars > c.max_dup_line_char_frac:
            return "gopher_rep:dup_line_char_frac"
        words = text.split()
        if not words:
            return None
        arrays = word_arrays(words)
        for n, limit in c.top_ngram_max_frac:
            if top_ngram_char_frac(words, int(n), arrays) > limit:
                return f"gopher_rep:top_{int(n)}gram"
        dup_limits = sorted((int(n), limit) for n, limit in c.dup_ngram_max_frac)
        for i, (n, limit) in enumerate(dup_limits):
            frac = dup_ngram_char_frac(words, n, arrays)
            if frac > limit:
                return f"gopher_rep:dup_{n}gram"
            # Words covered by a repeated m-gram (m > n) are covered by repeated n-grams too, so
            # the fraction only falls with n: below every later limit, no later check can fail.
            if all(frac <= later for _, later in dup_limits[i + 1:]):
                break
        return None


# ---------------------------------------------------------------------------- C4

TERMINAL_PUNCT = (".", "!", "?", '"', "'", "”", "’")
POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


@dataclass
class C4Config:
    # Line rules (C4 keeps only lines that pass; the document is dropped if nothing is left).
    require_terminal_punct: bool = True  # C4: keep lines ending in terminal punctuation
    min_words_per_line: int = 3  # C4: keep lines with at least 3 words (0 disables)
    max_word_length: int = 1000  # C4: drop lines with a word longer than 1000 characters
    drop_javascript_lines: bool = True  # C4: drop lines mentioning "javascript"
    drop_policy_lines: bool = True  # C4: drop lines with "terms of use", "cookie policy", ...
    # Document rules.
    min_sentences: int = 5  # C4: drop pages with fewer than 5 sentences (0 disables)
    drop_lorem_ipsum: bool = True  # C4: drop pages containing "lorem ipsum"
    drop_curly_brace: bool = True  # C4: drop pages containing "{" (code)


_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


@register
class C4Filter(Step):
    """C4's rules: cleans lines (a modification, counted as `c4:lines_removed`) and drops pages."""

    type = "c4"
    Config = C4Config

    def _keep_line(self, line: str) -> bool:
        c = self.config
        if c.require_terminal_punct and not line.endswith(TERMINAL_PUNCT):
            return False
        words = line.split()
        if len(words) < c.min_words_per_line:
            return False
        if c.max_word_length and any(len(w) > c.max_word_length for w in words):
            return False
        low = line.lower()
        if c.drop_javascript_lines and "javascript" in low:
            return False
        if c.drop_policy_lines and any(p in low for p in POLICY_PHRASES):
            return False
        return True

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        c = self.config
        for doc in docs:
            low = doc.text.lower()
            if c.drop_lorem_ipsum and "lorem ipsum" in low:
                ctx.drop(self.name, doc, "c4:lorem_ipsum")
                continue
            if c.drop_curly_brace and "{" in doc.text:
                ctx.drop(self.name, doc, "c4:curly_brace")
                continue
            lines = doc.text.splitlines()
            kept = [ln for ln in lines if ln.strip() and self._keep_line(ln.strip())]
            if not kept:
                ctx.drop(self.name, doc, "c4:no_lines_left")
                continue
            text = "\n".join(kept)
            if c.min_sentences and len(_SENTENCE_END.findall(text)) < c.min_sentences:
                ctx.drop(self.name, doc, "c4:too_few_sentences")
                continue
            removed = sum(1 for ln in lines if ln.strip()) - len(kept)
            if removed:
                ctx.modified(self.name, "c4:lines_removed", removed)
                ctx.doc_modified(self.name)
                doc = Doc(doc.id, text, doc.meta)
            yield doc


# ---------------------------------------------------------------------------- C4 bad words


@dataclass
class C4BadWordsConfig:
    # language code -> word list file (one word or phrase per line, UTF-8; '#' lines are comments).
    # kiln ships no list and downloads nothing: point this at the LDNOOBW lists (CC-BY-4.0,
    # github.com/LDNOOBW/List-of-Dirty-Naughty-Obscene-and-Otherwise-Bad-Words), as C4 used.
    words_files: dict[str, str] = field(default_factory=dict)
    language_field: str = "language"  # metadata key set by the `language` step
    default_language: str = "en"  # for documents without that key
    # documents in a language with no list: kept (counted as info `no_list:<lang>`), or dropped
    drop_unlisted_languages: bool = False

    def validate(self, source: str) -> None:
        from kiln.errors import ConfigError

        for lang, path in self.words_files.items():
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{source}: words_files.{lang} must be a file path (a string)")


def load_word_list(path: str, where: str) -> list[str]:
    """The words of one list file; a missing or unreadable file is a ConfigError naming it."""
    from kiln.errors import ConfigError

    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read bad-words list {path!r}: {e}") from None
    words = [ln.strip().lower() for ln in text.splitlines()]
    return [w for w in words if w and not w.startswith("#")]


def bad_words_pattern(words: list[str]) -> re.Pattern:
    """One regex matching any listed word or phrase as whole words (C4: "any word on the list")."""
    alternatives = "|".join(re.escape(w) for w in sorted(set(words), key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)")


@register
class C4BadWords(Step):
    """C4's bad-words rule: drops a document containing any word of its language's list
    (reason `c4_badwords:<lang>`). The lists are user-supplied files, never fetched at run time."""

    type = "c4_badwords"
    Config = C4BadWordsConfig

    def setup(self, ctx: StepContext) -> None:
        from kiln.errors import ConfigError

        if not self.config.words_files:
            raise ConfigError(f"step {self.name!r}: words_files is empty; give e.g. "
                              "words_files = {en = \"path/to/ldnoobw/en\"}")
        self._patterns = {lang: bad_words_pattern(load_word_list(path, f"step {self.name!r} words_files.{lang}"))
                          for lang, path in self.config.words_files.items()}

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        if not hasattr(self, "_patterns"):
            self.setup(ctx)
        c = self.config
        for doc in docs:
            lang = doc.meta.get(c.language_field) or c.default_language
            lang = lang if isinstance(lang, str) else c.default_language
            pattern = self._patterns.get(lang)
            if pattern is None:
                if c.drop_unlisted_languages:
                    ctx.drop(self.name, doc, f"c4_badwords:no_list:{lang}")
                    continue
                ctx.note(self.name, f"no_list:{lang}", 1)
                yield doc
            elif pattern.search(doc.text.lower()):
                ctx.drop(self.name, doc, f"c4_badwords:{lang}")
            else:
                yield doc

"""Offline language identification (`language`), a Unicode script filter (`script`) and a URL
domain block list (`url_blocklist`).

`language` runs py3langid (BSD-3-Clause; a maintained fork of langid.py, Lui & Baldwin 2012) with
the model its wheel ships (97 languages, numpy arrays, no pickle, nothing downloaded). It was
chosen over lingua-language-detector and langdetect by benchmarks/langid.py (figures in
benchmarks/README.md). The classifier is the library's; kiln adds only the keep/score rules.
"""

from __future__ import annotations

import functools
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from typing import Iterator

from kiln.config import check_fields, ranged
from kiln.prep.base import Doc, Filter, Step, StepContext, register
from kiln.errors import ConfigError

# Multi-word script names as they start Unicode character names; everything else is its first word.
_SCRIPT_PREFIXES = {"CJK": "HAN", "HIRAGANA": "HIRAGANA", "KATAKANA": "KATAKANA", "HANGUL": "HANGUL",
                    "FULLWIDTH": "LATIN", "MATHEMATICAL": "SYMBOL"}


@functools.lru_cache(maxsize=65536)
def char_script(ch: str) -> str:
    """Approximate Unicode script of a letter from its character name ('LATIN', 'CYRILLIC', 'HAN', ...)."""
    if ch.isascii():
        return "LATIN"
    name = unicodedata.name(ch, "")
    if not name:
        return "UNKNOWN"
    first = name.split(" ", 1)[0]
    return _SCRIPT_PREFIXES.get(first, first)


def script_counts(text: str) -> Counter:
    """Letters per script. Counts distinct characters first (C speed), then classifies each once."""
    counts: Counter = Counter()
    for ch, n in Counter(text).items():
        if ch.isalpha():
            counts[char_script(ch)] += n
    return counts


@dataclass
class ScriptConfig:
    keep_scripts: list[str] = field(default_factory=lambda: ["LATIN"])  # Unicode script names
    min_fraction: float = 0.5  # of the letters, at least this fraction in keep_scripts
    min_letters: int = 1  # documents with fewer letters are dropped (script:no_letters)


@register
class ScriptFilter(Filter):
    """Keeps documents mostly written in the given scripts; reason `script:<dominant script>`."""

    type = "script"
    Config = ScriptConfig

    def setup(self, ctx: StepContext) -> None:
        self._keep = {s.upper() for s in self.config.keep_scripts}

    def reason(self, doc: Doc) -> str | None:
        if not hasattr(self, "_keep"):  # called directly, without the executor's setup
            self.setup(StepContext())
        counts = script_counts(doc.text)
        total = sum(counts.values())
        if total < max(self.config.min_letters, 1):
            return "script:no_letters"
        kept = sum(n for s, n in counts.items() if s in self._keep)
        if kept / total >= self.config.min_fraction:
            return None
        return f"script:{counts.most_common(1)[0][0].lower()}"


@dataclass
class LanguageConfig:
    keep: list[str] = field(default_factory=lambda: ["en"])  # ISO 639-1 codes; [] = keep all, only label
    # below this probability the document is dropped (`language:low_score`); FineWeb kept
    # English at >= 0.65 (with fastText lid.176, a different model: tune on your data)
    min_score: float = ranged(0.65, ge=0.0, le=1.0)
    min_letters: int = ranged(20, ge=0)  # fewer letters: no detectable language (`language:undetectable`)
    max_chars: int = ranged(20_000, gt=0)  # classify this prefix only (cost grows with length)
    language_field: str = "language"  # metadata keys written on every kept document
    score_field: str = "language_score"

    def validate(self, source: str) -> None:
        check_fields(self, "", source)


@functools.lru_cache(maxsize=1)
def language_identifier():
    """py3langid's identifier with normalised probabilities, loaded once per process (~0.3 s)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of a text, by py3langid."""
    lang, score = language_identifier().classify(text)
    return lang, float(score)


@register
class LanguageStep(Step):
    """Identifies each document's language, stores it (and its probability) in the metadata and
    keeps the languages in `keep`. Drop reasons: `language:<code>` (another language),
    `language:low_score`, `language:undetectable` (too few letters to tell)."""

    type = "language"
    Config = LanguageConfig

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        c = self.config
        keep = {k.lower() for k in c.keep}
        for doc in docs:
            sample = doc.text[: c.max_chars]
            if sum(1 for ch in sample if ch.isalpha()) < max(c.min_letters, 1):
                ctx.drop(self.name, doc, "language:undetectable")
                continue
            lang, score = identify_language(sample)
            if keep and lang not in keep:
                ctx.drop(self.name, doc, f"language:{lang}")
            elif score < c.min_score:
                ctx.drop(self.name, doc, "language:low_score")
            else:
                yield Doc(doc.id, doc.text, {**doc.meta, c.language_field: lang, c.score_field: round(score, 4)})


@dataclass
class UrlBlocklistConfig:
    url_field: str = "url"  # metadata key holding the document's URL
    domains: list[str] = field(default_factory=list)  # blocked domains (subdomains included)
    domains_file: str = ""  # one domain per line; '#' starts a comment
    url_substrings: list[str] = field(default_factory=list)  # blocked if the URL contains one


@register
class UrlBlocklist(Filter):
    """Drops documents whose `meta[url_field]` host is (a subdomain of) a blocked domain.
    Documents without a URL are kept."""

    type = "url_blocklist"
    Config = UrlBlocklistConfig

    def setup(self, ctx: StepContext) -> None:
        domains = {d.strip().lower().lstrip(".") for d in self.config.domains if d.strip()}
        if self.config.domains_file:
            path = Path(self.config.domains_file)
            if not path.is_file():
                raise ConfigError(f"url_blocklist.domains_file {path} not found")
            for line in path.read_text(encoding="utf-8").splitlines():
                line = line.split("#", 1)[0].strip().lower()
                if line:
                    domains.add(line.lstrip("."))
        self._domains = domains
        self._substrings = [s.lower() for s in self.config.url_substrings]

    def reason(self, doc: Doc) -> str | None:
        if not hasattr(self, "_domains"):  # called directly, without the executor's setup
            self.setup(StepContext())
        url = doc.meta.get(self.config.url_field)
        if not isinstance(url, str) or not url:
            return None
        low = url.lower()
        if any(s in low for s in self._substrings):
            return "url:blocked_substring"
        host = (urlsplit(low if "//" in low else "//" + low).hostname or "").rstrip(".")
        parts = host.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in self._domains:
                return "url:blocked_domain"
        return None

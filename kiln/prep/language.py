"""Offline language/script filter (Unicode script proportions) and a URL domain block list."""

from __future__ import annotations

import functools
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kiln.prep.base import Doc, Filter, StepContext, register
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

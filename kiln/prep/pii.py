"""PII redaction: emails, IP addresses, phone numbers, credit cards, IBANs and secrets become
typed placeholders (`<EMAIL>`, `<IP_ADDRESS>`, ...); counts per type go to the report.

Candidates come from regexes and are then checked (Luhn for cards, mod-97 for IBANs, `ipaddress`
for IPs, context words for versions) so ordinary numbers, dates and versions survive.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kiln.prep.base import Doc, Step, StepContext, register

ALL_TYPES = ("PRIVATE_KEY", "SECRET", "EMAIL", "IBAN", "CREDIT_CARD", "IP_ADDRESS", "PHONE_NUMBER")

_PEM = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----", re.S)
_AWS_KEY = re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|AIPA)[0-9A-Z]{16}\b")
_GITHUB = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{60,255})\b")
_AWS_PREFIXES = ("AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "AIPA")
# Cheap searches (literal prefixes, simple classes) that must match before a costly pattern runs.
_SECRET_HINT = re.compile(r"(?:key|secret|token|passw(?:or)?d)(?:[_-]?id)?[\"']?\s*[:=]")
_CARD_HINT = re.compile(r"\d[\d -]{11,}\d")
_IPV6_HINT = re.compile(r"(?:[0-9A-Fa-f]{1,4}:){4}")
_SLACK = re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}\b")
# key = value where key names a credential; the value (group "v") is replaced, the key kept.
_ASSIGNED_SECRET = re.compile(
    r"(?i)\b(?:api[_-]?key|api[_-]?secret|secret[_-]?key|client[_-]?secret|access[_-]?token|auth[_-]?token|"
    r"access[_-]?key(?:[_-]?id)?|aws_secret_access_key|password|passwd|token|secret)\b[\"']?\s*[:=]\s*"
    r"(?P<q>[\"']?)(?P<v>[A-Za-z0-9_\-+/=.~!@#$%^&*]{8,})(?P=q)")
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\w]|\.\d)")  # octets checked in code
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}:){1,7}:?(?::?[0-9A-Fa-f]{1,4}){1,7}(?![\w:])|(?<![\w:])::[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){1,6}(?![\w:])")
# +CC followed by 2-5 digit groups, or national 3-3-4 / (area) 3-4 formats.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}"
    r"|\(\d{2,4}\)[ .-]?\d{3,4}[ .-]\d{3,4}"
    r"|\d{3}([-. ])\d{3}\1\d{4})(?![\w])")
_VERSION_CONTEXT = re.compile(r"(?i)\b(?:v|version|ver\.?|release|build|rev\.?|python|node|oid)\s*[:=]?\s*$")
_IBAN_LENGTHS = {"AL": 28, "AD": 24, "AT": 20, "BE": 16, "BA": 20, "BG": 22, "HR": 21, "CY": 28, "CZ": 24,
                 "DK": 18, "EE": 20, "FI": 18, "FR": 27, "DE": 22, "GI": 23, "GR": 27, "HU": 28, "IS": 26,
                 "IE": 22, "IT": 27, "LV": 21, "LI": 21, "LT": 20, "LU": 20, "MT": 31, "MC": 27, "ME": 22,
                 "NL": 18, "NO": 15, "PL": 28, "PT": 25, "RO": 24, "SM": 27, "RS": 22, "SK": 24, "SI": 19,
                 "ES": 24, "SE": 24, "CH": 21, "GB": 22, "UA": 29, "TR": 26, "SA": 24, "AE": 23, "IL": 23,
                 "BR": 29, "QA": 29, "KW": 30, "JO": 30, "PK": 24, "MU": 30, "LB": 28, "GE": 22, "KZ": 20}


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(candidate: str) -> bool:
    iban = candidate.replace(" ", "")
    if _IBAN_LENGTHS.get(iban[:2]) != len(iban):
        return False
    rearranged = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def card_ok(candidate: str) -> bool:
    digits = re.sub(r"[ -]", "", candidate)
    if not 13 <= len(digits) <= 19 or len(set(digits)) < 2:
        return False
    # Issuer prefixes (Visa, Mastercard, Amex, Discover, JCB, Diners, UnionPay) cut random hits.
    if not re.match(r"4|5[1-5]|2[2-7]|3[47]|3[0689]|6(?:011|5|4[4-9]|2)|35", digits):
        return False
    return luhn_ok(digits)


def _ipv4_ok(m: re.Match) -> bool:
    octets = m.group(0).split(".")
    if any(int(o) > 255 or (len(o) > 1 and o[0] == "0") for o in octets):
        return False
    return not _VERSION_CONTEXT.search(m.string[max(0, m.start() - 12):m.start()])


def _ipv6_ok(candidate: str) -> bool:
    if sum(ch.isdigit() for ch in candidate) == 0 or sum(ch not in ":" for ch in candidate) < 5:
        return False  # 'a::b', 'dead:beef' and clock times are not addresses worth a guess
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


def _phone_ok(candidate: str) -> bool:
    digits = sum(ch.isdigit() for ch in candidate)
    return 8 <= digits <= 15


@dataclass
class PiiConfig:
    types: list[str] = field(default_factory=lambda: list(ALL_TYPES))  # which kinds to redact
    placeholder: str = "<{type}>"  # {type} becomes EMAIL, IP_ADDRESS, ...
    drop_if_more_than: int = 0  # drop documents with more redactions than this (0: never drop)


@register
class PiiRedact(Step):
    """Replaces PII with typed placeholders; counts `pii:<TYPE>` per occurrence."""

    type = "pii"
    Config = PiiConfig

    def setup(self, ctx: StepContext) -> None:
        self._kinds = [k for k in ALL_TYPES if k in {t.upper() for t in self.config.types}]

    def _sub(self, pattern: re.Pattern, text: str, kind: str, counts: dict[str, int],
             check: Callable[[re.Match], bool] | None = None, group: str | None = None) -> str:
        placeholder = self.config.placeholder.format(type=kind)

        def repl(m: re.Match) -> str:
            if check is not None and not check(m):
                return m.group(0)
            counts[kind] = counts.get(kind, 0) + 1
            if group is None:
                return placeholder
            start, end = m.span(group)
            return m.group(0)[: start - m.start()] + placeholder + m.group(0)[end - m.start():]

        return pattern.sub(repl, text)

    def redact(self, text: str) -> tuple[str, dict[str, int]]:
        counts: dict[str, int] = {}
        if not hasattr(self, "_kinds"):  # called directly, without the executor's setup
            self.setup(StepContext())
        kinds = set(self._kinds)
        if "PRIVATE_KEY" in kinds and "PRIVATE KEY-----" in text:
            text = self._sub(_PEM, text, "PRIVATE_KEY", counts)
        if "SECRET" in kinds:
            # Substring guards (C speed) skip regex passes that cannot match.
            if any(p in text for p in _AWS_PREFIXES):
                text = self._sub(_AWS_KEY, text, "SECRET", counts)
            if "gh" in text and ("_" in text):
                text = self._sub(_GITHUB, text, "SECRET", counts)
            if "xox" in text:
                text = self._sub(_SLACK, text, "SECRET", counts)
            if _SECRET_HINT.search(text.lower()):
                text = self._sub(_ASSIGNED_SECRET, text, "SECRET", counts, _looks_like_secret, group="v")
        if "EMAIL" in kinds and "@" in text:
            text = self._sub(_EMAIL, text, "EMAIL", counts)
        if "IBAN" in kinds:
            text = self._sub(_IBAN, text, "IBAN", counts, lambda m: iban_ok(m.group(0)))
        if "CREDIT_CARD" in kinds and _CARD_HINT.search(text):
            text = self._sub(_CARD, text, "CREDIT_CARD", counts, lambda m: card_ok(m.group(0)))
        if "IP_ADDRESS" in kinds:
            text = self._sub(_IPV4, text, "IP_ADDRESS", counts, _ipv4_ok)
            if "::" in text or _IPV6_HINT.search(text):
                text = self._sub(_IPV6, text, "IP_ADDRESS", counts, lambda m: _ipv6_ok(m.group(0)))
        if "PHONE_NUMBER" in kinds:
            text = self._sub(_PHONE, text, "PHONE_NUMBER", counts, lambda m: _phone_ok(m.group(0)))
        return text, counts

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        for doc in docs:
            text, counts = self.redact(doc.text)
            if counts:
                for kind, n in counts.items():
                    ctx.modified(self.name, f"pii:{kind}", n)
                total = sum(counts.values())
                if self.config.drop_if_more_than and total > self.config.drop_if_more_than:
                    ctx.drop(self.name, doc, "pii:too_many")
                    continue
                ctx.doc_modified(self.name)
                doc = Doc(doc.id, text, doc.meta)
            yield doc


def _looks_like_secret(m: re.Match) -> bool:
    """A credential-named key's value is redacted when quoted, or when it looks random
    (letters and digits, >= 16 chars) rather than like code (`password = get_password()`)."""
    value = m.group("v")
    end = m.end()
    if end < len(m.string) and m.string[end] in "(.[":
        return False  # a call or attribute access, i.e. code
    if value.lower() in {"none", "null", "true", "false", "undefined", "changeme", "password", "required"}:
        return False
    if value.startswith("<") or value.startswith("$") or value.startswith("{"):
        return False  # placeholders and template variables
    if m.group("q"):
        return len(value) >= 8 and not re.fullmatch(r"[a-z_]+", value)
    has_digit = any(ch.isdigit() for ch in value)
    has_alpha = any(ch.isalpha() for ch in value)
    identifier = re.fullmatch(r"[A-Za-z_][A-Za-z_]*\d{0,2}", value) is not None
    return len(value) >= 16 and has_digit and has_alpha and not identifier

"""Text normalisation: Unicode normal form, control characters, whitespace."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Iterator

from kiln.prep.base import Doc, Step, StepContext, register

# C0/C1 controls except tab and newline, plus zero-width/BOM characters that only hide differences.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200c\u200d\u2060\ufeff]")
_SPACE_RUN = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")
_TRAILING = re.compile(r"[ \t]+(?=\n)")


@dataclass
class NormalizeConfig:
    unicode_form: str = "NFC"  # NFC | NFKC | NFD | NFKD | "" (leave as is)
    newlines: bool = True  # \r\n and \r -> \n
    remove_control: bool = True  # control and zero-width characters (tab/newline kept)
    collapse_spaces: bool = True  # runs of spaces/tabs/odd Unicode spaces -> one space
    strip_trailing: bool = True  # spaces at line ends
    max_blank_lines: int = 1  # longer runs of blank lines are shortened (-1 keeps them)
    strip: bool = True  # leading/trailing whitespace of the document


@register
class Normalize(Step):
    """Makes equal-looking text equal: counts `normalize:changed` per modified document."""

    type = "normalize"
    Config = NormalizeConfig

    def normalize(self, text: str) -> str:
        c = self.config
        if c.newlines and "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if c.unicode_form and not text.isascii():
            text = unicodedata.normalize(c.unicode_form, text)
        if c.remove_control:
            text = _CONTROL.sub("", text)
        if c.collapse_spaces:
            text = _SPACE_RUN.sub(" ", text)
        if c.strip_trailing:
            text = _TRAILING.sub("", text)
        if c.max_blank_lines >= 0:
            # At most max_blank_lines blank lines: runs of k+2 or more newlines become k+1.
            text = re.sub(r"\n{%d,}" % (c.max_blank_lines + 2), "\n" * (c.max_blank_lines + 1), text)
        if c.strip:
            text = text.strip()
        return text

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        for doc in docs:
            text = self.normalize(doc.text)
            if text != doc.text:
                ctx.doc_modified(self.name)
                ctx.modified(self.name, "normalize:changed")
                doc = Doc(doc.id, text, doc.meta)
            if not text:
                ctx.drop(self.name, doc, "normalize:empty")
                continue
            yield doc

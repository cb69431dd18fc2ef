"""Reading the sequences to measure or forget: JSONL rows `{"text": ...}` (optionally the canary
fields `prefix`, `secret`, `digits` and `heldout`: true for "never seen" reference rows), which
is the format of a run's canaries.jsonl. Errors name the file and line (kiln.eval.jsonl)."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.errors import DataError
from kiln.eval.jsonl import read_jsonl

FIELDS = {"prefix": str, "secret": str, "digits": int, "heldout": bool, "repeats": int}


def read_sequences(path: str | Path, tokenizer, max_tokens: int) -> list[dict]:
    """Rows of `path` as dicts; each text must encode to 2..max_tokens tokens (the context)."""
    out = []
    for row in read_jsonl(path, required={"text": str}, optional=FIELDS):
        data = dict(row.data)
        n = len(tokenizer.encode(data["text"]))
        if n < 2:
            raise DataError(f"{row.where}: text is empty or one token; a sequence needs at least 2 tokens")
        if n > max_tokens:
            raise DataError(f"{row.where}: text is {n} tokens, longer than the model's context of {max_tokens}; "
                            f"split it into shorter sequences")
        if data.get("secret") is not None:
            digits = data.get("digits")
            if not isinstance(digits, int) or not 1 <= digits <= 18 or data.get("prefix") is None \
                    or not re.fullmatch(r"[0-9](-[0-9]){%d}" % (digits - 1), data["secret"]) \
                    or data["text"] != data["prefix"] + data["secret"]:
                raise DataError(f"{row.where}: a canary row needs prefix + secret == text and a secret of "
                                f"'digits' (1..18) digits joined by '-'")
        data["where"] = row.where
        out.append(data)
    return out


def split_heldout(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows to measure/forget, held-out reference rows)."""
    return [r for r in rows if not r.get("heldout")], [r for r in rows if r.get("heldout")]

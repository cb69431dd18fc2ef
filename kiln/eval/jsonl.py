"""A tolerant JSONL reader for eval files whose errors name the file and line.

Tolerant of what editors and exporters leave behind: a UTF-8 byte-order mark, blank lines, `//`
or `#` comment lines, and Windows line endings. Strict about what matters: each remaining line
must be a JSON object with the required fields of the right types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import DataError
from kiln.io import read_text_file


@dataclass
class Row:
    """One JSON object and where it came from (for error messages further down the line)."""

    data: dict[str, Any]
    path: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def read_jsonl(path: str | Path, required: dict[str, type | tuple[type, ...]] | None = None,
               optional: dict[str, type | tuple[type, ...]] | None = None) -> list[Row]:
    """Read every object of a JSONL file, checking `required` and `optional` fields' types.

    Raises `DataError` naming `file:line` for unreadable files, bad JSON, non-objects, missing
    fields or wrong types, and for a file without any rows.
    """
    path = Path(path)
    text = read_text_file(path, error=DataError, missing=f"eval file {path} not found", encoding="utf-8-sig")
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("//", "#")):
            continue
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        _check_fields(obj, required or {}, optional or {}, f"{path}:{number}")
        rows.append(Row(obj, path, number))
    if not rows:
        raise DataError(f"{path}: no rows (expected one JSON object per line)")
    return rows


def _check_fields(obj: dict, required: dict, optional: dict, where: str) -> None:
    for key, types in required.items():
        if key not in obj:
            raise DataError(f"{where}: missing field {key!r}; expected fields {sorted(required)}")
    for key, types in {**required, **optional}.items():
        if key in obj and obj[key] is not None and not isinstance(obj[key], types):
            raise DataError(f"{where}: field {key!r} must be {_type_names(types)}, got "
                            f"{type(obj[key]).__name__}")


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object",
             bool: "true/false"}
    return " or ".join(names.get(t, t.__name__) for t in types)

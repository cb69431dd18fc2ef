"""Raw-text sources for `kiln train`: the built-in corpus, text files, directories and JSONL.

`builtin:stdlib` is the running Python's standard-library sources (tests excluded): ~12 MB of real
text on every machine, read at run time, so the default job needs no download.

Documents come with a stable key (path, or path:line) so the train/validation split is a hash of
the key: it does not depend on reading order or on how much of the corpus is read. A single text
file is one document; it is split by position instead (the last `val_fraction` is validation),
the usual convention for corpora such as tinyshakespeare.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kiln.errors import DataError

BUILTIN_STDLIB = "builtin:stdlib"
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ".jsonl"}
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class Document:
    key: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py")
                  if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])))


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if b"\x00" in data[:8192]:
        raise DataError(f"{path} looks binary (NUL bytes); expected UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 at byte {e.start}; expected UTF-8 text") from None


def _jsonl_docs(path: Path, text_field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string field {text_field!r}")
            yield Document(f"{path}:{lineno}", row[text_field])


def iter_documents(source: str, glob: str = "**/*", text_field: str = "text") -> Iterator[Document]:
    """Documents of a source in a deterministic order; raises DataError for unusable input."""
    if source == BUILTIN_STDLIB:
        root = stdlib_root()
        for path in stdlib_files():
            try:
                yield Document(str(path.relative_to(root)), _read_text(path))
            except DataError:
                continue  # a stray non-UTF-8 file in an installed stdlib is not the user's fault
        return
    path = Path(source)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.glob(glob) if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no text files matching {glob!r} with suffix in {sorted(TEXT_SUFFIXES)}")
    else:
        raise DataError(f"data.source {source!r} not found; expected {BUILTIN_STDLIB}, a text/.jsonl file or a directory")
    for f in files:
        if f.suffix == ".jsonl":
            yield from _jsonl_docs(f, text_field)
        else:
            yield Document(str(f), _read_text(f))


def is_val(key: str, val_fraction: float) -> bool:
    return zlib.crc32(key.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


def split_documents(source: str, val_fraction: float, max_bytes: int = 0, glob: str = "**/*",
                    text_field: str = "text") -> tuple[list[str], list[str]]:
    """Read a source (at most max_bytes of text if > 0) into (train_texts, val_texts)."""
    docs: list[Document] = []
    total = 0
    for doc in iter_documents(source, glob, text_field):
        if not doc.text:
            continue
        if max_bytes and total + len(doc.text) > max_bytes:
            doc = Document(doc.key, doc.text[: max_bytes - total])
        docs.append(doc)
        total += len(doc.text)
        if max_bytes and total >= max_bytes:
            break
    if total == 0:
        raise DataError(f"data.source {source!r} has no text (empty corpus)")
    if len(docs) == 1:  # one document: split by position
        text = docs[0].text
        cut = int(len(text) * (1 - val_fraction))
        return [text[:cut]], [text[cut:]]
    train = [d.text for d in docs if not is_val(d.key, val_fraction)]
    val = [d.text for d in docs if is_val(d.key, val_fraction)]
    if not val:  # tiny corpora: make sure validation is never empty
        val, train = train[-1:], train[:-1]
    if not train:
        raise DataError(f"data.source {source!r}: too few documents to split into train and validation")
    return train, val

"""Raw-text sources for `kiln train`: the built-in corpus, a document file, or a directory of them.

`builtin:stdlib` is the running Python's standard-library sources (tests excluded): ~12 MB of real
text on every machine, read at run time, so the default job needs no download. Files are read with
the readers `kiln prep` uses (kiln/data/documents.py): text, JSONL (plain, .gz, .zst), JSON and
Parquet, suffixes matched case-insensitively.

Documents have a stable id (path relative to the source, or that:line) so the train/validation split
is a hash of the id: it does not depend on reading order, on how much of the corpus is read or on
where the corpus is mounted. A source that is a
single document is split by position instead (the last `val_fraction` is validation), the usual
convention for corpora such as tinyshakespeare.

There is no rejects file on this side, so nothing is dropped quietly: a bad record (line of a
JSONL file), an unreadable file, a file given directly that is not text, and a damaged compressed
file (truncated or corrupt: training on part of a file without saying so is worse than stopping)
are DataErrors naming the file. In a directory, files of other formats, text files that are
binary, not UTF-8 or empty, and .json files whose first record has no string text field (config or
metadata files) are skipped and listed in `ReadReport.summary()`; empty records are counted there.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kiln.data.documents import Doc, ReadOptions, file_format, read_file, supported_suffixes
from kiln.errors import DataError

BUILTIN_STDLIB = "builtin:stdlib"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_SKIPPABLE = {"binary", "not_utf8", "empty"}  # file-level rejects a directory source may skip
_NOT_TEXT_JSON = {"bad_json", "not_object", "missing_text_field"}  # first record of a .json in a directory
_EDGE_BYTES = 1 << 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files outside test and package directories, sorted.

    `os.walk` with pruning, not `rglob`: site-packages may hold far more files than the stdlib."""
    files = []
    for folder, dirs, names in os.walk(stdlib_root()):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


@dataclass
class ReadReport:
    """What reading a source did: files read (by format) and files skipped, with the reason."""

    formats: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    empty_records: int = 0  # JSON/JSONL/Parquet records whose text is empty or blank

    def summary(self, limit: int = 10) -> str:
        n = sum(self.formats.values())
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        line = f"read {n} file{'s' * (n != 1)} ({kinds})"
        if self.skipped:
            shown = ", ".join(f"{name} ({why})" for name, why in self.skipped[:limit])
            more = f" and {len(self.skipped) - limit} more" if len(self.skipped) > limit else ""
            line += f"; skipped {len(self.skipped)}: {shown}{more}"
        if self.empty_records:
            line += f"; {self.empty_records} empty record{'s' * (self.empty_records != 1)} skipped"
        return line


def source_files(source: str, glob: str = "**/*", report: ReadReport | None = None) -> list[tuple[Path, str]]:
    """(path, format) of the files a raw source reads, in a deterministic (sorted) order."""
    report = report if report is not None else ReadReport()
    if source == BUILTIN_STDLIB:
        return [(p, "text") for p in stdlib_files()]
    path = Path(source)
    if path.is_file():  # named explicitly: an unknown suffix is read as text
        return [(path, file_format(path) or "text")]
    if not path.is_dir():
        raise DataError(f"data.source {source!r} not found; expected {BUILTIN_STDLIB}, a document file "
                        f"or a directory")
    files = []
    for p in sorted(p for p in path.glob(glob) if p.is_file()):
        fmt = file_format(p)
        if fmt is None:
            report.skipped.append((str(p.relative_to(path)), "unsupported suffix"))
        else:
            files.append((p, fmt))
    if not files:
        raise DataError(f"{path}: no document files matching {glob!r} (suffixes, any case: "
                        f"{' '.join(supported_suffixes())}, text/JSONL also .gz/.zst)")
    return files


def iter_documents(source: str, glob: str = "**/*", text_field: str = "text",
                   report: ReadReport | None = None) -> Iterator[Doc]:
    """Documents of a source in a deterministic order; raises DataError for unusable input."""
    report = report if report is not None else ReadReport()
    files = source_files(source, glob, report)
    opts = ReadOptions(text_field=text_field)
    builtin = source == BUILTIN_STDLIB
    in_dir = builtin or Path(source).is_dir()
    # ids are relative to the source (a directory, or a file's folder) as `kiln prep`'s are: the
    # split is then the same wherever the corpus lives (another mount point on another node)
    root = stdlib_root() if builtin else Path(source) if in_dir else Path(source).parent
    for path, fmt in files:
        name = str(path.relative_to(root))  # the id: it decides the split
        skipped: list[str] = []
        n_docs = 0

        def reject(file: str, line: int | None, reason: str, detail: str, nbytes: int) -> None:
            if skipped:
                return
            if fmt == "json" and in_dir and n_docs == 0 and reason in _NOT_TEXT_JSON:
                skipped.append(f"JSON without a string {text_field!r}")  # config or metadata, not a corpus
            elif reason == "empty" and line is not None:
                report.empty_records += 1
            elif reason == "empty" or builtin:  # a stray undecodable stdlib file is not the user's fault
                skipped.append(reason)
            elif line is None and in_dir and reason in _SKIPPABLE:
                skipped.append(reason.replace("_", "-"))
            else:
                where = f"{path}:{line}" if line is not None else str(path)  # the path one can open
                raise DataError(f"{where}: {detail}")

        for doc in read_file(path, name, fmt, opts, reject):
            if skipped:
                break
            n_docs += 1
            yield doc
        if skipped:
            report.skipped.append((name, skipped[0]))
        else:
            report.formats[fmt] = report.formats.get(fmt, 0) + 1


def is_val(key: str, val_fraction: float) -> bool:
    return zlib.crc32(key.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


@dataclass
class SplitCorpus:
    train: list[Doc]
    val: list[Doc]
    report: ReadReport


def read_corpus(source: str, val_fraction: float, max_bytes: int = 0, glob: str = "**/*",
                text_field: str = "text") -> SplitCorpus:
    """Read a source (at most max_bytes of text if > 0) and split it into train and validation."""
    docs: list[Doc] = []
    total = 0
    report = ReadReport()
    for doc in iter_documents(source, glob, text_field, report):
        if max_bytes and total + len(doc.text) > max_bytes:
            doc = Doc(doc.id, doc.text[: max_bytes - total], doc.meta)
        docs.append(doc)
        total += len(doc.text)
        if max_bytes and total >= max_bytes:
            break
    if total == 0:
        raise DataError(f"data.source {source!r} has no text (empty corpus)")
    if len(docs) == 1:  # one document: split by position
        doc = docs[0]
        cut = int(len(doc.text) * (1 - val_fraction))
        train_part = Doc(doc.id, doc.text[:cut], dict(doc.meta))
        return SplitCorpus([train_part], [Doc(doc.id, doc.text[cut:], dict(doc.meta))], report)
    train = [d for d in docs if not is_val(d.id, val_fraction)]
    val = [d for d in docs if is_val(d.id, val_fraction)]
    if not val:  # tiny corpora: make sure validation is never empty
        val, train = train[-1:], train[:-1]
    if not train:
        raise DataError(f"data.source {source!r}: too few documents to split into train and validation")
    return SplitCorpus(train, val, report)


def split_documents(source: str, val_fraction: float, max_bytes: int = 0, glob: str = "**/*",
                    text_field: str = "text") -> tuple[list[str], list[str]]:
    """Read a source into (train_texts, val_texts); see `read_corpus`."""
    corpus = read_corpus(source, val_fraction, max_bytes, glob, text_field)
    return [d.text for d in corpus.train], [d.text for d in corpus.val]


def files_fingerprint(paths: list[Path]) -> str:
    """A digest of what the files hold: per file its path, size, mtime_ns and a hash of its first
    and last MiB (xxh3-128 from `xxhash` when installed, else hashlib's blake2b).

    Bytes changed in the middle of a file larger than 2 MiB with size and mtime kept are not seen:
    reading every byte of a multi-GB corpus on each start costs more than that case is worth.
    """
    try:
        import xxhash

        new_hash, algo = xxhash.xxh3_128, "xxh3_128"
    except ImportError:
        new_hash, algo = lambda: hashlib.blake2b(digest_size=16), "blake2b"
    digest = hashlib.sha256(algo.encode())
    for path in paths:
        try:
            st = path.stat()
            h = new_hash()
            with open(path, "rb") as f:
                h.update(f.read(_EDGE_BYTES))
                if st.st_size > 2 * _EDGE_BYTES:
                    f.seek(-_EDGE_BYTES, 2)
                h.update(f.read(_EDGE_BYTES))
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{h.hexdigest()}\n".encode())
    return digest.hexdigest()[:16]

"""One line for a failed checkpoint write, naming the OS error rather than torch's wrapper.

A full disk surfaces from DCP as `RuntimeError: [enforce fail at inline_container.cc:...]` with
the `OSError` only in the chain, or as a `CheckpointException` holding per-rank failures; the
user needs "no space left on device (<path>)".
"""

from __future__ import annotations

import os
from pathlib import Path


def _chain(error: BaseException):
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exc, trace)}
        if isinstance(failures, dict):
            stack.extend(pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair)
        stack.extend([e.__cause__, e.__context__])


def describe_write_error(error: BaseException, where: Path) -> str:
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno).lower()} ({e.filename or where})"
    for e in _chain(error):
        text = str(e)
        if "No space left on device" in text:
            return f"no space left on device ({where})"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first} ({where})"

"""User-facing errors, and how a failing rank labels its one-line error.

A `KilnError` is a mistake in what the user gave us (config, paths, data). The CLI prints its
message on one line and exits with status 2, without a traceback. Anything else is a bug in kiln
and keeps its traceback.
"""


class KilnError(Exception):
    """An error caused by user input; the message says what is wrong and what was expected."""


class ConfigError(KilnError):
    """A config key is unknown, ill-typed or out of range."""


class DataError(KilnError):
    """A corpus, shard directory or eval file is missing, empty or malformed."""


class TrainingDiverged(KilnError):
    """Training stopped after too many non-finite steps in a row; the message says what to change."""


def rank_label() -> str:
    """"[rank N] " inside a multi-process launch, "" otherwise: prefixes a failing rank's error line
    (before any ParallelDims exists, e.g. for a config error, so it reads torchrun's RANK itself)."""
    import os

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""

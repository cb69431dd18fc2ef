"""User-facing errors.

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

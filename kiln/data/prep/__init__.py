"""`kiln prep`: raw documents -> filtered, deduplicated, PII-redacted documents -> token shards.

`base` holds the step interface; `readers`/`writers` the I/O; `filters`, `normalize`, `pii` the
steps; `pipeline` the TOML config; `executor` the local and Ray runners; `report` the report.
"""

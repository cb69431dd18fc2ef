"""`kiln prep`: raw documents -> filtered, deduplicated, PII-redacted documents -> token shards.

`base` holds the step interface; `readers`/`writers` the I/O; `quality`, `language`,
`normalize`, `pii` and `dedup/` the steps; `pipeline` the TOML config; `executor` the stages
and `runners` where they run; `report` the report. The training side (`kiln/data/`) shares
only the shard format and the tokenizer with it.
"""

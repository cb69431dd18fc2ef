"""Prep step `canaries`: insert random secret sequences (kiln.privacy.canaries) into the kept
documents, to measure memorization after training (docs/privacy.md).

    [[step]]
    type = "canaries"
    count = 10          # inserted canaries (as many held-out ones are drawn, never inserted)
    repeats = 20        # copies of each
    record = "runs/canaries.jsonl"   # where the record goes; never into the output shards

Put it last: a dedup step after it would drop the copies. All copies go into the first input
shard (so the set is exact however many workers run) at seeded random positions, with ids that
`tokenize.val_fraction` sends to the train split (set `val_fraction` to the same value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kiln.config import check_fields, ranged
from kiln.errors import ConfigError
from kiln.prep.base import Doc, Step, StepContext, register
from kiln.privacy.canaries import canary_docs, interleave, make_canaries, write_record


@dataclass
class CanariesConfig:
    count: int = ranged(10, gt=0, le=10_000)
    repeats: int = ranged(10, gt=0, le=100_000)
    digits: int = ranged(6, ge=1, le=18)
    seed: int = ranged(0, ge=0)
    val_fraction: float = ranged(0.05, ge=0.0, lt=1.0)  # the pipeline's tokenize.val_fraction
    record: str = ""  # path of the canaries.jsonl record (required)

    def validate(self, source: str) -> None:
        check_fields(self, "", source)
        if not self.record:
            raise ConfigError(f"{source}: record is required (the path of the canaries.jsonl record, "
                              f"outside the output directory)")
        if 2 * self.count > 10 ** self.digits:
            raise ConfigError(f"{source}: count={self.count} needs {2 * self.count} distinct secrets; "
                              f"digits={self.digits} allows {10 ** self.digits}")


@register
class Canaries(Step):
    """Adds count x repeats canary documents to the first shard; notes `docs_added`."""

    type = "canaries"
    Config = CanariesConfig

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        if ctx.shard_index != 0:
            yield from docs
            return
        c = self.config
        canaries = make_canaries(c.count, c.repeats, c.digits, c.seed)
        inserted = canary_docs(canaries, c.seed, c.val_fraction)
        write_record(c.record, canaries)
        ctx.note(self.name, "docs_added", len(inserted))  # the executor's accounting allows for these
        # Documents of one shard fit in memory here: the executor hands a step one shard at a time.
        yield from interleave(list(docs), inserted, c.seed)

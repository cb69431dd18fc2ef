"""The step interface of `kiln prep`: documents, steps, global (multi-stage) steps, counters.

A pipeline is a list of steps. Each step is a small class with a dataclass `Config`, a `name`
(defaults to its `type`) and a generator `run(docs, ctx)` that yields the documents it keeps
(possibly modified). A step never has to count what comes in or goes out: the executor wraps
every step and counts `docs_in/bytes_in` and `docs_kept/bytes_kept` itself. A step reports only
what the executor cannot see: why it dropped a document (`ctx.drop(self.name, doc, reason)`) and
what it changed (`ctx.modified(self.name, kind, n)`). After each shard the executor checks
`docs_in == docs_kept + sum(dropped)`, so a step that silently swallows documents is caught.

Counters are plain, JSON-serialisable dicts (`ctx.stats[step_name]`, see `new_stats`), so
executors merge them across shards and workers with `merge_stats`.

Global steps (deduplication) need to see every shard before they can decide about any document;
`GlobalStep` defines the three stages the executors (local processes and Ray alike) run:

1. `index(docs, ctx)`   once per input shard, in parallel: the documents that reach this step
                        in that shard; write what you need (signatures, hashes, text) under
                        `ctx.work_dir`, in files named by `ctx.shard_index`.
2. `prepare(ctx, n)`    once, after every shard is indexed: read the stage-1 files of all `n`
                        shards from `ctx.work_dir`, build the global state (clusters, duplicate
                        spans) and write it to `ctx.work_dir`.
3. `run(docs, ctx)`     once per shard, in parallel, after `setup(ctx)`: the same documents in
                        the same order as stage 1 saw them (the executor stores them in between),
                        so a step may refer to a document by `(ctx.shard_index, position)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from kiln.data.documents import Doc  # the one document type, shared with `kiln train`

# ---------------------------------------------------------------------------- documents


def text_bytes(text: str) -> int:
    """UTF-8 size of a text: what every `bytes_*` counter measures."""
    return len(text.encode("utf-8", errors="surrogatepass"))


# ---------------------------------------------------------------------------- counters


def new_stats() -> dict[str, Any]:
    """Counters of one step. Integers and {key: int} maps are summed when merged."""
    return {
        "docs_in": 0,
        "bytes_in": 0,
        "docs_kept": 0,
        "bytes_kept": 0,
        "dropped": {},  # reason -> documents
        "dropped_bytes": {},  # reason -> bytes
        "modified": {},  # kind (e.g. "pii:EMAIL") -> occurrences changed
        "docs_modified": 0,  # documents whose text a step changed
        "info": {},  # step-specific numbers (e.g. clusters found); numbers are summed
        "examples": {},  # reason -> [{"id", "text"}] the first few dropped documents, truncated
    }


def merge_stats(into: dict[str, dict], other: dict[str, dict], max_examples: int = 3) -> dict[str, dict]:
    """Add the per-step counters `other` into `into` (both {step_name: stats}); returns `into`."""
    for step, theirs in other.items():
        ours = into.setdefault(step, new_stats())
        for key, value in theirs.items():
            if key == "examples":
                for reason, docs in value.items():
                    kept = ours["examples"].setdefault(reason, [])
                    kept.extend(docs[: max(0, max_examples - len(kept))])
            elif isinstance(value, dict):
                target = ours.setdefault(key, {})
                for k, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        target[k] = target.get(k, 0) + v
                    else:
                        target[k] = v
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                ours[key] = ours.get(key, 0) + value
            else:
                ours[key] = value
    return into


@dataclass
class StepContext:
    """What a step sees besides its documents: where it is, where to write, what to count.

    One context per (shard, stage) in a worker; its `stats` are sent back to the driver and
    merged. `work_dir` is the step's private directory, shared by all workers (global steps).
    """

    shard_index: int = 0
    n_shards: int = 1
    shard_name: str = ""
    work_dir: Path | None = None
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_examples: int = 3
    example_chars: int = 400
    # Called for every dropped document (the executor logs ids and reasons to removed/*.jsonl).
    on_drop: Callable[[str, Doc, str], None] | None = None

    def step_stats(self, step: str) -> dict[str, Any]:
        stats = self.stats.get(step)
        if stats is None:
            stats = self.stats[step] = new_stats()
        return stats

    def drop(self, step: str, doc: Doc, reason: str) -> None:
        """Account for a document `step` removes; `reason` is specific, e.g. 'gopher:mean_word_length'."""
        stats = self.step_stats(step)
        stats["dropped"][reason] = stats["dropped"].get(reason, 0) + 1
        stats["dropped_bytes"][reason] = stats["dropped_bytes"].get(reason, 0) + text_bytes(doc.text)
        examples = stats["examples"].setdefault(reason, [])
        if len(examples) < self.max_examples:
            examples.append({"id": doc.id, "text": doc.text[: self.example_chars]})
        if self.on_drop is not None:
            self.on_drop(step, doc, reason)

    def modified(self, step: str, kind: str, count: int = 1) -> None:
        """Record `count` changes of one kind (e.g. 'pii:EMAIL') made by `step`."""
        stats = self.step_stats(step)
        stats["modified"][kind] = stats["modified"].get(kind, 0) + count

    def doc_modified(self, step: str) -> None:
        """Record that `step` changed the text of one document."""
        self.step_stats(step)["docs_modified"] += 1

    def note(self, step: str, key: str, value: int | float) -> None:
        """Add a step-specific number to the report (summed over shards)."""
        info = self.step_stats(step)["info"]
        info[key] = info.get(key, 0) + value


# ---------------------------------------------------------------------------- steps


@dataclass
class NoConfig:
    """Config of a step that has no settings."""


STEP_TYPES: dict[str, type["Step"]] = {}


def register(cls: type["Step"]) -> type["Step"]:
    """Class decorator: make a step usable as `[[step]] type = "<cls.type>"` in a prep TOML."""
    if not cls.type:
        raise TypeError(f"{cls.__name__} has no `type`")
    if not dataclasses.is_dataclass(cls.Config):
        raise TypeError(f"{cls.__name__}.Config must be a dataclass")
    STEP_TYPES[cls.type] = cls
    return cls


class Step:
    """A streaming step: `run` yields the documents it keeps, calling `ctx.drop` for the others.

    Steps are pickled to worker processes (and Ray workers), so keep heavy state out of
    `__init__`; build it in `setup`, which runs once per shard before `run` in the worker.
    """

    type: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any = None, name: str | None = None):
        self.config = config if config is not None else self.Config()
        self.name = name or self.type

    def setup(self, ctx: StepContext) -> None:
        """Prepare per-worker state (compiled regexes, loaded global state). Called per shard."""

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.config!r})"


class Filter(Step):
    """A step that keeps or drops each document on its own: implement `reason`."""

    def reason(self, doc: Doc) -> str | None:
        """None to keep the document, else the specific reason it is dropped."""
        raise NotImplementedError

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        for doc in docs:
            why = self.reason(doc)
            if why is None:
                yield doc
            else:
                ctx.drop(self.name, doc, why)


class GlobalStep(Step):
    """A step that must see all shards before deciding (see the module docstring for the stages).

    Memory: the executor keeps nothing in memory between stages (documents are stored in the
    work directory), so the global state is whatever `prepare` and `setup` load. Subclasses
    state that cost in `state_bytes_per_doc` (e.g. MinHash-LSH: bands x 8-byte keys + an id per
    document); the executor multiplies it by the number of documents indexed and records the
    estimate in the report, and `prepare` should stream from disk where it can.
    """

    state_bytes_per_doc: ClassVar[int] = 0

    def index(self, docs: Iterator[Doc], ctx: StepContext) -> None:
        """Stage 1, per shard: consume `docs`, write this shard's data under `ctx.work_dir`."""
        raise NotImplementedError

    def prepare(self, ctx: StepContext, n_shards: int) -> None:
        """Stage 2, once: combine the stage-1 files of shards 0..n_shards-1 in `ctx.work_dir`."""
        raise NotImplementedError

    def prepare_parts(self, n_shards: int) -> int:
        """Independent pieces of stage 2 the executor may run in parallel before `prepare`
        (e.g. one per LSH band), so that work spreads over workers; 0 = none."""
        return 0

    def prepare_part(self, ctx: StepContext, n_shards: int, part: int, n_parts: int) -> None:
        """One of the `prepare_parts` pieces; writes its result under `ctx.work_dir`."""
        raise TypeError(f"{type(self).__name__} declares prepare_parts() but has no prepare_part()")


def is_global(step: Step) -> bool:
    return isinstance(step, GlobalStep)

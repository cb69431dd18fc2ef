"""The prep pipeline config: `[input]`, `[output]`, `[tokenize]`, `[run]` and `[[step]]` tables.

    [input]
    path = "raw/"
    [[step]]
    type = "gopher_quality"
    min_words = 20
    [[step]]
    type = "pii"

The same pipeline is usable from Python: `PrepConfig(input=ReaderConfig(path=...), steps=[...])`
with step objects. Unknown sections, keys and step types raise a ConfigError naming the key and
the file. Parsing, coercion and range checks are kiln.config's engine; this module keeps only its
section classes and the `[[step]]` lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.config import (MAX_VOCAB, check_fields, fill_dataclass, fill_section, parse_override, ranged, read_toml,
                         set_fields)
from kiln.errors import ConfigError
from kiln.prep.base import STEP_TYPES, Step
from kiln.prep.readers import ReaderConfig
from kiln.prep.writers import DOC_FORMATS

# Modules whose import registers step types; the dedup subpackage is optional in a build.
STEP_MODULES = ("kiln.prep.normalize", "kiln.prep.quality", "kiln.prep.fineweb", "kiln.prep.language",
                "kiln.prep.pii", "kiln.prep.dedup", "kiln.prep.canaries")


@dataclass
class OutputConfig:
    dir: str = "prepped"
    docs_format: str = ranged("jsonl.zst", choices=tuple(DOC_FORMATS))  # kept documents: jsonl | jsonl.zst | parquet
    write_removed: bool = True  # removed.jsonl: id, step and reason of every removed document
    max_examples: int = ranged(5, ge=0)  # example removed documents per reason in the report
    example_chars: int = ranged(400, ge=0)

    def validate(self, source: str) -> None:
        check_fields(self, "output.", source)
        if not self.dir:
            raise ConfigError(f"{source}: output.dir is required")


@dataclass
class TokenizeConfig:
    enabled: bool = True  # write token shards to OUTPUT/tokens for `kiln train`
    tokenizer: str = "bpe"  # bpe (trained on kept documents) | byte | path to a tokenizer.json
    vocab_size: int = ranged(8192, gt=0, le=MAX_VOCAB)  # for bpe
    sample_bytes: int = ranged(50_000_000, gt=0)  # bpe is trained on at most this much kept text
    # a document goes to val when kiln.data.corpus.is_val(id) says so
    val_fraction: float = ranged(0.05, gt=0.0, lt=1.0)
    shard_tokens: int = ranged(64 * 1024 * 1024, gt=0)
    batch_bytes: int = ranged(4 << 20, gt=0)  # text per encode_batch call

    def validate(self, source: str) -> None:
        check_fields(self, "tokenize.", source)
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(f"{source}: tokenize.vocab_size={self.vocab_size} must be > 256 for a bpe tokenizer")


@dataclass
class RunConfig:
    executor: str = ranged("local", choices=("local", "ray"))
    workers: int = ranged(0, ge=0, le=65536)  # parallel shards; 0 = all CPUs
    ray_address: str = ""  # "" starts a local Ray instance; "auto" or host:port joins a cluster
    resume: bool = True  # skip shards a previous run finished (same config)
    progress: str = ranged("auto", choices=("auto", "rich", "none"))
    # warn when the reader rejects more than this share of input records
    max_reject_share: float = ranged(0.5, ge=0.0, le=1.0)

    def validate(self, source: str) -> None:
        check_fields(self, "run.", source)


@dataclass
class PrepConfig:
    input: ReaderConfig = field(default_factory=ReaderConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    run: RunConfig = field(default_factory=RunConfig)
    steps: list[Step] = field(default_factory=list)
    # The [[step]] tables as written, kept for the report and the resume fingerprint.
    step_tables: list[dict[str, Any]] = field(default_factory=list)

    def validate(self, source: str = "<prep config>") -> "PrepConfig":
        self.input.validate(source)
        self.output.validate(source)
        self.tokenize.validate(source)
        self.run.validate(source)
        names = [s.name for s in self.steps]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"{source}: step names must be unique; repeated: {dupes} (set `name` on [[step]])")
        if "read" in names:
            raise ConfigError(f"{source}: step name 'read' is reserved for the reader")
        for step in self.steps:  # catch a bad --set step.X.key=... before any stage runs
            config = getattr(step, "config", None)
            if hasattr(config, "validate"):
                config.validate(f"{source}: step {step.name!r}")
        return self

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (used in the report and to fingerprint a run for resume)."""
        sections = {k: dataclasses.asdict(getattr(self, k)) for k in ("input", "output", "tokenize")}
        steps = [{"type": s.type, "name": s.name, **dataclasses.asdict(s.config)} for s in self.steps]
        return {**sections, "steps": steps}


_IMPORT_ERRORS: dict[str, str] = {}


def load_step_types() -> dict[str, type[Step]]:
    for module in STEP_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            # A step module absent from this build, or one whose optional dependency is missing:
            # pipelines that do not use its steps still run; unknown-type errors mention it.
            if e.name != module:
                _IMPORT_ERRORS[module] = f"{module} could not be imported ({e}); try pip install 'kiln-lm[prep]'"
    return STEP_TYPES


def build_step(table: dict[str, Any], where: str) -> Step:
    """A step from one `[[step]]` table (`type`, optional `name`, then the step's config keys)."""
    types_ = load_step_types()
    table = dict(table)
    kind = table.pop("type", None)
    if kind is None:
        raise ConfigError(f"{where}: missing key 'type'; expected one of {sorted(types_)}")
    if kind not in types_:
        hint = "".join(f"; {msg}" for msg in _IMPORT_ERRORS.values())
        raise ConfigError(f"{where}: unknown step type {kind!r}; expected one of {sorted(types_)}{hint}")
    name = table.pop("name", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"{where}: name must be a string")
    cls = types_[kind]
    config = fill_dataclass(cls.Config, table, f"{where} ({kind})")
    return cls(config, name=name)


SECTIONS = {"input": ReaderConfig, "output": OutputConfig, "tokenize": TokenizeConfig, "run": RunConfig}


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> PrepConfig:
    cfg = PrepConfig()
    for name, values in raw.items():
        if name == "step":
            if not isinstance(values, list):
                raise ConfigError(f"{source}: steps are declared as [[step]] tables")
            for i, table in enumerate(values):
                step = build_step(table, f"{source}: [[step]] #{i + 1}")
                cfg.steps.append(step)
                cfg.step_tables.append(dict(table))
            continue
        fill_section(cfg, name, values, SECTIONS, source, extra=("[[step]]",))
    return cfg


def apply_overrides(cfg: PrepConfig, overrides: list[str]) -> None:
    """`section.key=value` for [input]/[output]/[tokenize]/[run], `step.N.key=value` (N from 1)
    or `step.NAME.key=value` for steps; the value is a TOML literal, else a string."""
    for item in overrides:
        parts, value = parse_override(item, "output.dir=out")
        if parts[0] == "step" and len(parts) == 3:
            step = _find_step(cfg, parts[1], item)
            set_fields(step.config, {parts[2]: value}, f"--set {item!r}")
        elif len(parts) == 2 and parts[0] in SECTIONS:
            set_fields(getattr(cfg, parts[0]), {parts[1]: value}, "--set", f"{parts[0]}.")
        else:
            raise ConfigError(f"--set {item!r}: expected one of {sorted(SECTIONS)}.KEY=VALUE or step.N.KEY=VALUE")


def _find_step(cfg: PrepConfig, ref: str, item: str) -> Step:
    if ref.isdigit() and 1 <= int(ref) <= len(cfg.steps):
        return cfg.steps[int(ref) - 1]
    for step in cfg.steps:
        if step.name == ref:
            return step
    raise ConfigError(f"--set {item!r}: no step {ref!r}; steps are {[s.name for s in cfg.steps]} (or 1..{len(cfg.steps)})")


def load_prep_config(path: str | Path, overrides: list[str] | None = None) -> PrepConfig:
    raw = read_toml(path, "prep config")
    cfg = config_from_dict(raw, str(path))
    apply_overrides(cfg, overrides or [])
    # Relative paths are relative to the current directory, like every other kiln path.
    return cfg.validate(str(path))

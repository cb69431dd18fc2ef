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
the file.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kiln.prep.base import STEP_TYPES, Step
from kiln.prep.readers import ReaderConfig
from kiln.prep.writers import DOC_FORMATS
from kiln.errors import ConfigError

# Modules whose import registers step types; the dedup subpackage is optional in a build.
STEP_MODULES = ("kiln.prep.normalize", "kiln.prep.quality", "kiln.prep.language",
                "kiln.prep.pii", "kiln.prep.dedup")


@dataclass
class OutputConfig:
    dir: str = "prepped"
    docs_format: str = "jsonl.zst"  # kept documents: jsonl | jsonl.zst | parquet
    write_removed: bool = True  # removed.jsonl: id, step and reason of every removed document
    max_examples: int = 5  # example removed documents per reason in the report
    example_chars: int = 400

    def validate(self, source: str) -> None:
        if self.docs_format not in DOC_FORMATS:
            raise ConfigError(f"{source}: output.docs_format={self.docs_format!r} is not one of {', '.join(DOC_FORMATS)}")
        if not self.dir:
            raise ConfigError(f"{source}: output.dir is required")


@dataclass
class TokenizeConfig:
    enabled: bool = True  # write token shards to OUTPUT/tokens for `kiln train`
    tokenizer: str = "bpe"  # bpe (trained on kept documents) | byte | path to a tokenizer.json
    vocab_size: int = 8192  # for bpe
    sample_bytes: int = 50_000_000  # bpe is trained on at most this much kept text
    val_fraction: float = 0.05  # a document goes to val when kiln.data.corpus.is_val(id) says so
    shard_tokens: int = 64 * 1024 * 1024
    batch_bytes: int = 4 << 20  # text per encode_batch call

    def validate(self, source: str) -> None:
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(f"{source}: tokenize.vocab_size={self.vocab_size} must be > 256 for a bpe tokenizer")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"{source}: tokenize.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.sample_bytes <= 0 or self.shard_tokens <= 0 or self.batch_bytes <= 0:
            raise ConfigError(f"{source}: tokenize.sample_bytes, shard_tokens and batch_bytes must be > 0")


@dataclass
class RunConfig:
    executor: str = "local"  # local | ray
    workers: int = 0  # parallel shards; 0 = all CPUs
    ray_address: str = ""  # "" starts a local Ray instance; "auto" or host:port joins a cluster
    resume: bool = True  # skip shards a previous run finished (same config)
    progress: str = "auto"  # auto | rich | none
    max_reject_share: float = 0.5  # warn when the reader rejects more than this share of input records

    def validate(self, source: str) -> None:
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"{source}: run.executor={self.executor!r} is not one of local, ray")
        if self.workers < 0:
            raise ConfigError(f"{source}: run.workers={self.workers} must be >= 0")
        if self.progress not in ("auto", "rich", "none"):
            raise ConfigError(f"{source}: run.progress={self.progress!r} is not one of auto, rich, none")
        if not 0.0 <= self.max_reject_share <= 1.0:
            raise ConfigError(f"{source}: run.max_reject_share={self.max_reject_share} must be in [0, 1]")


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


def fill_dataclass(cls: type, raw: dict[str, Any], where: str) -> Any:
    obj = cls()
    set_fields(obj, raw, where)
    return obj


def set_fields(obj: Any, raw: dict[str, Any], where: str) -> None:
    fields = {f.name for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}; expected one of {sorted(fields)}")
        setattr(obj, key, coerce(value, hints[key], f"{where}: {key}"))


def coerce(value: Any, hint: Any, what: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool, float):
        if type(value) is hint:
            return value
    elif hint is Any:
        return value
    elif origin is list:
        (arg,) = typing.get_args(hint) or (Any,)
        if isinstance(value, (list, tuple)):
            return [coerce(v, arg, what) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(coerce(v, a, what) for v, a in zip(value, args))
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return coerce(value, arg, what)
            except ConfigError:
                continue
    name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    raise ConfigError(f"{what}={value!r} has the wrong type; expected {name}")


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
        if name not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{name}]; expected one of {sorted(SECTIONS) + ['[[step]]']}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys")
        set_fields(getattr(cfg, name), values, f"{source}: [{name}]")
    return cfg


def apply_overrides(cfg: PrepConfig, overrides: list[str]) -> None:
    """`section.key=value` for [input]/[output]/[tokenize]/[run], `step.N.key=value` (N from 1)
    or `step.NAME.key=value` for steps; the value is a TOML literal, else a string."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. output.dir=out")
        dotted, text = (s.strip() for s in item.split("=", 1))
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        parts = dotted.split(".")
        if parts[0] == "step" and len(parts) == 3:
            step = _find_step(cfg, parts[1], item)
            set_fields(step.config, {parts[2]: value}, f"--set {item!r}")
        elif len(parts) == 2 and parts[0] in SECTIONS:
            set_fields(getattr(cfg, parts[0]), {parts[1]: value}, f"--set {item!r}")
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
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prep config {path} not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    cfg = config_from_dict(raw, str(path))
    apply_overrides(cfg, overrides or [])
    # Relative paths are relative to the current directory, like every other kiln path.
    return cfg.validate(str(path))

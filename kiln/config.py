"""Typed job configuration: dataclasses filled from TOML, overridable with `--set section.key=value`.

Every section is a dataclass; unknown keys, wrong types and out-of-range values raise a
`ConfigError` naming the key (and file) and what was expected.
"""

from __future__ import annotations

import dataclasses
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "kiln-small"
    vocab_size: int = 0  # 0: take it from the tokenizer
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (plain multi-head attention); fewer: grouped-query
    ffn_hidden: int = 0  # 0: 4*dim for gelu, 2/3 of that (rounded to multiple_of) for gated units
    multiple_of: int = 64
    max_seq_len: int = 256
    norm: str = "rmsnorm"  # layernorm | rmsnorm | none (none is meant for t_fixup init)
    norm_eps: float = 1e-5
    norm_placement: str = "pre"  # pre | post
    activation: str = "swiglu"  # gelu | swiglu | geglu
    positions: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = 0.0
    init: str = "gpt2"  # normal | gpt2 | ds_init | t_fixup
    init_std: float = 0.02

    def validate(self) -> None:
        _choice("model.norm", self.norm, ("layernorm", "rmsnorm", "none"))
        _choice("model.norm_placement", self.norm_placement, ("pre", "post"))
        _choice("model.activation", self.activation, ("gelu", "swiglu", "geglu"))
        _choice("model.positions", self.positions, ("rope", "learned"))
        _choice("model.init", self.init, ("normal", "gpt2", "ds_init", "t_fixup"))
        for key in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            _positive(f"model.{key}", getattr(self, key))
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={kv}")
        if (self.dim // self.n_heads) % 2 and self.positions == "rope":
            raise ConfigError(f"model.dim/n_heads={self.dim // self.n_heads} must be even for rope positions")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


@dataclass
class DataConfig:
    # builtin:stdlib (this Python's standard library sources), a text/.jsonl file, a directory of
    # such files, or a directory of kiln token shards (one with meta.json).
    source: str = "builtin:stdlib"
    glob: str = "**/*"  # which files of a directory source to read
    text_field: str = "text"  # for .jsonl sources
    max_bytes: int = 8_000_000  # read at most this much raw text (0: all of it)
    tokenizer: str = "bpe"  # bpe | byte | path to a tokenizer.json
    vocab_size: int = 4096  # for tokenizer = "bpe"
    val_fraction: float = 0.05
    seq_len: int = 256
    prefetch: int = 4  # batches prepared ahead by a background thread
    shards_dir: str = ""  # where to write token shards; "" = RUN_DIR/data

    def validate(self) -> None:
        _positive("data.seq_len", self.seq_len)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(f"data.vocab_size={self.vocab_size} must be > 256 for a BPE tokenizer")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes} must be >= 0")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adafactor | lamb | lion | muon | sgd
    lr: float = 3e-3  # peak lr; muon wants ~0.02 for its matrices, lion ~3-10x less than adamw
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Decay only matrices by default; these switch it on for the other groups.
    decay_embeddings: bool = False
    decay_norms_and_biases: bool = False
    momentum: float = 0.95  # sgd and muon
    muon_adam_lr: float = 3e-3  # lr of the AdamW that muon uses for non-matrix params
    implementation: str = "auto"  # auto | fused | foreach | single (torch AdamW/Adam kernels)

    def validate(self) -> None:
        _choice("optim.name", self.name, ("adamw", "adafactor", "lamb", "lion", "muon", "sgd"))
        _choice("optim.implementation", self.implementation, ("auto", "fused", "foreach", "single"))
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum={self.momentum} must be in [0, 1)")
        if self.muon_adam_lr <= 0:
            raise ConfigError(f"optim.muon_adam_lr={self.muon_adam_lr} must be > 0")


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | linear | step | wsd | constant | plateau
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final lr as a fraction of optim.lr (cosine, linear, wsd)
    decay_fraction: float = 0.2  # wsd: fraction of the steps spent in the final decay
    step_size: int = 1000  # step: decay every this many steps
    gamma: float = 0.5  # step and plateau: multiply lr by this
    plateau_patience: int = 2  # plateau: evaluations without improvement before decaying
    plateau_threshold: float = 1e-3  # plateau: relative improvement that counts

    def validate(self) -> None:
        _choice("schedule.name", self.name, ("cosine", "linear", "step", "wsd", "constant", "plateau"))
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"schedule.gamma={self.gamma} must be in (0, 1]")
        _positive("schedule.step_size", self.step_size)


@dataclass
class TrainConfig:
    steps: int = 400  # the embedded default: ~10 minutes on 2 CPU cores
    batch_size: int = 16  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto | fp32 | bf16 | fp16 (bf16/fp16 are autocast; fp16 uses a grad scaler). auto: bf16 on
    # GPUs and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32 (emulated bf16 is slower).
    dtype: str = "auto"
    compile: bool = False
    activation_checkpointing: str = "none"  # none | full (every block) | selective (every other)
    clip_grad_norm: float = 1.0  # 0 disables clipping
    max_nonfinite_steps: int = 5  # stop after this many non-finite steps in a row
    eval_every: int = 100  # 0 disables periodic evaluation
    eval_batches: int = 20
    early_stopping_patience: int = 0  # evaluations without improvement; 0 disables
    early_stopping_min_delta: float = 0.0
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default
    eval_sets: list[str] = field(default_factory=list)  # extra held-out text files scored at each eval

    def validate(self) -> None:
        _choice("train.dtype", self.dtype, ("auto", "fp32", "bf16", "fp16"))
        _choice("train.activation_checkpointing", self.activation_checkpointing, ("none", "full", "selective"))
        for key in ("steps", "batch_size", "grad_accum", "eval_batches", "max_nonfinite_steps"):
            _positive(f"train.{key}", getattr(self, key))
        if self.clip_grad_norm < 0:
            raise ConfigError(f"train.clip_grad_norm={self.clip_grad_norm} must be >= 0")


@dataclass
class CheckpointConfig:
    every: int | str = 200  # steps between checkpoints; 0 disables periodic saving; "auto": Young/Daly
    mtbf_hours: float = 24.0  # mean time between failures, for every = "auto"
    keep_last: int = 2  # newest complete checkpoints kept (the newest is never pruned)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this; 0: none
    save_final: bool = True
    async_save: bool = True  # block only while state is copied to host memory; write in the background
    on_error: str = "continue"  # a failed save (disk full, I/O error): continue training | stop
    make_room: bool = True  # when the disk is short, prune what retention would prune before saving
    memory_replicas: bool = False  # keep each save in host memory + a peer rank's (needs async_save)
    replica_dir: str = "/dev/shm"  # tmpfs that outlives a worker restart
    spike_zscore: float = 0.0  # loss-spike recovery: restore + skip data when loss z-score exceeds this; 0: off
    spike_window: int = 50  # losses the z-score is computed over
    spike_max_recoveries: int = 3
    spike_skip_batches: int = 0  # global micro-batches skipped after the spike (besides those before it)

    def validate(self) -> None:
        if isinstance(self.every, str) and self.every != "auto":
            raise ConfigError(f"checkpoint.every={self.every!r} must be a step count >= 0 or 'auto'")
        if isinstance(self.every, int) and self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0")
        if not self.mtbf_hours > 0:
            raise ConfigError(f"checkpoint.mtbf_hours={self.mtbf_hours} must be > 0")
        _positive("checkpoint.keep_last", self.keep_last)
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be >= 0")
        _choice("checkpoint.on_error", self.on_error, ("continue", "stop"))
        if self.memory_replicas and not self.async_save:
            raise ConfigError("checkpoint.memory_replicas=true needs checkpoint.async_save=true (it keeps the "
                              "async save's host snapshot)")
        if self.spike_zscore < 0 or self.spike_window < 2 or self.spike_max_recoveries < 0 or self.spike_skip_batches < 0:
            raise ConfigError("checkpoint.spike_*: spike_zscore >= 0, spike_window >= 2, "
                              "spike_max_recoveries >= 0 and spike_skip_batches >= 0 expected")


@dataclass
class MetricsConfig:
    log_every: int = 10  # terminal lines (plain mode); metrics.jsonl gets every step
    progress: str = "auto"  # auto | rich | plain | none
    tensorboard: bool = False
    peak_flops: float = 0.0  # per-device peak for MFU; 0: known GPU table, or a CPU matmul probe

    def validate(self) -> None:
        _choice("metrics.progress", self.progress, ("auto", "rich", "plain", "none"))
        _positive("metrics.log_every", self.log_every)


@dataclass
class ParallelConfig:
    # Degrees of each mesh dimension; dp_shard = -1 takes whatever the world size leaves over.
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def validate(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "cp", "ep"):
            _positive(f"parallel.{key}", getattr(self, key))
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be -1 (auto) or >= 1")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "JobConfig":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


# ---------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build a validated JobConfig from an optional TOML file and `section.key=value` overrides."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    cfg = from_dict(raw, source=source)
    apply_overrides(cfg, overrides or [])
    return cfg.validate()


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    cfg = JobConfig()
    sections = {f.name for f in dataclasses.fields(JobConfig)}
    for name, values in raw.items():
        if name not in sections:
            raise ConfigError(f"{source}: unknown section [{name}]; expected one of {sorted(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys")
        section = getattr(cfg, name)
        for key, value in values.items():
            _set_field(section, f"{name}.{key}", key, value, source)
    return cfg


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> None:
    """Apply `section.key=value` strings; the value is parsed as a TOML literal, else a string."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=100")
        dotted, text = item.split("=", 1)
        section_name, key = dotted.strip().split(".", 1)
        if not hasattr(cfg, section_name) or section_name.startswith("_"):
            raise ConfigError(f"--set {item!r}: unknown section [{section_name}]")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        _set_field(getattr(cfg, section_name), dotted.strip(), key, value, "--set")


def to_toml(cfg: JobConfig) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())


def _set_field(section: Any, dotted: str, key: str, value: Any, source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"{source}: unknown key {dotted}; expected one of {sorted(fields)}")
    hint = typing.get_type_hints(type(section))[key]
    setattr(section, key, _coerce(value, hint, dotted, source))


def _coerce(value: Any, hint: Any, dotted: str, source: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool, float):
        if type(value) is hint:
            return value
        if hint is float and type(value) is float:
            return value
    elif origin is list:
        (arg,) = typing.get_args(hint)
        if isinstance(value, list):
            return [_coerce(v, arg, dotted, source) for v in value]
    elif origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(v, a, dotted, source) for v, a in zip(value, args))
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(value, arg, dotted, source)
            except ConfigError:
                continue
    raise ConfigError(f"{source}: {dotted}={value!r} has the wrong type; expected {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_plain(v) for v in obj]
    return obj


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(options)}")


def _positive(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")

"""Typed job configuration, and the one config engine every kiln config uses.

The engine (this module, used by `kiln train`, `kiln prep` and `kiln sweep`): dataclass sections
are filled from TOML tables and `--set section.key=value` strings; a `--set` value is parsed as a
TOML literal, else kept as a string; values are coerced to the field's type; and every field may
carry declarative range rules in its metadata (`ranged(default, gt=0)`, `choices=...`), checked
by `check_fields`, so each key is range-checked in one place. Every mistake raises a one-line
`ConfigError` naming the key (and file) and what was expected. Parsing is `tomllib` (stdlib) and
coercion follows the dataclass type hints; the checks themselves are ours.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kiln.errors import ConfigError

INT64_MAX = 2**63 - 1  # every int goes to torch/numpy sooner or later
# BPE trainers size per-token tables by the requested vocabulary (10**9 aborts the process);
# real vocabularies stay under ~1M, so 2**24 leaves ample room.
MAX_VOCAB = 1 << 24
SCHEDULES = ("cosine", "linear", "step", "wsd", "constant", "plateau")
OPTIMIZERS = ("adamw", "adafactor", "lamb", "lion", "muon", "sgd")
# A run name becomes a directory under runs/: one path component, no "..".
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"


# ---------------------------------------------------------------------------- range rules


def ranged(default: Any, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
           le: float | None = None, choices: tuple[str, ...] | None = None, pattern: str | None = None,
           expect: str | None = None) -> Any:
    """A dataclass field with range rules that `check_fields` enforces (bounds are inclusive for
    ge/le, exclusive for gt/lt; `choices` and `pattern` are for strings, `expect` says in words
    what `pattern` accepts)."""
    rules = {k: v for k, v in dict(gt=gt, ge=ge, lt=lt, le=le, choices=choices, pattern=pattern,
                                   expect=expect).items() if v is not None}
    return field(default=default, metadata={"range": rules})


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _interval(bounds: dict[str, Any]) -> str:
    lo = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    hi = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {_num(lo[1])}"
    return f"{'<' if hi[0] == ')' else '<='} {_num(hi[1])}"


def check_value(key: str, value: Any, rules: dict[str, Any], source: str = "") -> None:
    """Raise a ConfigError `section.key=value must be ...` when `value` breaks `rules`; floats
    must also be finite and ints must fit in int64."""
    where = f"{source}: " if source else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}{key}={value} must be a finite number")
    if isinstance(value, str):
        if "choices" in rules and value not in rules["choices"]:
            wanted = rules.get("expect") or f"one of {', '.join(rules['choices'])}"
            raise ConfigError(f"{where}{key}={value!r} is not {wanted}")
        if "pattern" in rules and not re.fullmatch(rules["pattern"], value):
            raise ConfigError(f"{where}{key}={value!r} must be {rules.get('expect', 'like ' + rules['pattern'])}")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = {k: rules[k] for k in ("gt", "ge", "lt", "le") if k in rules}
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise ConfigError(f"{where}{key}={value} does not fit in 64 bits")
    broken = (("gt" in bounds and not value > bounds["gt"]) or ("ge" in bounds and not value >= bounds["ge"])
              or ("lt" in bounds and not value < bounds["lt"]) or ("le" in bounds and not value <= bounds["le"]))
    if broken:
        raise ConfigError(f"{where}{key}={value} must be {_interval(bounds)}")


def check_fields(section: Any, prefix: str, source: str = "") -> None:
    """Check every field of a dataclass section against its `ranged` rules (and finiteness)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        rules = f.metadata.get("range", {})
        for item in value if isinstance(value, (list, tuple)) else (value,):
            check_value(f"{prefix}{f.name}", item, rules, source)


# ---------------------------------------------------------------------------- job sections


@dataclass
class ModelConfig:
    # Also the default run dir, runs/NAME.
    name: str = ranged("kiln-small", pattern=NAME_PATTERN,
                       expect="a plain name: letters, digits, '.', '_', '-', no '/', not starting with '.'")
    vocab_size: int = ranged(0, ge=0, le=MAX_VOCAB)  # 0: take it from the tokenizer
    dim: int = ranged(256, gt=0)
    n_layers: int = ranged(4, gt=0)
    n_heads: int = ranged(4, gt=0)
    n_kv_heads: int = ranged(0, ge=0)  # 0: same as n_heads (plain multi-head attention); fewer: grouped-query
    # 0: dim // n_heads; set: each head's width, so attention is n_heads * head_dim wide whatever
    # dim is (Qwen3-0.6B: dim 1024, 16 heads of 128)
    head_dim: int = ranged(0, ge=0)
    ffn_hidden: int = ranged(0, ge=0)  # 0: 4*dim for gelu, 2/3 of that (rounded to multiple_of) for gated units
    multiple_of: int = ranged(64, gt=0)
    max_seq_len: int = ranged(256, gt=0)
    norm: str = ranged("rmsnorm", choices=("layernorm", "rmsnorm", "none"))  # none is meant for t_fixup init
    norm_eps: float = ranged(1e-5, gt=0.0, lt=1.0)
    norm_placement: str = ranged("pre", choices=("pre", "post"))
    # gelu: exact (erf); gelu_tanh: the tanh approximation GPT-2 was trained with (HF "gelu_new")
    activation: str = ranged("swiglu", choices=("gelu", "gelu_tanh", "swiglu", "geglu"))
    positions: str = ranged("rope", choices=("rope", "learned"))
    rope_theta: float = ranged(10000.0, gt=0.0)
    # RoPE for a context longer than pretrained (kiln/model/transformer.py rope_frequencies):
    # "linear" divides every frequency by rope_scaling_factor; "llama3" (Llama 3.1's) only those
    # whose wavelength exceeds rope_original_max_seq_len / rope_low_freq_factor, blending up to
    # rope_original_max_seq_len / rope_high_freq_factor; "yarn" (Peng et al. 2023) those turning
    # fewer than rope_yarn_beta_slow times over rope_original_max_seq_len, blending up to
    # rope_yarn_beta_fast turns, and scales q and k by rope_attention_factor (0: 0.1 ln(factor) + 1).
    rope_scaling: str = ranged("none", choices=("none", "linear", "llama3", "yarn"))
    rope_scaling_factor: float = ranged(8.0, ge=1.0)
    rope_low_freq_factor: float = ranged(1.0, gt=0.0)
    rope_high_freq_factor: float = ranged(4.0, gt=0.0)
    rope_original_max_seq_len: int = ranged(8192, gt=0)
    rope_yarn_beta_fast: float = ranged(32.0, gt=0.0)
    rope_yarn_beta_slow: float = ranged(1.0, gt=0.0)
    rope_attention_factor: float = ranged(0.0, ge=0.0)
    tie_embeddings: bool = True
    bias: bool = False  # biases on every linear and LayerNorm
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2); model.bias implies them
    # RMSNorm over each head of q and k before RoPE (QK-norm, Dehghani et al. 2023; Qwen3): bounds
    # the attention logits, which otherwise grow and destabilize training at high learning rates.
    qk_norm: bool = False
    # Sliding-window (local) attention (Beltagy et al. 2020; Mistral 7B v0.1, Gemma 2/3, gpt-oss): a
    # token attends to the sliding_window most recent tokens, itself included; 0: the whole past.
    # full_attention_every = k keeps every k-th layer (k-1, 2k-1, ...) global; 0: every layer local.
    sliding_window: int = ranged(0, ge=0)
    full_attention_every: int = ranged(0, ge=0)
    dropout: float = ranged(0.0, ge=0.0, lt=1.0)
    init: str = ranged("gpt2", choices=("normal", "gpt2", "ds_init", "t_fixup"))
    init_std: float = ranged(0.02, gt=0.0, le=1.0)
    # Mixture of experts (kiln/model/moe.py): 0 experts = dense FeedForward in every block.
    moe_experts: int = ranged(0, ge=0, le=4096)
    moe_top_k: int = ranged(1, ge=1, le=64)  # 1 = Switch (Fedus et al. 2021), 2 = GShard (Lepikhin et al. 2020)
    moe_capacity_factor: float = ranged(1.25, ge=0.0, le=64.0)  # 0 = dropless (every token reaches its experts)
    moe_aux_loss_weight: float = ranged(0.01, ge=0.0)  # load-balancing loss (Switch eq. 4)
    moe_z_loss_weight: float = ranged(0.001, ge=0.0)  # router z-loss (ST-MoE, Zoph et al. 2022)
    moe_every: int = ranged(1, ge=1)  # MoE in every moe_every-th block (1: all), dense FeedForward elsewhere
    # Each expert's hidden width: 0 = the dense FFN's (model.ffn_hidden); narrower experts, more of
    # them and a larger top_k are DeepSeekMoE's fine-grained experts (Qwen3-MoE: 768 beside 6144).
    moe_hidden: int = ranged(0, ge=0)
    # Shared experts (DeepSeekMoE, Dai et al. 2024; Qwen2-MoE; Llama 4): every token also goes
    # through this many always-active experts of the expert width, one MLP beside the routed ones
    # (their hidden units concatenated); moe_shared_gate scales it by sigmoid(x . w) per token
    # (Qwen2-MoE's shared_expert_gate).
    moe_shared_experts: int = ranged(0, ge=0, le=64)
    moe_shared_gate: bool = False
    # Router scores: softmax over the experts (Switch, GShard, Mixtral, Qwen3-MoE) or each expert's
    # sigmoid (DeepSeek-V3); moe_norm_gates renormalizes a token's top_k > 1 gates to sum to 1.
    moe_router: str = ranged("softmax", choices=("softmax", "sigmoid"))
    moe_norm_gates: bool = True
    # Routed gates times this (DeepSeek-V3's routed_scaling_factor, 2.5 there); 1: unscaled.
    moe_gate_scale: float = ranged(1.0, gt=0.0)
    # Group-limited routing (DeepSeek-V3's node-limited routing): the experts in moe_groups equal
    # groups, a token picks among the moe_topk_groups groups whose two best scores sum highest
    # (with an expert parallel group per node, a token's experts sit on at most that many nodes).
    moe_groups: int = ranged(1, ge=1)
    moe_topk_groups: int = ranged(1, ge=1)
    # Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): a per-expert bias added to
    # the scores only to pick experts, moved by this much after every optimizer step, up for an
    # expert that took fewer assignments than the mean over the step's global batch, down for one
    # that took more (0: off). DeepSeek-V3 used 0.001; set moe_aux_loss_weight low or 0 alongside.
    moe_bias_update_rate: float = ranged(0.0, ge=0.0, le=1.0)
    # q/k/v (and a gated MLP's w1/w3) as one GEMM over their concatenated weights, parameters
    # kept separate (kiln/model/transformer.py: fused_linear); falls back to one GEMM each under
    # tensor parallelism and for float8 linears. auto: on a GPU unless FSDP shards the weights
    # (kiln/train/system.py: resolve_fused_projections, from the figures in benchmarks/README.md).
    fused_projections: bool | str = ranged("auto", choices=("auto",), expect="true, false or 'auto'")

    def attention_head_dim(self) -> int:
        """Each attention head's width: model.head_dim, or dim // n_heads when that is 0."""
        return self.head_dim or self.dim // self.n_heads

    def validate(self) -> None:
        check_fields(self, "model.")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} must be <= model.moe_experts={self.moe_experts}")
        if self.moe_hidden and not self.moe_experts:
            raise ConfigError(f"model.moe_hidden={self.moe_hidden} is the experts' width; set model.moe_experts > 0 "
                              f"or model.moe_hidden = 0")
        if self.moe_groups > 1 and self.moe_experts:
            if self.moe_experts % self.moe_groups:
                raise ConfigError(f"model.moe_groups={self.moe_groups} must divide model.moe_experts="
                                  f"{self.moe_experts}")
            if self.moe_topk_groups > self.moe_groups:
                raise ConfigError(f"model.moe_topk_groups={self.moe_topk_groups} must be <= "
                                  f"model.moe_groups={self.moe_groups}")
            if self.moe_top_k > self.moe_topk_groups * (self.moe_experts // self.moe_groups):
                raise ConfigError(f"model.moe_top_k={self.moe_top_k} exceeds the experts of "
                                  f"model.moe_topk_groups={self.moe_topk_groups} groups of "
                                  f"{self.moe_experts // self.moe_groups}; raise model.moe_topk_groups")
        if self.moe_shared_experts and not self.moe_experts:
            raise ConfigError(f"model.moe_shared_experts={self.moe_shared_experts} sit beside routed experts; set "
                              f"model.moe_experts > 0 or model.moe_shared_experts = 0")
        if self.moe_shared_gate and not self.moe_shared_experts:
            raise ConfigError("model.moe_shared_gate=true gates the shared experts; set model.moe_shared_experts > 0 "
                              "or model.moe_shared_gate = false")
        if self.moe_bias_update_rate and not self.moe_experts:
            raise ConfigError(f"model.moe_bias_update_rate={self.moe_bias_update_rate:g} balances experts; set "
                              f"model.moe_experts > 0 or model.moe_bias_update_rate = 0")
        if self.dim % self.n_heads and not self.head_dim:
            raise ConfigError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads} "
                              f"(or set model.head_dim)")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={kv}")
        if self.full_attention_every and not self.sliding_window:
            raise ConfigError(f"model.full_attention_every={self.full_attention_every} needs model.sliding_window > 0 "
                              f"(it names the layers that stay global among sliding-window ones)")
        if self.attention_head_dim() % 2 and self.positions == "rope":
            key = "model.head_dim" if self.head_dim else "model.dim/n_heads"
            raise ConfigError(f"{key}={self.attention_head_dim()} must be even for rope positions")
        if self.rope_scaling != "none" and self.positions != "rope":
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} needs model.positions='rope' "
                              f"(it is {self.positions!r}); set model.rope_scaling='none'")
        if self.rope_scaling == "yarn" and self.rope_yarn_beta_fast <= self.rope_yarn_beta_slow:
            raise ConfigError(f"model.rope_yarn_beta_fast={self.rope_yarn_beta_fast:g} must be > "
                              f"model.rope_yarn_beta_slow={self.rope_yarn_beta_slow:g} for rope_scaling='yarn'")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor:g} must be > "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor:g} for rope_scaling='llama3'")


@dataclass
class DataConfig:
    # builtin:stdlib (this Python's standard library sources), a text/.jsonl file, a directory of
    # such files, or a directory of kiln token shards (one with meta.json).
    source: str = "builtin:stdlib"
    glob: str = "**/*"  # which files of a directory source to read
    text_field: str = "text"  # for .jsonl sources
    max_bytes: int = ranged(8_000_000, ge=0)  # read at most this much raw text (0: all of it)
    tokenizer: str = "bpe"  # bpe | byte | path to a tokenizer.json
    vocab_size: int = ranged(4096, gt=0, le=MAX_VOCAB)  # for tokenizer = "bpe"
    val_fraction: float = ranged(0.05, gt=0.0, lt=1.0)
    seq_len: int = ranged(256, gt=0)
    prefetch: int = ranged(4, ge=1, le=1024)  # batches prepared ahead by a background thread
    shards_dir: str = ""  # where to write token shards; "" = RUN_DIR/data
    # contiguous: window k starts at token k*seq_len of its shard; doc_start: windows start at
    # document starts (and every seq_len within a long document); packed_masked: contiguous, but
    # attention does not cross document boundaries (a block-diagonal causal mask, docs/loading.md)
    # warn when the trainer waits on data for more than this share of the step time (0: never)
    wait_warn_fraction: float = ranged(0.05, ge=0.0, le=1.0)
    windows: str = ranged("contiguous", choices=("contiguous", "doc_start", "packed_masked"))
    # Train on a weighted mixture of kiln shard directories (paths or URLs, same tokenizer as
    # data.source, which still gives the tokenizer and the validation split); [] = data.source.
    mixture: list[str] = field(default_factory=list)
    mixture_weights: list[float] = field(default_factory=list)
    # Shards at a URL (data.source = "s3://bucket/prefix", any fsspec URL; endpoint and keys from
    # the usual AWS_* variables) are downloaded into a bounded on-disk cache, shards ahead of the
    # sampler first.
    cache_dir: str = ""  # "" = $KILN_SHARD_CACHE or ~/.cache/kiln/shards
    cache_gb: float = ranged(50.0, gt=0.0)  # on-disk shard cache bound
    # lru, or static: CoorDL's fixed resident subset, for random-order epochs over data larger
    # than the cache (every epoch hits on the same cache_gb); auto: static for cached windows (the
    # unit each epoch reads once), lru for whole files (a shared cache dir keeps turning over)
    cache_policy: str = ranged("auto", choices=("auto", "lru", "static"))
    # what the cache holds: auto = whole shard files when cache_gb holds the split, else single
    # windows read with byte-range requests (kiln/data/storage.py); shard or window to force one
    cache_granularity: str = ranged("auto", choices=("auto", "shard", "window"))
    fetch_workers: int = ranged(8, ge=1, le=256)  # parallel downloads (whole shards or byte ranges)
    fetch_retries: int = ranged(4, ge=0, le=100)  # per request, with exponential backoff
    # window caching: windows of one shard less than this apart are read with one range request
    fetch_merge_kib: int = ranged(1024, ge=0, le=1 << 20)
    lookahead: int = ranged(16, ge=0, le=100_000)  # batches whose shards are fetched ahead

    # Privacy canaries (kiln/privacy/canaries.py, docs/privacy.md): this many random secrets
    # "my code is 7-3-9-..." of canary_digits digits, each inserted canary_repeats times into the
    # training documents and recorded in RUN_DIR/canaries.jsonl (with as many held-out ones).
    canaries: int = ranged(0, ge=0, le=10_000)
    canary_repeats: int = ranged(10, gt=0, le=100_000)
    canary_digits: int = ranged(6, ge=1, le=18)
    canary_seed: int = ranged(0, ge=0)

    def validate(self) -> None:
        check_fields(self, "data.")
        if len(self.mixture) != len(self.mixture_weights):
            raise ConfigError(f"data.mixture has {len(self.mixture)} sources but data.mixture_weights has "
                              f"{len(self.mixture_weights)} weights; give one weight per source")
        if self.mixture and (any(not w >= 0 for w in self.mixture_weights) or sum(self.mixture_weights) <= 0):
            raise ConfigError(f"data.mixture_weights={self.mixture_weights}: expected weights >= 0 with a "
                              f"positive sum")
        if 2 * self.canaries > 10 ** self.canary_digits:
            raise ConfigError(f"data.canaries={self.canaries} needs 2x that many distinct secrets; "
                              f"data.canary_digits={self.canary_digits} allows {10 ** self.canary_digits}")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(f"data.vocab_size={self.vocab_size} must be > 256 for a BPE tokenizer")


@dataclass
class OptimConfig:
    name: str = ranged("adamw", choices=OPTIMIZERS)
    lr: float = ranged(3e-3, gt=0.0)  # peak lr; muon wants ~0.02 for its matrices, lion ~3-10x less than adamw
    betas: tuple[float, float] = ranged((0.9, 0.95), ge=0.0, lt=1.0)
    eps: float = ranged(1e-8, gt=0.0)
    weight_decay: float = ranged(0.1, ge=0.0)
    # Decay only matrices by default; these switch it on for the other groups.
    decay_embeddings: bool = False
    decay_norms_and_biases: bool = False
    momentum: float = ranged(0.95, ge=0.0, lt=1.0)  # sgd and muon
    muon_adam_lr: float = ranged(3e-3, gt=0.0)  # lr of the AdamW that muon uses for non-matrix params
    # torch AdamW/Adam kernels
    implementation: str = ranged("auto", choices=("auto", "fused", "foreach", "single"))

    def validate(self) -> None:
        check_fields(self, "optim.")


@dataclass
class ScheduleConfig:
    name: str = ranged("cosine", choices=SCHEDULES)
    warmup_steps: int = ranged(100, ge=0)
    min_lr_ratio: float = ranged(0.1, ge=0.0, le=1.0)  # final lr as a fraction of optim.lr (cosine, linear, wsd)
    decay_fraction: float = ranged(0.2, gt=0.0, le=1.0)  # wsd: fraction of the steps spent in the final decay
    step_size: int = ranged(1000, gt=0)  # step: decay every this many steps
    gamma: float = ranged(0.5, gt=0.0, le=1.0)  # step and plateau: multiply lr by this
    plateau_patience: int = ranged(2, gt=0)  # plateau: evaluations without improvement before decaying
    plateau_threshold: float = ranged(1e-3, ge=0.0, lt=1.0)  # plateau: relative improvement that counts

    def validate(self) -> None:
        check_fields(self, "schedule.")


@dataclass
class TrainConfig:
    steps: int = ranged(400, gt=0)  # the embedded default: ~10 minutes on 2 CPU cores
    batch_size: int = ranged(16, gt=0)  # sequences per micro-batch per data-parallel rank
    grad_accum: int = ranged(1, ge=1, le=65536)
    # Sequences per optimizer step over all data-parallel ranks (torchtitan's global_batch_size).
    # 0: batch_size x grad_accum x data-parallel ranks. G > 0: grad_accum is derived for the layout
    # that runs, G / (batch_size x data-parallel ranks), so one config takes the same optimizer steps
    # on any [parallel] layout (and a run resumed on another keeps its batch); saved resolved
    global_batch_size: int = ranged(0, ge=0)
    seed: int = ranged(1337, ge=0)
    device: str = ranged("auto", pattern=r"auto|cpu|cuda(:[0-9]{1,4})?", expect="auto, cpu, cuda or cuda:N")
    # auto | fp32 | bf16 | fp16 (bf16/fp16 are autocast; fp16 uses a grad scaler). auto: bf16 on
    # GPUs and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32 (emulated bf16 is slower).
    dtype: str = ranged("auto", choices=("auto", "fp32", "bf16", "fp16"))
    compile: bool = False
    # What compile covers: model = the whole forward + LM head + loss (one graph), blocks = each
    # block on its own (what FSDP needs); auto = model on one device, blocks when sharded.
    compile_scope: str = ranged("auto", choices=("auto", "model", "blocks"))
    cuda_graphs: bool = False  # torch.compile mode="reduce-overhead" (CUDA, compile_scope=model)
    # torch.compile's max-autotune: inductor times GEMM templates and kernel configs on this device
    # at the first compile (minutes longer) and keeps the fastest (with cuda_graphs: "max-autotune")
    autotune: bool = False
    # full: logits then cross-entropy; chunked: LM head + cross-entropy in chunks, never full fp32
    # logits (kiln/model/loss.py); auto: chosen per device and compile scope from the figures in
    # benchmarks/README.md ("One GPU") - see kiln/train/system.py resolve_loss.
    loss: str = ranged("auto", choices=("auto", "full", "chunked"))
    # SDPA kernel (CUDA): auto lets torch pick and logs it; another name insists on that kernel
    attention_backend: str = ranged("auto", choices=("auto", "flash", "cudnn", "efficient", "math"))
    float8: bool = False  # float8 matmuls via torchao (GPUs with float8 tensor cores, e.g. H100)
    float8_recipe: str = ranged("tensorwise", choices=("tensorwise", "rowwise"))
    # none | full (every block) | selective (every other) | every_k:K (blocks 0, K, 2K, ...; kiln plan picks K)
    # | op (every block, keeping its matmul and attention outputs: only cheap ops are recomputed)
    activation_checkpointing: str = ranged("none", pattern=r"none|full|selective|op|every_k:[1-9][0-9]{0,5}",
                                           expect="none, full, selective, op or every_k:K with K >= 1")
    clip_grad_norm: float = ranged(1.0, ge=0.0)  # 0 disables clipping
    max_nonfinite_steps: int = ranged(5, gt=0)  # stop after this many non-finite steps in a row
    eval_every: int = ranged(100, ge=0)  # 0 disables periodic evaluation
    eval_batches: int = ranged(20, gt=0)  # batches of batch_size windows per data-parallel rank (split over them)
    early_stopping_patience: int = ranged(0, ge=0)  # evaluations without improvement; 0 disables
    early_stopping_min_delta: float = ranged(0.0, ge=0.0)
    threads: int = ranged(0, ge=0, le=4096)  # torch intra-op threads on CPU; 0 leaves torch's default
    eval_sets: list[str] = field(default_factory=list)  # extra held-out text files scored at each eval

    def validate(self) -> None:
        check_fields(self, "train.")
        if self.global_batch_size and self.global_batch_size % self.batch_size:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                              f"train.batch_size={self.batch_size}; change either")
        if self.cuda_graphs and not self.compile:
            raise ConfigError("train.cuda_graphs=true needs train.compile=true (it is torch.compile's "
                              "reduce-overhead mode)")
        if self.cuda_graphs and self.compile_scope == "blocks":
            raise ConfigError("train.cuda_graphs=true needs train.compile_scope='model' or 'auto'")
        if self.autotune and not self.compile:
            raise ConfigError("train.autotune=true needs train.compile=true (it is torch.compile's max-autotune mode)")

    def accumulation(self, dp_ranks: int) -> int:
        """Micro-batches a data-parallel rank accumulates per optimizer step on `dp_ranks` ranks:
        grad_accum, or global_batch_size / (batch_size x dp_ranks) where that is set."""
        if not self.global_batch_size:
            return self.grad_accum
        per_pass = self.batch_size * dp_ranks
        if self.global_batch_size % per_pass:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} is not a multiple of train.batch_size="
                              f"{self.batch_size} x {dp_ranks} data-parallel ranks = {per_pass}; change "
                              f"train.global_batch_size (to a multiple of {per_pass}) or train.batch_size")
        accum = self.global_batch_size // per_pass
        if accum > 65536:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} needs {accum} micro-batches of "
                              f"train.batch_size={self.batch_size} per rank (at most 65536); raise train.batch_size")
        return accum


@dataclass
class CheckpointConfig:
    every: int | str = 200  # steps between checkpoints; 0 disables periodic saving; "auto": Young/Daly
    mtbf_hours: float = ranged(24.0, gt=0.0)  # mean time between failures, for every = "auto"
    keep_last: int = ranged(2, gt=0)  # newest complete checkpoints kept (the newest is never pruned)
    keep_every: int = ranged(0, ge=0)  # also keep every checkpoint whose step is a multiple of this; 0: none
    save_final: bool = True
    async_save: bool = True  # block only while state is copied to host memory; write in the background
    on_error: str = ranged("continue", choices=("continue", "stop"))  # a failed save (disk full, I/O error)
    make_room: bool = True  # when the disk is short, prune what retention would prune before saving
    memory_replicas: bool = False  # keep each save in host memory + a peer rank's (needs async_save)
    replica_dir: str = "/dev/shm"  # tmpfs that outlives a worker restart
    # loss-spike recovery: restore + skip data when the loss z-score exceeds this; 0: off
    spike_zscore: float = ranged(0.0, ge=0.0)
    spike_window: int = ranged(50, ge=2)  # losses the z-score is computed over
    spike_max_recoveries: int = ranged(3, ge=0)
    spike_skip_batches: int = ranged(0, ge=0)  # global micro-batches skipped after the spike (besides those before it)

    def validate(self) -> None:
        check_fields(self, "checkpoint.")
        if isinstance(self.every, str) and self.every != "auto":
            raise ConfigError(f"checkpoint.every={self.every!r} must be a step count >= 0 or 'auto'")
        if isinstance(self.every, int) and not 0 <= self.every < 2**63:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0")
        if self.memory_replicas and not self.async_save:
            raise ConfigError("checkpoint.memory_replicas=true needs checkpoint.async_save=true (it keeps the "
                              "async save's host snapshot)")


@dataclass
class MetricsConfig:
    log_every: int = ranged(10, gt=0)  # terminal lines (plain mode); metrics.jsonl gets every step
    progress: str = ranged("auto", choices=("auto", "rich", "plain", "none"))
    tensorboard: bool = False
    wandb: bool = False  # Weights & Biases, offline (wandb sync later); pip install 'kiln-lm[wandb]'
    # per-device peak FLOP/s for MFU; 0: known GPU table, or a CPU matmul probe
    peak_flops: float = ranged(0.0, ge=0.0)
    # torch.profiler trace of every N-th step (the step before it is warm-up) into runs/NAME/profile/
    # on every rank, and a `profile` row in metrics.jsonl (kiln/train/profiling.py); 0: off
    profile_every: int = ranged(0, ge=0)
    profile_memory: bool = False  # the allocator's events in those traces; on a GPU also a memory snapshot

    def validate(self) -> None:
        check_fields(self, "metrics.")


@dataclass
class ParallelConfig:
    # Degrees of each mesh dimension; dp_shard = -1 takes whatever the world size leaves over.
    dp_replicate: int = ranged(1, gt=0)
    dp_shard: int = ranged(-1, ge=-1)
    tp: int = ranged(1, gt=0)
    pp: int = ranged(1, gt=0)
    cp: int = ranged(1, gt=0)
    # How cp ranks attend across the sequence (docs/parallel.md, Context parallelism):
    #   ring:     ring attention, K/V blocks passed round the cp ranks point to point (any head count)
    #   ulysses:  DeepSpeed-Ulysses, all-to-alls trading the sequence split for a head split around a
    #             local attention of whole sequences; needs the heads per tp rank divisible by cp
    cp_mode: str = ranged("ring", choices=("ring", "ulysses"))
    # cp_mode ulysses: the ranks Ulysses' all-to-alls span (USP / Megatron's a2a+p2p). 0: all of cp;
    # U, a divisor of cp: U consecutive cp ranks (one node's, say) exchange heads, and ring
    # attention runs across the cp / U such groups
    ulysses_degree: int = ranged(0, ge=0)
    # cp_mode ulysses: its heads exchanged and attended in this many rounds, each round's all-to-all
    # in flight while the round before it attends (forward); must divide the heads per tp rank /
    # ulysses_degree (or cp). 1: one exchange each way, attention waiting for it
    ulysses_rounds: int = ranged(1, gt=0)
    ep: int = ranged(1, gt=0)
    # Expert tensor parallel degree under ep > 1 and tp > 1 (torchtitan's expert_tensor_parallel_degree):
    # -1 = tp (each expert's hidden units sharded over tp, ep from dp_shard x cp); 1 = experts whole,
    # ep borrows tp as well (each tp rank routes its own sequence shard; docs/parallel.md).
    etp: int = ranged(-1, ge=-1)
    # Two-level expert dispatch (DeepEP's internode layout, docs/parallel.md): the ep group's ranks
    # on one node (consecutive in the group; GPUs per node / tp with etp = tp). A token then crosses
    # to each node holding one of its experts once, and fans out inside it. 0: one level.
    ep_node_ranks: int = ranged(0, ge=0)
    # How the data-parallel ranks share the model (exact mapping in docs/parallel.md):
    #   auto:  ddp when only dp_replicate > 1, else fsdp (hsdp when both dp_replicate and dp_shard > 1)
    #   ddp:   replicated params/grads/optimizer, gradients all-reduced (DistributedDataParallel)
    #   zero1: ddp + optimizer state sharded (ZeroRedundancyOptimizer)
    #   zero2: FSDP2 with reshard_after_forward=False (params kept gathered from forward to backward)
    #   fsdp:  FSDP2 = ZeRO-3 (params resharded after forward); with dp_replicate > 1 this is HSDP
    dp_mode: str = ranged("auto", choices=("auto", "ddp", "zero1", "zero2", "fsdp"))
    # dtype data parallelism sends gradients in (FSDP2's reduce-scatter and HSDP all-reduce, DDP's and
    # ZeRO-1's bucket all-reduce, kiln's replicas under tp / zero-bubble pp, replicated experts');
    # bf16 halves the bytes, the sums landing in fp32 gradients
    reduce_dtype: str = ranged("fp32", choices=("fp32", "bf16"))
    # fsdp: the ranks a block's parameters stay sharded over from its forward to its backward
    # (FSDP2's reshard_after_forward=k; ZeRO++'s hierarchical partitioning, hpZ). 0: all of
    # dp_shard x cp (ZeRO-3). k, a divisor of dp_shard x cp: backward all-gathers over k
    # consecutive ranks only (one node's when they fit on it), for params/k per rank held until
    # backward instead of params/(dp_shard x cp). Not with tp, pp or DiLoCo replicas (torch's FSDP2
    # would hang creating its groups). docs/parallel.md "Resharding to a node after forward".
    fsdp_reshard_to: int = ranged(0, ge=0)
    cpu_offload: bool = False  # zero2/fsdp on GPU: parameters, gradients and optimizer state in CPU memory
    # Pipeline parallel (docs/parallel.md): torch.distributed.pipelining's schedules; the zero-bubble
    # ones and interleaved_1f1b/looped_bfs hold pp_virtual_stages stages per rank (zbv, dualpipev: exactly 2).
    pp_schedule: str = ranged("1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                                               "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"))
    pp_microbatches: int = ranged(0, ge=0)  # 0: one per pipeline stage; must divide batch_size*grad_accum
    pp_virtual_stages: int = ranged(1, gt=0)  # stages per pp rank
    # Explicit split: the first layer of every stage after the first (pp*pp_virtual_stages - 1
    # increasing indices); empty: layers spread evenly.
    pp_split_points: list[int] = field(default_factory=list)
    # DiLoCo (Douillard et al. 2023, kiln/parallel/diloco.py): 0 = off; H > 0 = every replica takes
    # H local optimizer steps, then one outer Nesterov step on the replica-averaged parameter delta.
    # Replicas: every data-parallel rank (dp_mode auto, or ddp/zero1 with dp_replicate 1), or
    # dp_replicate of them with FSDP (fsdp/zero2) or DDP / ZeRO-1 (ddp/zero1) over the other
    # data-parallel ranks inside each; tp, pp, cp and ep (from inside a replica: dims.py
    # diloco_layout) split each replica further.
    diloco_inner_steps: int = ranged(0, ge=0)
    diloco_outer_lr: float = ranged(0.7, gt=0.0)
    diloco_outer_momentum: float = ranged(0.9, ge=0.0, lt=1.0)
    # Streaming DiLoCo (Douillard et al. 2025): P fragments of blocks (strided: block i in fragment
    # i % P; sequential: contiguous runs), one synced every H / P steps (P must divide H); a
    # fragment's exchange starts diloco_sync_delay (tau < H / P) inner steps before its merge and
    # overlaps them; the merge keeps diloco_mix (alpha) of the replica's own parameters; the outer
    # gradient crosses the link in diloco_comm_dtype (bfloat16: half the bytes, summed on the wire;
    # float8_e4m3fn: a quarter, block-scaled, all-gathered and summed in fp32).
    diloco_fragments: int = ranged(1, ge=1)
    diloco_fragment_pattern: str = ranged("strided", choices=("strided", "sequential"))
    diloco_sync_delay: int = ranged(0, ge=0)
    diloco_mix: float = ranged(0.0, ge=0.0, lt=1.0)
    diloco_comm_dtype: str = ranged("float32", choices=("float32", "bfloat16", "float8_e4m3fn"))
    # Seconds a rank waits in one collective before it fails instead of hanging (kiln/parallel/
    # timeouts.py): init = until the first step is done on every rank (rank 0's tokenization, the
    # checkpoint load, the first compile) and for checkpoint saves; train = every later collective.
    init_timeout_s: float = ranged(1800.0, gt=0.0, le=7 * 86400.0)
    train_timeout_s: float = ranged(300.0, gt=0.0, le=7 * 86400.0)
    # NCCL's flight recorder: the last N collectives of each rank, dumped to runs/NAME/comm_traces/
    # when one times out (read them with torch's `torchfrtrace`); 0: off
    nccl_trace_entries: int = ranged(20000, ge=0)

    def validate(self) -> None:
        check_fields(self, "parallel.")
        if self.dp_shard == 0:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be -1 (auto) or >= 1")
        if self.dp_mode in ("ddp", "zero1") and self.dp_shard not in (-1, 1) and not (
                self.diloco_inner_steps and self.dp_replicate > 1):  # DiLoCo: DDP over dp_shard in a replica
            raise ConfigError(f"parallel.dp_mode={self.dp_mode!r} replicates the model on every data-parallel "
                              f"rank; set parallel.dp_shard=1 (or -1), or use dp_mode='fsdp' for HSDP")
        if self.etp not in (-1, 1, self.tp):
            raise ConfigError(f"parallel.etp={self.etp} must be 1 (experts whole, ep borrows tp) or "
                              f"parallel.tp={self.tp} (experts sharded over tp); -1 means tp")
        if self.ep_node_ranks > 1 and self.ep % self.ep_node_ranks:
            raise ConfigError(f"parallel.ep_node_ranks={self.ep_node_ranks} must divide parallel.ep={self.ep} "
                              f"(the ep ranks on one node); 0 dispatches in one level")
        if self.ulysses_degree and (self.cp_mode != "ulysses" or self.cp % self.ulysses_degree):
            raise ConfigError(f"parallel.ulysses_degree={self.ulysses_degree} needs parallel.cp_mode='ulysses' "
                              f"and must divide parallel.cp={self.cp} (cp_mode is {self.cp_mode!r}); "
                              f"0 spans all of cp")
        if self.ulysses_rounds > 1 and (self.cp == 1 or self.cp_mode != "ulysses"):
            raise ConfigError(f"parallel.ulysses_rounds={self.ulysses_rounds} needs parallel.cp > 1 with "
                              f"parallel.cp_mode='ulysses' (cp={self.cp}, cp_mode={self.cp_mode!r}); set it to 1")
        self._validate_streaming_diloco()
        if self.cpu_offload and self.dp_mode in ("ddp", "zero1"):
            raise ConfigError(f"parallel.cpu_offload=true needs a sharded dp_mode (zero2 or fsdp), "
                              f"not {self.dp_mode!r}")

    def _validate_streaming_diloco(self) -> None:
        H, P, tau = self.diloco_inner_steps, self.diloco_fragments, self.diloco_sync_delay
        streaming = {"diloco_fragments": (P, 1), "diloco_fragment_pattern": (self.diloco_fragment_pattern, "strided"),
                     "diloco_sync_delay": (tau, 0), "diloco_mix": (self.diloco_mix, 0.0),
                     "diloco_comm_dtype": (self.diloco_comm_dtype, "float32")}
        changed = [f"parallel.{k}={v!r}" for k, (v, default) in streaming.items() if v != default]
        if changed and not H:
            raise ConfigError(f"{changed[0]} sets up DiLoCo's outer syncs, which are off "
                              f"(parallel.diloco_inner_steps=0); set parallel.diloco_inner_steps or drop it")
        if H and H % P:
            raise ConfigError(f"parallel.diloco_fragments={P} must divide parallel.diloco_inner_steps={H} "
                              f"(one fragment syncs every H / P steps); change either")
        if H and tau >= H // P:
            raise ConfigError(f"parallel.diloco_sync_delay={tau} must be below diloco_inner_steps / diloco_fragments "
                              f"= {H // P} (a fragment's exchange ends before the next one starts); lower it")


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
        ep = self.parallel.ep
        if ep > 1 and not self.model.moe_experts:
            raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model; set model.moe_experts "
                              f"(a multiple of {ep}) or parallel.ep=1")
        if ep > 1 and self.model.moe_experts % ep:
            raise ConfigError(f"parallel.ep={ep} must divide model.moe_experts={self.model.moe_experts}; "
                              f"change parallel.ep or model.moe_experts")
        if self.train.activation_checkpointing == "op" and self.model.dropout > 0:
            # Where a checkpointed block runs eagerly (no compile; a whole-model graph that breaks at a
            # MoE block), a kept random op draws nothing in the recompute, so the masks drawn after it
            # would shift, and torch refuses CPU dropout's in-place mask as a kept output (seen, 2.13)
            raise ConfigError(f"train.activation_checkpointing='op' with model.dropout={self.model.dropout} is not "
                              f"supported; set model.dropout=0 or another train.activation_checkpointing "
                              f"('full', 'selective', 'every_k:K')")
        return self

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


# ---------------------------------------------------------------------------- the engine


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The tables of a TOML file; a missing file or bad TOML is a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} not found")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from None


def parse_literal(text: str) -> Any:
    """A value as `--set` reads it: a TOML literal (1e-3, 8, true, [0.9, 0.95]) or else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # tomllib recurses into nested arrays
        return text


def parse_override(item: str, example: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], parsed value); at least one dot before the `=`."""
    dotted, sep, text = item.partition("=")
    parts = [p.strip() for p in dotted.split(".")]
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. {example}")
    return parts, parse_literal(text.strip())


def shown(name: str) -> str:
    """A key as written, or its repr when it holds newlines or other unprintables (one line)."""
    return name if name.isprintable() else repr(name)


def fill_dataclass(cls: type, raw: dict[str, Any], source: str, prefix: str = "") -> Any:
    """A new `cls()` with the keys of `raw` set through `set_fields`."""
    obj = cls()
    set_fields(obj, raw, source, prefix)
    return obj


def set_fields(obj: Any, raw: dict[str, Any], source: str, prefix: str = "") -> None:
    """Set dataclass fields from `raw`, coercing each value to its type hint; errors name
    `{source}: {prefix}{key}`."""
    fields = {f.name for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {shown(prefix + str(key))}; expected one of {sorted(fields)}")
        setattr(obj, key, coerce(value, hints[key], f"{source}: {prefix}{key}"))


def coerce(value: Any, hint: Any, what: str) -> Any:
    """`value` as type `hint` (ints widen to float; lists to tuples of the right length), else a
    ConfigError `{what}=value has the wrong type`. Non-finite floats are refused here too."""
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{what}={value} must be a finite number")
        return float(value)
    if hint in (int, str, bool):
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
    shown_value = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise ConfigError(f"{what}={shown_value} has the wrong type; expected {name}")


# ---------------------------------------------------------------------------- job config


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build a validated JobConfig from an optional TOML file and `section.key=value` overrides."""
    raw = read_toml(path) if path is not None else {}
    cfg = from_dict(raw, source=str(path) if path is not None else "<defaults>")
    apply_overrides(cfg, overrides or [])
    return cfg.validate()


def fill_section(cfg: Any, name: str, values: Any, sections: Any, source: str, extra: tuple[str, ...] = ()) -> None:
    """Fill the dataclass section `name` of `cfg` from a TOML table; unknown sections and non-tables
    are one-line errors (`extra` names further sections the caller handles itself)."""
    if name not in sections:
        raise ConfigError(f"{source}: unknown section [{shown(name)}]; expected one of {sorted(sections) + list(extra)}")
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys")
    set_fields(getattr(cfg, name), values, source, f"{name}.")


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    cfg = JobConfig()
    sections = {f.name for f in dataclasses.fields(JobConfig)}
    for name, values in raw.items():
        fill_section(cfg, name, values, sections, source)
    return cfg


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> None:
    """Apply `section.key=value` strings; the value is parsed as a TOML literal, else a string."""
    sections = {f.name for f in dataclasses.fields(JobConfig)}
    for item in overrides:
        parts, value = parse_override(item, "train.steps=100")
        if parts[0] not in sections:
            raise ConfigError(f"--set {item!r}: unknown section [{shown(parts[0])}]; "
                              f"expected one of {sorted(sections)}")
        key = ".".join(parts[1:])
        set_fields(getattr(cfg, parts[0]), {key: value}, "--set", f"{parts[0]}.")


def to_toml(cfg: JobConfig) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_plain(v) for v in obj]
    return obj

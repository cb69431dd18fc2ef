"""Refuse a training config that cannot fit the device, before anything is allocated.

`estimate_train_bytes` is a closed form (no module is built: 10**6 layers on the meta device alone
take minutes); `check_fits_memory` compares it with the device's total memory (torch's CUDA
device properties, or the OS's physical page count) and raises a one-line ConfigError naming the
size key that is furthest above its default.
"""

from __future__ import annotations

import os

import torch

from kiln.config import JobConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.model.transformer import ffn_hidden_size
from kiln.parallel.dims import ParallelDims

# Optimizer state in bytes per fp32 parameter: two moments for adamw/lamb (muon: AdamW's two for
# its non-matrix part, one momentum for matrices; counted as two), one for lion and sgd. torch's
# Adafactor keeps factored row/column statistics, negligible next to the weights.
OPTIM_STATE_BYTES = {"adamw": 8, "lamb": 8, "muon": 8, "lion": 4, "sgd": 4, "adafactor": 0}
SIZE_KEYS = ("model.dim", "model.n_layers", "model.ffn_hidden", "model.max_seq_len", "train.batch_size",
             "data.seq_len")


def vocab_estimate(cfg: JobConfig) -> tuple[int, str]:
    """The vocabulary the model will get, and the key that sets it (model.vocab_size = 0 takes the
    tokenizer's; a tokenizer.json path is unknown before it is read, so it counts as 0)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    return {"bpe": cfg.data.vocab_size, "byte": 257}.get(cfg.data.tokenizer, 0), "data.vocab_size"


def count_params_closed_form(m: ModelConfig, vocab: int) -> int:
    """Parameters of kiln's Transformer for `m` (tied embeddings once), without building it."""
    head_dim = m.dim // m.n_heads
    kv = m.n_kv_heads or m.n_heads
    ffn = ffn_hidden_size(m)
    per_layer = 2 * m.dim * m.n_heads * head_dim + 2 * m.dim * kv * head_dim
    ffn_params = (3 if m.activation in ("swiglu", "geglu") else 2) * m.dim * ffn
    per_layer += ffn_params + 2 * m.dim
    params = vocab * m.dim * (1 if m.tie_embeddings else 2) + m.n_layers * per_layer + m.dim
    # MoE blocks (kiln/model/moe.py): E bias-free experts + a router instead of one dense FFN.
    moe_layers = m.n_layers // m.moe_every if m.moe_experts else 0
    params += moe_layers * ((m.moe_experts - 1) * ffn_params + m.moe_experts * m.dim)
    return params + (m.max_seq_len * m.dim if m.positions == "learned" else 0)


def estimate_train_bytes(cfg: JobConfig, dims: ParallelDims | None = None) -> int:
    """A lower estimate of one rank's training memory: fp32 weights, grads and optimizer state
    (split over dp_shard*tp*pp ranks), the activations kept for backward (per layer ~8*dim + 2*ffn
    floats per token; split over tp*cp*pp) and the logits."""
    m = cfg.model
    vocab, _ = vocab_estimate(cfg)
    params = count_params_closed_form(m, vocab)
    weights = params * (8 + OPTIM_STATE_BYTES.get(cfg.optim.name, 8))
    if cfg.parallel.diloco_inner_steps:  # DiLoCo's fp32 anchor and outer momentum
        weights += params * 8
    tokens = cfg.train.batch_size * cfg.data.seq_len
    activations = 4 * tokens * (m.n_layers * (8 * m.dim + 2 * ffn_hidden_size(m)) + 2 * vocab)
    rope = 4 * m.max_seq_len * (m.dim // m.n_heads)
    if dims is not None:
        weights //= dims.dp_shard * dims.tp * dims.pp
        activations //= dims.tp * dims.cp * dims.pp
    return weights + activations + rope


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: the GPU's for cuda, physical RAM otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_memory(cfg: JobConfig, device: torch.device, dims: ParallelDims | None = None,
                      available: int | None = None) -> None:
    """Raise `KEY=VALUE needs ~X GiB to train ..., this machine has Y GiB` when the per-rank
    estimate exceeds `available` (default: the device's total memory)."""
    need = estimate_train_bytes(cfg, dims)
    have = device_memory_bytes(device) if available is None else available
    if need <= have:
        return
    key, value = _blame(cfg)
    raise ConfigError(f"{key}={value} needs ~{need / 2**30:,.1f} GiB to train (weights, grads, optimizer "
                      f"state, activations); this machine has {have / 2**30:,.1f} GiB ({device.type})")


def _blame(cfg: JobConfig) -> tuple[str, int]:
    """The size key whose value is the largest multiple of its default (ffn_hidden counts only
    when set explicitly; a vocabulary is compared with data.vocab_size's default)."""
    default = JobConfig()
    vocab, vocab_key = vocab_estimate(cfg)
    candidates = {vocab_key: (vocab, default.data.vocab_size)}
    for key in SIZE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        base = ffn_hidden_size(default.model) if key == "model.ffn_hidden" else getattr(getattr(default, section), name)
        candidates[key] = (value, base)
    key = max(candidates, key=lambda k: candidates[k][0] / max(candidates[k][1], 1))
    return key, candidates[key][0]

"""Refuse a training config that cannot fit the device, before anything is allocated.

`estimate_train_bytes` is the closed-form memory model of kiln/plan/memory.py (the one `kiln plan`
uses; no module is built: 10**6 layers on the meta device alone take minutes); `check_fits_memory` compares it with the device's total memory (torch's CUDA
device properties, or the OS's physical page count) and raises a one-line ConfigError naming the
size key that is furthest above its default.
"""

from __future__ import annotations

import os

import torch

from kiln.config import JobConfig
from kiln.errors import ConfigError
from kiln.model.transformer import ffn_hidden_size
from kiln.parallel.dims import ParallelDims
from kiln.plan.diloco import WIRE_BYTES
from kiln.plan.memory import Layout, ModelShape, rank_memory, vocab_estimate

SIZE_KEYS = ("model.dim", "model.n_layers", "model.ffn_hidden", "model.head_dim", "model.max_seq_len",
             "train.batch_size", "data.seq_len")


def layout_of(cfg: JobConfig, dims: ParallelDims | None = None) -> Layout:
    """The planner's Layout for a job config (and its resolved ParallelDims, if any). Under pp the
    accumulated batch is one schedule step split into the schedule's micro-batches (the inverse of
    kiln/plan/search.py config_for_plan), so the schedule decides the activations held in flight.
    A run compiled as one graph (train.compile on one device, compile_scope auto or model) is
    counted with the compiled model, as `kiln plan` counts it: the eager count's fp32 logits and
    saved tensors are up to 2.8x a compiled run's measured peak (docs/plan.md), which refused runs
    that fit; per-block compile keeps the eager count."""
    dtype = cfg.train.dtype if cfg.train.dtype != "auto" else "fp32"  # auto may be fp32: the larger
    d = dims
    micro_batch, grad_accum, pipeline = cfg.train.batch_size, cfg.train.grad_accum, {}
    if d and d.pp > 1:
        from kiln.parallel.pipeline_layout import n_microbatches

        p = cfg.parallel
        grad_accum = n_microbatches(cfg)
        micro_batch = max(1, cfg.train.batch_size * cfg.train.grad_accum // grad_accum)
        # looped BFS runs every micro-batch's forward through a rank's stages first: GPipe's memory
        schedule = "gpipe" if p.pp_schedule == "looped_bfs" else p.pp_schedule
        pipeline = {"schedule": schedule,
                    "virtual_stages": 2 if schedule in ("zbv_zero_bubble", "dualpipev") else p.pp_virtual_stages}
    import torch

    from kiln.train.system import resolve_fused_projections  # the one rule, as build_model applies it

    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    fused = resolve_fused_projections(cfg.model.fused_projections, torch.device("cuda" if cuda else "cpu"),
                                      fsdp=d is not None and d.grad_ranks > 1 and d.dp_mode in ("fsdp", "zero2"))
    fused = fused and (d is None or d.tp == 1) and not cfg.train.float8  # those take one GEMM each
    return Layout(dp_replicate=d.dp_replicate if d else 1, dp_shard=d.dp_shard if d else 1, tp=d.tp if d else 1,
                  pp=d.pp if d else 1, cp=d.cp if d else 1, cp_mode=d.cp_mode if d else "ring",
                  ulysses_degree=d.ulysses_degree if d else 0, ulysses_rounds=d.ulysses_rounds if d else 1,
                  ep=d.ep if d else 1, etp=d.etp if d else -1, ep_node_ranks=cfg.parallel.ep_node_ranks if d else 0,
                  fsdp_reshard_to=cfg.parallel.fsdp_reshard_to if d else 0,
                  grad_wire_bytes=2 if cfg.parallel.reduce_dtype == "bf16" else 4,
                  dp_mode=d.dp_mode if d else "ddp", micro_batch=micro_batch,
                  grad_accum=grad_accum, ac=cfg.train.activation_checkpointing,
                  precision="float8" if cfg.train.float8 else dtype,
                  loss="chunked" if cfg.train.loss == "chunked" else "full",
                  compiled=cfg.train.compile and (d is None or d.world_size == 1) and cfg.train.compile_scope != "blocks",
                  diloco_inner_steps=cfg.parallel.diloco_inner_steps, diloco_fragments=cfg.parallel.diloco_fragments,
                  diloco_sync_delay=cfg.parallel.diloco_sync_delay,
                  diloco_wire_bytes=WIRE_BYTES[cfg.parallel.diloco_comm_dtype], fused_projections=fused,
                  fused_ring_blocks=not cuda and cfg.model.dropout == 0, **pipeline)  # ring_blocks.fused_kernel


def estimate_train_bytes(cfg: JobConfig, dims: ParallelDims | None = None) -> int:
    """One rank's training memory from the one memory model, kiln/plan/memory.py `rank_memory`."""
    vocab, _ = vocab_estimate(cfg)
    shape = ModelShape.from_config(cfg.model, vocab)
    return int(rank_memory(shape, layout_of(cfg, dims), cfg.data.seq_len, cfg.optim.name).total)


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
    """The size key whose value is the largest multiple of its default (ffn_hidden and head_dim
    count only when set explicitly; a vocabulary is compared with data.vocab_size's default)."""
    default = JobConfig()
    vocab, vocab_key = vocab_estimate(cfg)
    candidates = {vocab_key: (vocab, default.data.vocab_size)}
    for key in SIZE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key == "model.ffn_hidden":
            base = ffn_hidden_size(default.model)
        elif key == "model.head_dim":  # 0 by default: compared with the default width of a head
            base = default.model.attention_head_dim()
        else:
            base = getattr(getattr(default, section), name)
        candidates[key] = (value, base)
    key = max(candidates, key=lambda k: candidates[k][0] / max(candidates[k][1], 1))
    return key, candidates[key][0]

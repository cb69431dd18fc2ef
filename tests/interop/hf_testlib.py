"""Tiny kiln runs and tiny HF models for the interop tests (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.config import load_config

TINY_TRAIN = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "data.seq_len=16", "model.max_seq_len=32",
              "train.batch_size=2", "train.dtype=fp32", "train.eval_every=0", "metrics.progress=none",
              "metrics.peak_flops=1e12", "schedule.warmup_steps=1", "optim.lr=1e-2", "data.max_bytes=20000",
              "data.prefetch=1"]
LLAMA = ["model.norm=rmsnorm", "model.activation=swiglu", "model.positions=rope", "model.bias=false"]
GPT2 = ["model.norm=layernorm", "model.activation=gelu", "model.positions=learned", "model.bias=true"]
SAMPLE = "def f(x):\n    return x * 2  # héllo wörld\n"


def train_tiny(run_dir: Path, source: Path, overrides: list[str], steps: int = 2):
    from kiln.train.trainer import train

    cfg = load_config(None, TINY_TRAIN + overrides + [f"data.source={str(source)!r}", f"train.steps={steps}"])
    return train(cfg, run_dir)


def tokens(vocab: int, batch: int = 2, length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def kiln_logits(run_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from kiln.eval.load import load_run

    return load_run(run_dir).model(ids)


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits

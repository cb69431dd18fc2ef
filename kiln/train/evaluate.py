"""Periodic evaluation during training: validation loss, perplexity and bits-per-byte.

The same fixed windows are scored every time (spread evenly over the validation split), so the
curve moves only because the model does. Extra eval sets (`train.eval_sets`, text files) are
tokenized once and reported as NAME_loss / NAME_ppl / NAME_bpb. Windows are cut by
kiln.data.loader and scored by kiln.eval.scoring.score_batches, as `kiln eval` does.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from kiln.config import JobConfig
from kiln.data.corpus import split_documents
from kiln.data.loader import TokenWindows, eval_batches, leading_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.data.shards import ShardSet
from kiln.errors import DataError
from kiln.eval.scoring import score_batches


class Evaluator:
    def __init__(self, model, val_set: ShardSet, tokenizer, cfg: JobConfig, device: torch.device):
        self.model, self.cfg, self.device = model, cfg, device
        self.byte_lengths = torch.from_numpy(token_byte_lengths(tokenizer))
        seq_len, bs = cfg.data.seq_len, cfg.train.batch_size
        try:
            windows = TokenWindows(val_set, seq_len)
        except DataError as e:
            raise DataError(f"{e}; raise data.val_fraction or lower data.seq_len") from None
        self.sets = {"val": list(eval_batches(windows, bs, cfg.train.eval_batches))}
        for path in cfg.train.eval_sets:
            if not Path(path).exists():
                raise DataError(f"train.eval_sets: {path!r} not found")
            name = Path(path).stem.replace("-", "_").replace(".", "_")
            texts = sum(split_documents(path, 0.5, 0), [])
            ids = np.concatenate([np.append(tokenizer.encode_array(t), tokenizer.eos_id) for t in texts])
            stream = TokenWindows([ids.astype(np.int64)], seq_len, source=f"eval set {path}")
            self.sets[name] = list(leading_batches(stream, bs, cfg.train.eval_batches))

    def run(self) -> dict[str, float]:
        results: dict[str, float] = {}
        autocast = autocast_context(self.device, self.cfg.train.dtype)
        for name, batches in self.sets.items():
            scores = score_batches(self.model, batches, self.byte_lengths, device=self.device, autocast=autocast)
            for key in ("loss", "ppl", "bpb"):
                results[f"{name}_{key}"] = scores[key]
        return results


def autocast_context(device: torch.device, dtype: str):
    """bf16/fp16 autocast for the forward pass; fp32 runs without it."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)

"""Periodic evaluation during training: validation loss, perplexity and bits-per-byte.

The same fixed windows are scored every time (spread evenly over the validation split), so the
curve moves only because the model does. Extra eval sets (`train.eval_sets`, text files) are
tokenized once and reported as NAME_loss / NAME_ppl / NAME_bpb.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import torch

from kiln.config import JobConfig
from kiln.data.corpus import split_documents
from kiln.data.tokenizer import token_byte_lengths
from kiln.data.loader import TokenWindows, eval_batches
from kiln.data.shards import ShardSet
from kiln.errors import DataError
from kiln.model.transformer import lm_loss


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
            self.sets[name] = list(_text_batches(torch.from_numpy(ids.astype(np.int64)), seq_len, bs,
                                                 cfg.train.eval_batches, path))

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        results: dict[str, float] = {}
        autocast = autocast_context(self.device, self.cfg.train.dtype)
        for name, batches in self.sets.items():
            total_loss, n_tokens, n_bytes = 0.0, 0, 0
            for x, y in batches:
                x, y = x.to(self.device), y.to(self.device)
                with autocast:
                    loss = lm_loss(self.model(x), y)
                total_loss += loss.item() * y.numel()
                n_tokens += y.numel()
                n_bytes += int(self.byte_lengths[y.cpu()].sum())
            loss = total_loss / n_tokens
            results[f"{name}_loss"] = loss
            results[f"{name}_ppl"] = math.exp(min(loss, 700.0))
            results[f"{name}_bpb"] = total_loss / math.log(2) / max(n_bytes, 1)
        self.model.train(was_training)
        return results


def autocast_context(device: torch.device, dtype: str):
    """bf16/fp16 autocast for the forward pass; fp32 runs without it."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def _text_batches(ids: torch.Tensor, seq_len: int, batch_size: int, max_batches: int, path: str):
    n = (ids.numel() - 1) // seq_len
    if n == 0:
        raise DataError(f"eval set {path} has {ids.numel()} tokens, fewer than data.seq_len+1={seq_len + 1}")
    n = min(n, batch_size * max_batches)
    windows = torch.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    for i in range(0, n, batch_size):
        yield windows[i:i + batch_size, :-1], windows[i:i + batch_size, 1:]

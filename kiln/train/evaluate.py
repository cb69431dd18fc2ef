"""Periodic evaluation during training: validation loss, perplexity and bits-per-byte.

The same fixed windows are scored every time (spread evenly over the validation split), so the
curve moves only because the model does. Extra eval sets (`train.eval_sets`, text files) are
tokenized once and reported as NAME_loss / NAME_ppl / NAME_bpb. Windows are cut by
kiln.data.loader and scored by kiln.eval.scoring.score_batches, as `kiln eval` does; with
data.windows = "packed_masked" they carry their document ids and attention is masked as in
training (the eval sets' documents are their texts, each ending in EOS).

Under parallelism the work is split as in training (torchtitan's validator does the same): each
data-parallel rank scores one block of the windows (kiln.data.loader `rank_batches`), each cp
rank its zig-zag slice of them through the ring, and the sums are all-reduced over data parallel
x cp (the gradient group), so eval time and memory fall with the layout instead of every rank
scoring whole sequences of every window. Under DiLoCo the replicas hold different models between outer steps:
each scores its own, and every rank takes replica 0's numbers (rank 0's, which it logs and saves
as `app`), so early stopping and the plateau schedule decide the same on every rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from kiln.config import JobConfig
from kiln.data.corpus import iter_documents
from kiln.data.loader import TokenWindows, eval_batches, leading_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.data.shards import ShardSet
from kiln.errors import DataError
from kiln.eval.scoring import score_batches


class Evaluator:
    """`dims` (kiln.parallel.dims.ParallelDims) and `context` (the trainer's ContextParallel):
    the layout the evaluation is split over; None: one process scores everything."""

    def __init__(self, model, val_set: ShardSet, tokenizer, cfg: JobConfig, device: torch.device,
                 dims=None, context=None):
        self.model, self.cfg, self.device, self.context = model, cfg, device, context
        rank, size, self.group = eval_share(dims)
        self.agree = dims is not None and dims.world_size > 1
        self.byte_lengths = torch.from_numpy(token_byte_lengths(tokenizer))
        seq_len, bs = cfg.data.seq_len, cfg.train.batch_size
        masked = cfg.data.windows == "packed_masked"  # attention within documents, as in training
        try:
            windows = TokenWindows(val_set, seq_len, doc_ids=masked)
        except DataError as e:
            raise DataError(f"{e}; raise data.val_fraction or lower data.seq_len") from None
        share = (rank, size) if size > 1 else None  # one process: the batches as they always were
        self.sets = {"val": list(eval_batches(windows, bs, cfg.train.eval_batches, share))}
        for path in cfg.train.eval_sets:
            if not Path(path).exists():
                raise DataError(f"train.eval_sets: {path!r} not found")
            name = Path(path).stem.replace("-", "_").replace(".", "_")
            # the documents in the file's own order (each ending in EOS), whatever the path
            texts = [d.text for d in iter_documents(path)]
            if not any(texts):
                raise DataError(f"train.eval_sets: {path!r} has no text")
            docs = [np.append(tokenizer.encode_array(t), tokenizer.eos_id) for t in texts]
            ids = np.concatenate(docs)
            offsets = [np.cumsum([0] + [len(d) for d in docs])] if masked else None
            stream = TokenWindows([ids.astype(np.int64)], seq_len, source=f"eval set {path}", doc_offsets=offsets)
            self.sets[name] = list(leading_batches(stream, bs, cfg.train.eval_batches, share))

    def run(self) -> dict[str, float]:
        results: dict[str, float] = {}
        autocast = autocast_context(self.device, self.cfg.train.dtype)
        for name, batches in self.sets.items():
            scores = score_batches(self.model, batches, self.byte_lengths, device=self.device, autocast=autocast,
                                   context=self.context, group=self.group)
            for key in ("loss", "ppl", "bpb"):
                results[f"{name}_{key}"] = scores[key]
        if self.agree:  # rank 0's numbers everywhere (DiLoCo: replica 0's; otherwise already equal)
            values = torch.tensor(list(results.values()), dtype=torch.float64, device=self.device)
            torch.distributed.broadcast(values, src=0)
            results = dict(zip(results, values.tolist()))
        return results


def eval_share(dims) -> tuple[int, int, object]:
    """(this rank's index among the ranks that split the windows, their number, the process group
    the sums are reduced over or None). The windows are split over data parallel (under DiLoCo
    inside a replica: its dp_shard ranks), the sequences over cp; the group is the gradient
    group (kiln/parallel/data_parallel.py `grad_mesh`: data parallel x cp, replicas excluded
    under DiLoCo), so tp and pp ranks, which see the same batch, are not counted twice."""
    if dims is None or dims.mesh is None or dims.grad_ranks == 1:
        return 0, 1, None
    from kiln.parallel.data_parallel import grad_mesh

    if dims.diloco:
        size = dims.dp_shard
        rank = dims.mesh["dp_shard"].get_local_rank() if size > 1 else 0
    else:
        size, rank = dims.dp_size, dims.dp_rank
    return rank, size, grad_mesh(dims).get_group()


def autocast_context(device: torch.device, dtype: str):
    """bf16/fp16 autocast for the forward pass; fp32 runs without it."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)

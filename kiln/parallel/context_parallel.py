"""Context parallelism over the `cp` mesh dimension: the zig-zag split of every sequence, and the
`ContextParallel` handle the trainer wraps a step in, which runs the model's attention as ring
attention (`parallel.cp_mode = "ring"`, kiln/parallel/ring_attention.py), Ulysses' all-to-alls
(`"ulysses"`, kiln/parallel/ulysses.py), or Ulysses inside groups with the ring across them
(`parallel.ulysses_degree`: `hybrid_groups`, `hybrid_positions`).

Every sequence of a data-parallel rank's batch is split into 2*cp equal chunks; cp rank r keeps
chunks r and 2*cp-1-r ("zig-zag", as in torchtitan / Megatron-LM), so under a causal mask every
rank does the same amount of attention work. Everything outside attention (embeddings, MLPs,
norms, the LM head and the loss) is per token and runs on the local slice unchanged; RoPE uses
the slice's global positions. Each rank's loss is the mean over its slice; the slices are equal
in length, so the mean over the cp group (the trainer's loss all-reduce, and the gradient
average of data parallelism run over dp x cp) is the full-sequence loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.errors import ConfigError
from kiln.parallel.functional import zigzag_chunks
from kiln.parallel.ring_attention import Ring, ring_attention
from kiln.parallel.ulysses import Ulysses


def check_cp_seq_len(cp: int, seq_len: int) -> None:
    """Zig-zag needs 2*cp equal chunks per sequence."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by 2*parallel.cp={2 * cp} (zig-zag "
                          f"context parallel splits each sequence into 2*cp equal chunks); change "
                          f"data.seq_len or parallel.cp")


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token positions of cp rank `rank`'s slice, in the order it holds them."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in zigzag_chunks(cp, rank)])


def hybrid_positions(seq_len: int, cp: int, degree: int, rank: int, device=None) -> torch.Tensor:
    """Global token positions of cp rank `rank` under Ulysses over `degree` consecutive ranks and
    the ring across the cp / degree groups: its group's zig-zag chunks on that ring, each cut in
    `degree` pieces, piece `rank % degree` of each."""
    ring_chunks = zigzag_positions(seq_len, cp // degree, rank // degree, device).view(2, degree, -1)
    return ring_chunks[:, rank % degree].reshape(-1)


def hybrid_groups(mesh, degree: int):
    """(this rank's Ulysses group, its ring group) of every cp group of `mesh` (a DeviceMesh with a
    "cp" dimension): `degree` consecutive cp ranks, and the ranks `degree` apart. Every rank
    creates every group, in one order (torch.distributed.new_group's rule)."""
    cp_dim = mesh.mesh_dim_names.index("cp")
    me, heads, ring = dist.get_rank(), None, None
    for ranks in mesh.mesh.movedim(cp_dim, -1).reshape(-1, mesh.size(cp_dim)).tolist():
        for members in [ranks[a:a + degree] for a in range(0, len(ranks), degree)]:
            group = dist.new_group(members)
            heads = group if me in members else heads
        for members in [ranks[j::degree] for j in range(degree)]:
            group = dist.new_group(members)
            ring = group if me in members else ring
    return heads, ring



class ContextParallel:
    """The trainer's handle: `shard` slices a batch, and `with cp:` runs the model's attention as
    ring attention (dims.cp_mode 'ring') or Ulysses' (kiln/parallel/ulysses.py) with this rank's
    global positions. With cp == 1 both are no-ops."""

    def __init__(self, model, dims, seq_len: int, device: torch.device):
        self.model, self.cp = model, dims.cp
        if self.cp == 1:
            return
        check_cp_seq_len(self.cp, seq_len)
        self.ring = Ring(dims.mesh["cp"].get_group())
        self.index = zigzag_positions(seq_len, self.cp, self.ring.rank, device=device)
        self.ulysses = None
        if dims.cp_mode == "ulysses":
            degree = dims.ulysses_degree or self.cp
            expand_kv = any(m.expand_kv for m in _attention_modules(model))  # kiln/train/attention.py's choice
            if degree == self.cp:
                self.ulysses = Ulysses(self.ring.group, self.cp, expand_kv=expand_kv, rounds=dims.ulysses_rounds)
            else:  # Ulysses inside groups of `degree` ranks, the ring across them
                heads, ring = hybrid_groups(dims.mesh, degree)
                self.ulysses = Ulysses(heads, degree, Ring(ring), expand_kv=expand_kv, rounds=dims.ulysses_rounds)
                self.index = hybrid_positions(seq_len, self.cp, degree, self.ring.rank, device=device)
            self.attention = self.ulysses.attention

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cp == 1:
            return x, y
        return x.index_select(1, self.index), y.index_select(1, self.index)

    def attention(self, q, k, v, dropout_p: float = 0.0, window: int = 0, doc_ids=None):
        return ring_attention(q, k, v, self.ring, dropout_p, window=window, doc_ids=doc_ids)

    def __enter__(self):
        if self.cp > 1:
            self.model.seq_positions = self.index
            # Ulysses alone attends whole sequences; the ring masks from the ids
            self.model.cp_whole_masks = self.ulysses is not None and self.ulysses.ring is None
            for module in _attention_modules(self.model):
                module.attention_fn = self.attention
            for moe in _moe_modules(self.model):  # capacity and aux loss per whole sequence
                moe.cp_group = self.ring.group
        return self

    def __exit__(self, *exc):
        if self.cp > 1:
            self.model.seq_positions = None
            self.model.cp_whole_masks = False
            for module in _attention_modules(self.model):
                module.attention_fn = None
            for moe in _moe_modules(self.model):
                moe.cp_group = None
        return False


def _attention_modules(model):
    # Found by type, so checkpoint- or compile-wrapped blocks are covered too.
    from kiln.model.transformer import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def _moe_modules(model):
    from kiln.model.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]

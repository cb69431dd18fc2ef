"""Muon's Newton-Schulz iterations in the step time: the matmuls of orthogonalizing every hidden
matrix, per rank.

Muon (kiln/train/optimizers/muon.py) orthogonalizes each hidden matrix of shape (r, c), s = min,
l = max, by 5 quintic steps, each a Gram matrix (s x l times l x s: 2 s^2 l FLOPs), its square
(2 s^3) and the polynomial times the matrix (2 s^2 l): 5 (4 s^2 l + 2 s^3) FLOPs. Which matrices a
rank orthogonalizes follows kiln/train/optimizers/muon_split.py: a matrix one mesh dimension cuts
is dealt to one of that dimension's ranks (FSDP / ZeRO-2 over dp_shard x cp with tp = 1; tensor
parallel's tp under ddp); DDP's whole matrices are dealt over the replicas (dp x cp) and broadcast
(the broadcasts are in timing.py's data-parallel traffic); one cut by two (FSDP over tp) is gathered over one and dealt over the
other (tp for a column-parallel weight, whose FSDP cut is strided; the wider of the two for a
row-parallel one); ZeRO-1 steps each matrix on its owner; an expert stack is orthogonalized per expert where its
experts live (E / ep per rank, FSDP's whole experts over the expert data-parallel shards), dealt
over tp where tp splits the experts' hidden units. Replicas (DDP, HSDP's replicate) each run their
own share. The iterations run in bf16 on GPUs and fp32 on CPUs (`orthogonalize`), at the device's
matmul efficiency for a pass of s x l.
"""

from __future__ import annotations

from kiln.plan.cluster import Cluster
from kiln.plan.memory import Layout, ModelShape

NS_STEPS = 5  # kiln/train/optimizers/muon.py NS_STEPS (not imported: the planner runs without torch)


def newton_schulz_flops(rows: int, cols: int) -> float:
    """FLOPs of orthogonalizing one (rows, cols) matrix."""
    s, l_ = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * s * s * l_ + 2 * s ** 3)


def _matrices(shape: ModelShape) -> tuple[list[tuple[int, int, float, str]], list[tuple[int, int, float]]]:
    """(dense, expert) matrices Muon orthogonalizes in the whole model: dense as (rows, cols, count,
    how tensor parallel cuts it: "col" | "row" | "none"), experts as (rows, cols, count); the
    embeddings, the head, norms and biases are AdamW's."""
    d, q, kv = shape.dim, shape.q_dim, shape.kv_dim
    ffn_mats = 3 if shape.gated else 2
    dense_layers = shape.n_layers - shape.moe_layers
    dense = [(q, d, shape.n_layers, "col"), (kv, d, 2 * shape.n_layers, "col"), (d, q, shape.n_layers, "row"),
             (shape.ffn, d, (ffn_mats - 1) * dense_layers, "col"), (d, shape.ffn, dense_layers, "row")]
    experts = []
    if shape.moe_layers:
        dense.append((shape.moe_experts, d, shape.moe_layers, "none"))  # the router, replicated over tp
        if shape.shared_ffn:
            dense += [(shape.shared_ffn, d, (ffn_mats - 1) * shape.moe_layers, "col"),
                      (d, shape.shared_ffn, shape.moe_layers, "row")]
            if shape.shared_gate:
                dense.append((1, d, shape.moe_layers, "none"))
        experts.append((shape.expert_ffn or shape.ffn, d, ffn_mats * shape.moe_layers * shape.moe_experts))
    return dense, experts


def dense_dealt_over(layout: Layout, tp_cut: str = "col") -> int:
    """Ranks a dense matrix's Newton-Schulz is split over (1: every rank runs it), by how tensor
    parallel cuts it (`tp_cut`)."""
    cut_by_tp = layout.tp if tp_cut != "none" else 1
    if layout.dp_mode in ("fsdp", "zero2"):
        shards = layout.dp_shard * layout.cp
        if cut_by_tp == 1:
            return shards
        # FSDP over tp: gathered over all but the widest plain Shard dim; a column-parallel
        # weight's FSDP cut is strided (the same dim as tp's), so tp's is the one kept
        return max(shards, layout.tp) if tp_cut == "row" else layout.tp
    if layout.dp_mode == "zero1":
        # each matrix stepped by its owner; under tp the owners' tp group deals tp's cut ones out
        return layout.dp * layout.cp * cut_by_tp
    if layout.tp == 1:  # ddp: whole matrices dealt over the replicas (and broadcast: timing.py)
        return layout.dp * layout.cp
    return cut_by_tp  # ddp x tp: tp's cut, the replicas alike


def expert_dealt_over(layout: Layout) -> float:
    """Ranks sharing one rank's experts' Newton-Schulz: ep (each rank its experts), FSDP's whole
    experts over the expert shards, tp where it splits the experts' hidden units; without ep,
    ZeRO-1 steps each stack on its owner."""
    shards = 1
    if layout.dp_mode in ("zero1", "ddp") and layout.ep == 1 and layout.tp == 1:
        return layout.dp * layout.cp  # plain parameters: ZeRO-1 partitions them, DDP's replicas deal them out
    if layout.dp_mode in ("fsdp", "zero2"):
        shards = max(1, layout.dp_shard * layout.cp * (layout.tp if layout.ep_borrows_tp else 1) // layout.ep)
    return layout.ep * shards * layout.expert_tp


def muon_seconds(shape: ModelShape, layout: Layout, cluster: Cluster, share: float = 1.0) -> float:
    """Wall seconds one rank spends in Newton-Schulz per optimizer step (its pipeline stage's
    matrices; at `share` of a device where ranks share cores)."""
    return sum(muon_seconds_by_part(shape, layout, cluster, share))


def muon_seconds_by_part(shape: ModelShape, layout: Layout, cluster: Cluster,
                         share: float = 1.0) -> tuple[float, float]:
    """`muon_seconds` as (dense matrices, experts)."""
    dev = cluster.device
    peak = dev.peak_flops("fp32" if cluster.backend == "gloo" else "bf16")
    dense, experts = _matrices(shape)
    parts = []
    for matrices in ([(r, c, n, dense_dealt_over(layout, cut)) for r, c, n, cut in dense],
                     [(r, c, n, expert_dealt_over(layout)) for r, c, n in experts]):
        seconds = 0.0
        for rows, cols, count, over in matrices:
            eff = dev.efficiency(min(rows, cols) * max(rows, cols))
            seconds += count * newton_schulz_flops(rows, cols) / (peak * eff) / over
        parts.append(seconds / layout.pp / share)
    return parts[0], parts[1]

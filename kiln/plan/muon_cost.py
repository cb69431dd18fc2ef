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

`muon_exchanges`: the communication of that split (muon_split.py), per optimizer step: each
mesh dimension a split runs over takes two all-to-alls per round (the shards of the fp32 momentum
updates to their owners, the results back), and a matrix FSDP over tp cuts twice is first gathered
over one of the two (one all-gather per matrix, DTensor's redistribute).
"""

from __future__ import annotations

import math

from kiln.plan.cluster import Cluster
from kiln.plan.comm_cost import all_gather, all_to_all
from kiln.plan.memory import Layout, ModelShape

NS_STEPS = 5  # kiln/train/optimizers/newton_schulz.py NS_STEPS (not imported: the planner runs without torch)
ROUND_BYTES = 2**29  # kiln/train/optimizers/muon_split.py ROUND_BYTES: whole matrices per owner per round


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


def muon_exchanges(shape: ModelShape, layout: Layout, cluster: Cluster) -> tuple[float, dict[str, float]]:
    """(seconds, collective calls by op) of one rank's Muon exchanges per optimizer step (module
    docstring): the dense matrices split over FSDP's dp_shard x cp ranks (tp = 1), over tp (ddp /
    zero1 x tp; zero1 on the owners' tp ranks, each replica its 1/(dp x cp) of the matrices), or
    under FSDP x tp gathered over one and split over the other (the column-parallel ones over tp,
    the row-parallel ones over the wider); the experts' hidden units split over tp (etp = tp).
    Replicated matrices (routers) and whole experts need none; DDP's broadcasts (tp = 1) are
    timing.py's. Bytes: fp32 updates, a rank's local shard of each matrix it takes part in."""
    dense, experts = _matrices(shape)
    fsdp = layout.dp_mode in ("fsdp", "zero2")
    shards, tp = (layout.dp_shard * layout.cp if fsdp else 1), layout.tp
    owners = layout.dp * layout.cp if layout.dp_mode == "zero1" and tp > 1 else 1  # ZeRO-1's replicas split them
    held = {}  # (ranks, stride) the split runs over -> fp32 bytes a rank holds of its matrices
    gathers = []  # (ranks, stride, bytes gathered, calls): FSDP over tp narrowed to one cut
    for rows, cols, count, cut in dense:
        whole = 4.0 * rows * cols * count / layout.pp / owners
        by_tp = tp if cut != "none" else 1
        if fsdp and by_tp > 1 and shards > 1:
            keep_tp = cut == "col" or tp >= shards  # the widest plain Shard, ties to tp (muon_split `_to_one_cut`)
            over, gather = ((tp, 1), (shards, tp)) if keep_tp else ((shards, tp), (tp, 1))
            gathers.append((gather[0], gather[1], whole / over[0], count / layout.pp))
            held[over] = held.get(over, 0.0) + whole / over[0]
        elif fsdp and shards > 1:
            held[(shards, tp)] = held.get((shards, tp), 0.0) + whole / (shards * by_tp)
        elif by_tp > 1:
            held[(tp, 1)] = held.get((tp, 1), 0.0) + whole / tp
    if experts and layout.expert_tp > 1:  # the experts a rank holds, their hidden units cut over tp
        expert_shards = max(1, layout.expert_dp if fsdp else 1)
        local = sum(4.0 * r * c * n for r, c, n in experts) / (layout.pp * layout.ep * expert_shards * tp)
        held[("experts", tp)] = local  # a mesh of their own: a split of its own
    seconds, calls = 0.0, {}
    for (ranks, stride), nbytes in held.items():
        n, stride = (tp, 1) if ranks == "experts" else (ranks, stride)
        rounds = max(1, math.ceil(nbytes / ROUND_BYTES))  # an owner's whole matrices: about what a rank holds
        seconds += 2 * all_to_all(cluster, n, nbytes, stride, calls=rounds)
        calls["all_to_all"] = calls.get("all_to_all", 0) + 2 * rounds
    for ranks, stride, nbytes, matrices in gathers:
        seconds += all_gather(cluster, ranks, nbytes, stride, calls=matrices)
        calls["all_gather"] = calls.get("all_gather", 0) + matrices
    return seconds, calls

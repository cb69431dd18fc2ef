"""DiLoCo in the planner's models: what kiln/parallel/diloco.py adds to a layout's memory and step
time, and where its replicas go on a cluster.

kiln's DiLoCo replicas are the `dp_replicate` ranks (under ddp every data-parallel rank); inside a
replica the layout is any kiln layout of the rest (`kiln/parallel/dims.py diloco_layout`), and no
gradient crosses replicas. So a DiLoCo layout costs what one replica's layout costs on the ranks
of one replica (`Layout.replica`: dp_replicate 1, the same dp_shard, tp, pp, cp, ep), plus:

memory: the outer state, fp32 and sharded like the parameters (the anchor and the Nesterov
  momentum): twice the parameters term (kiln keeps fp32 parameters), divided by S where S ranks
  of a replica hold the same parameters (ddp/zero1: each keeps 1/S of it, `replicated_ranks`). The outer step's flat fp32
  buffer, one more parameters term, lives only after the optimizer step, when the step has set
  the gradients (fp32, the same shards) to None (kiln/train/step.py), so it adds nothing to the
  peak; with a sync delay the exchange buffer of a fragment (1/P of the parameters, in the wire
  dtype, 1/S of that) lives on through the inner steps it overlaps, and is added;
time: every H = `diloco_inner_steps` steps one all-reduce over the R replicas of every rank's
  parameter shards in fp32 (what `DiLoCo.outer_step` sends; where S ranks of a replica hold the
  same parameters, ddp/zero1, each sends 1/S and they all-gather the result inside the replica),
  which blocks the loop, plus the outer
  step's memory traffic, 48 bytes per parameter of the shard (flatten: read 4, write 4; the delta:
  read 8, write 4; torch's Nesterov SGD: read 12, write 8; the reset: read 4, write 4), where
  the delta and the SGD step (32 of them) cover 1/S of it, both divided by H for the per-step
  figure. Streaming DiLoCo: P syncs of 1/P of it each per H steps (the same bytes, a P times
  smaller peak on the link), the outer gradient in `diloco_wire_bytes` per element (bf16: half,
  all-reduced; float8: a quarter plus a 4-byte scale per 256, all-gathered: R - 1 payloads per rank),
  and each exchange hidden behind up to `diloco_sync_delay` inner steps of the replica's step
  time (it runs on the link between replicas while the replica computes and uses its own links;
  a link the inner step's collectives share is not modelled).

Where the replicas are: on a cluster of `islands` (kiln/plan/cluster.py; groups of nodes joined by
a slow link, the setting DiLoCo is for) one replica per island, and every rank's ring all-reduce
runs at once, so an island's link carries its whole replica: 2(R-1)/R of the replica's bytes per
outer step through `island_link_gbps` (or each device's inter-node link, whichever is slower),
with 2(R-1) steps of `island_link_latency_ms`; without islands, replicas are consecutive ranks and
the all-reduce runs over the link its group spans (kiln/plan/comm_cost.py). Hand-written model
(no torch API predicts it); the replica's own terms are kiln/plan/memory.py and timing.py's, which
call this module for a DiLoCo layout (it imports neither's step, so the two stay one-way).
The replica's ranks are taken as equally full (the fullest rank's shard for all of them, an upper
bound under pp, whose middle stages hold no embedding or head).
"""

from __future__ import annotations

import dataclasses
import math

from kiln.errors import KilnError
from kiln.plan.cluster import Cluster
from kiln.plan.comm_cost import all_gather, all_reduce
from kiln.plan.memory import Layout, replicated_ranks  # noqa: F401 (replicated_ranks: re-exported)

OUTER_STEP_BYTES = 48  # memory traffic of the outer step per fp32 parameter of the shard (docstring)
# parallel.diloco_comm_dtype: bytes per element on the wire; float8 is all-gathered (every replica's
# bytes to every rank) with one fp32 scale per FP8_BLOCK elements (kiln/parallel/diloco_fragment.py)
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
FP8_SCALE_BYTES = 4 / 256  # per element: diloco_fragment.FP8_BLOCK (not imported: that module imports torch)
OUTER_STEP_SLICE_BYTES = 32  # of which the delta and the SGD step, on 1/S of it where S ranks split it


def check_islands(cluster: Cluster, diloco_inner_steps: int) -> int:
    """The DiLoCo replicas kiln plan lays out on `cluster` (one per island; 1 without DiLoCo), or
    a KilnError when the cluster and the config disagree: DiLoCo needs islands to put replicas
    on, and a cluster of islands is modelled only as DiLoCo's (the other layouts' time model
    knows no island link, so a gradient all-reduce across islands would be mispredicted)."""
    if diloco_inner_steps and cluster.islands == 1:
        raise KilnError(f"parallel.diloco_inner_steps={diloco_inner_steps}: kiln plan puts one DiLoCo replica on "
                        f"each island of the cluster, and {cluster.name} has one island; set `islands` in the "
                        f"cluster file or pass --islands N (N replicas, N dividing the nodes)")
    if not diloco_inner_steps and cluster.islands > 1:
        raise KilnError(f"cluster {cluster.name} has islands={cluster.islands}: kiln plan models training across "
                        f"islands only as DiLoCo replicas, one per island; set parallel.diloco_inner_steps, or plan "
                        f"one island (--islands 1 --nodes {cluster.nodes_per_island})")
    return cluster.islands if diloco_inner_steps else 1


def replica_cluster(cluster: Cluster, layout: Layout) -> Cluster:
    """The part of `cluster` one replica of `layout` runs on: one island, or without islands the
    nodes its consecutive ranks fill, with their share of a node's cores where processes
    time-share them (`cores_per_node`: a node holding ranks of several replicas)."""
    replicas = layout.dp_replicate
    if cluster.islands > 1:
        if replicas != cluster.islands:
            raise KilnError(f"a DiLoCo layout of {replicas} replicas on {cluster.islands} islands: kiln plan puts "
                            f"one replica on each island")
        return dataclasses.replace(cluster, nodes=cluster.nodes_per_island, islands=1)
    ranks = layout.replica.world_size
    replica = dataclasses.replace(cluster, nodes=max(1, math.ceil(ranks / cluster.gpus_per_node)))
    if cluster.cores_per_node > 0:  # CPU processes time-share a node's cores with the other replicas' there
        here = min(layout.world_size, cluster.gpus_per_node)
        replica.cores_per_node = cluster.cores_per_node * min(ranks, cluster.gpus_per_node) / here
    return replica


def outer_sync_seconds(cluster: Cluster, layout: Layout, shard_bytes: float, inner_step_s: float = 0.0) -> float:
    """One outer sync of one fragment of `layout` on `cluster` (the whole model without Streaming
    DiLoCo), not divided by H: the all-reduce over the replicas of every rank's part of its share
    of `shard_bytes` (fp32 parameters; 1/P per fragment; 1/S where S ranks of a replica hold the
    same ones, `replicated_ranks`, which then all-gather the fp32 result inside the replica),
    in `diloco_wire_bytes` per element, less what `diloco_sync_delay` inner steps of
    `inner_step_s` hide (the exchange overlaps them); the all-gather and the step's memory traffic
    over the fragment stay exposed."""
    replicas, ranks = layout.dp_replicate, layout.replica.world_size
    split = replicated_ranks(layout)
    fragment = shard_bytes / layout.diloco_fragments
    gathered = layout.diloco_wire_bytes == 1  # float8: an all-gather of every replica's block-scaled bytes
    sent = fragment / split * (layout.diloco_wire_bytes + (FP8_SCALE_BYTES if gathered else 0)) / 4
    if cluster.islands > 1:
        link_s = max(sent / (cluster.inter_node.bandwidth_gbps * 1e9),
                     sent * ranks / (cluster.island_link_gbps * 1e9))
        # a ring all-reduce moves 2(R-1)/R of the payload in 2(R-1) steps, an all-gather R-1 payloads in R-1
        hops = (replicas - 1) if gathered else 2 * (replicas - 1)
        sync = (hops / (1 if gathered else replicas)) * link_s + hops * cluster.island_link_latency_ms * 1e-3
    elif gathered:
        sync = all_gather(cluster, replicas, sent * replicas, stride=ranks)
    else:
        sync = all_reduce(cluster, replicas, sent, stride=ranks)
    sync = max(0.0, sync - layout.diloco_sync_delay * inner_step_s)
    if split > 1:  # the averaged slices gathered inside the replica (its data-parallel ranks, tp apart)
        sync += all_gather(cluster, split, fragment, stride=layout.tp)
    per_param = OUTER_STEP_BYTES - OUTER_STEP_SLICE_BYTES + OUTER_STEP_SLICE_BYTES / split
    step = per_param * fragment / 4 / (cluster.device.memory_bandwidth_gbps * 1e9)
    return sync + step

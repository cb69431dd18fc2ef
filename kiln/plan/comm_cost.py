"""Collective costs for the step-time model (kiln/plan/timing.py): alpha-beta forms of each
collective over the cluster's links. Hand-written formulas (no torch API predicts a collective's
time); the collectives themselves are torch's, timed by kiln/plan/collectives.py.

Collective costs (n ranks, S bytes, alpha latency, B bandwidth per rank and direction), the
textbook ring forms (Thakur et al. 2005; NCCL's docs use the same bus-bandwidth factors):
  all-reduce 2(n-1)/n * S/B + 2(n-1) alpha  (in-network reduction: S/B + 2 alpha across nodes)
  all-gather / reduce-scatter (n-1)/n * S/B + (n-1) alpha,  all-to-all (n-1)/n * S/B + (n-1) alpha,
  broadcast S/B + (n-1) alpha (pipelined chain).
Every call pays its latency steps: traffic split over k calls costs k times the alpha term.
A group that spans nodes runs at the inter-node link (one NIC per GPU); a rail-only network adds
an NVLink hop to all-to-all, which leaves its rail. On gloo (`cluster.backend`) a reduce-scatter
costs an all-reduce: ProcessGroupGloo reduces the whole tensor, then keeps a shard.
"""

from __future__ import annotations

from kiln.plan.cluster import Cluster, LinkSpec


def _link(cluster: Cluster, group: int, stride: int) -> tuple[LinkSpec, bool]:
    """The link a group of `group` ranks spaced `stride` apart uses, and whether it spans nodes."""
    spans = group > 1 and group * stride > cluster.gpus_per_node
    return (cluster.inter_node if spans else cluster.intra_node), spans


def all_reduce(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """`nbytes` in all, split over `calls` collectives (each pays the latency steps)."""
    if n <= 1:
        return 0.0
    link, spans = _link(cluster, n, stride)
    alpha, bw = link.latency_us * 1e-6, link.bandwidth_gbps * 1e9
    if spans and link.in_network_reduction:
        return nbytes / bw + 2 * alpha * calls
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha * calls


def all_gather(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """Also reduce-scatter: `nbytes` is the full (unsharded) size, in all, over `calls` collectives."""
    if n <= 1:
        return 0.0
    link, _ = _link(cluster, n, stride)
    return (n - 1) / n * nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6 * calls


def reduce_scatter(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """`nbytes` the full (unsharded) size, in all, over `calls` collectives: an all-gather's cost,
    or on gloo an all-reduce's (ProcessGroupGloo reduces the whole tensor, then keeps a shard)."""
    if cluster.backend == "gloo":
        return all_reduce(cluster, n, nbytes, stride, calls)
    return all_gather(cluster, n, nbytes, stride, calls)


def broadcast(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """`calls` broadcasts of `nbytes` in all from one root each: pipelined over a chain (NCCL's
    ring broadcast, bus-bandwidth factor 1), S/B + (n-1) alpha per call."""
    if n <= 1:
        return 0.0
    link, _ = _link(cluster, n, stride)
    return nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6 * calls


def all_to_all(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """`nbytes` each rank holds before the exchange, in all, over `calls` collectives."""
    if n <= 1:
        return 0.0
    link, spans = _link(cluster, n, stride)
    t = (n - 1) / n * nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6 * calls
    if spans and link.topology == "rail_only":
        t += all_gather(cluster, min(n, cluster.gpus_per_node), nbytes)  # the hop onto the right rail
    return t


def p2p(cluster: Cluster, nbytes: float, spans: bool) -> float:
    link = cluster.inter_node if spans else cluster.intra_node
    return nbytes / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6

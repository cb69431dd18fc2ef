"""Step-time model: compute from FLOPs and the device efficiency curve, each collective from an
alpha-beta model of the cluster's links, pipeline bubbles per schedule, and overlap of
communication with compute where the strategy allows it.

Collective costs (n ranks, S bytes, alpha latency, B bandwidth per rank and direction), the
textbook ring forms (Thakur et al. 2005; NCCL's docs use the same bus-bandwidth factors):
  all-reduce 2(n-1)/n * S/B + 2(n-1) alpha  (in-network reduction: S/B + 2 alpha across nodes)
  all-gather / reduce-scatter (n-1)/n * S/B + (n-1) alpha,  all-to-all (n-1)/n * S/B + (n-1) alpha,
  broadcast S/B + (n-1) alpha (pipelined chain).
Every collective call pays its latency steps: a mode's traffic split over k calls costs k times
the alpha term (DDP: one all-reduce per bucket; ZeRO-1: one broadcast per parameter tensor, as
torch's ZeroRedundancyOptimizer does; FSDP2: one all-gather and one reduce-scatter per group).
A group that spans nodes runs at the inter-node link's bandwidth (one NIC per GPU); a rail-only
network adds an NVLink hop to all-to-all, which leaves its rail. FLOPs per token are the PaLM
convention 6N + 12*L*dim*seq (Chowdhery et al. 2022, appendix B), plus one more forward for
recomputed blocks.

Host-side terms (what a GPU hides and a CPU/gloo run does not): each collective call costs the
cluster's `collective_launch_us` (dispatch, FSDP2's per-group hooks and buffer setup) on top of
the link's alpha; FSDP2 copies parameters into and out of its all-gather buffer and gradients into
its reduce-scatter buffer, and DDP copies gradients into and out of its buckets, at the device's
memory bandwidth; when the processes of a node outnumber `cores_per_node`, compute, the optimizer
step and that host work run at cores / processes of a core each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.plan.cluster import Cluster, LinkSpec
from kiln.plan.memory import DDP_BUCKET_BYTES, Layout, ModelShape, recomputed_blocks

FIRST_BUCKET_BYTES = 2**20


@dataclass
class StepTime:
    compute: float
    comm_exposed: float
    comm_total: float
    bubble: float
    optimizer: float
    flops: float  # model FLOPs of the whole step, all ranks (for MFU; no recompute)
    host: float = 0.0  # collective launches and communication-buffer copies
    collectives: int = 0  # collective calls one rank issues per step

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed + self.bubble + self.optimizer + self.host

    def mfu(self, cluster: Cluster, precision: str, world: int) -> float:
        return self.flops / (self.total * world * cluster.device.peak_flops(precision))


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


def broadcast(cluster: Cluster, n: int, nbytes: float, stride: int = 1, calls: int = 1) -> float:
    """`calls` broadcasts of `nbytes` in all from one root each: pipelined over a chain (NCCL's
    ring broadcast, bus-bandwidth factor 1), S/B + (n-1) alpha per call."""
    if n <= 1:
        return 0.0
    link, _ = _link(cluster, n, stride)
    return nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6 * calls


def all_to_all(cluster: Cluster, n: int, nbytes: float, stride: int = 1) -> float:
    if n <= 1:
        return 0.0
    link, spans = _link(cluster, n, stride)
    t = (n - 1) / n * nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6
    if spans and link.topology == "rail_only":
        t += all_gather(cluster, min(n, cluster.gpus_per_node), nbytes)  # the hop onto the right rail
    return t


def p2p(cluster: Cluster, nbytes: float, spans: bool) -> float:
    link = cluster.inter_node if spans else cluster.intra_node
    return nbytes / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6


def bubble_fraction(layout: Layout) -> float:
    """Idle time of a pipeline step relative to its compute: (pp-1)/m for gpipe and 1f1b,
    (pp-1)/(m*v) for interleaved 1F1B (Narayanan et al. 2021, sec. 2.2)."""
    if layout.pp == 1:
        return 0.0
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    return (layout.pp - 1) / (layout.grad_accum * v)


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduces DDP issues per step: a first bucket of 1 MiB (torch's
    _DEFAULT_FIRST_BUCKET_BYTES), then buckets of bucket_cap_mb (kiln: 25 MiB)."""
    rest = max(0.0, grad_bytes - FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / DDP_BUCKET_BYTES)


def fsdp_units(shape: ModelShape, layout: Layout) -> int:
    """FSDP2 parameter groups per stage: one per block and the root's (kiln/parallel/parallelize.py
    apply_fsdp), each gathered and reduced by its own collective."""
    return -(-shape.n_layers // layout.pp) + 1


def compute_share(cluster: Cluster, layout: Layout) -> float:
    """The fraction of a device each rank computes at: 1, or cores / processes when a node's
    processes outnumber its `cores_per_node` (CPU processes time-share the cores)."""
    if cluster.cores_per_node <= 0:
        return 1.0
    ranks = min(layout.world_size, cluster.gpus_per_node)
    return min(1.0, cluster.cores_per_node / ranks)


def step_time(shape: ModelShape, layout: Layout, seq_len: int, cluster: Cluster,
              optimizer_bytes_per_param: int = 8) -> StepTime:
    """Predicted wall time of one optimizer step (grad_accum micro-batches) on every rank."""
    dev = cluster.device
    tokens_rank_mb = layout.micro_batch * seq_len / layout.cp  # tokens one rank computes per micro-batch
    non_embed = shape.params - shape.embedding_params + shape.vocab * shape.dim  # the LM head matmul counts
    flops_token = 6 * non_embed + 12 * shape.n_layers * shape.dim * seq_len
    global_tokens = layout.micro_batch * seq_len * layout.grad_accum * layout.dp
    model_flops = flops_token * global_tokens
    # Recompute adds one forward (a third of 6N) of the recomputed blocks.
    recompute = recomputed_blocks(layout.ac, shape.n_layers) / shape.n_layers
    layer_flops_token = 6 * shape.layer_params + 12 * shape.dim * seq_len
    rank_flops_mb = (flops_token + recompute * layer_flops_token * shape.n_layers / 3) * tokens_rank_mb
    rank_flops_mb /= layout.tp * layout.pp
    work = tokens_rank_mb * shape.dim / layout.tp  # a matmul's M*K scale on this rank
    share = compute_share(cluster, layout)  # wall time below: at this rank's share of a device
    t_mb = rank_flops_mb / (dev.peak_flops(layout.precision) * dev.efficiency(work) * share)
    compute = t_mb * layout.grad_accum

    act = {"fp32": 4}.get(layout.precision, 2)
    param_bytes = 4 if layout.precision == "fp32" else 2
    stage_params = (shape.embedding_params + shape.n_layers * shape.layer_params / layout.pp) / layout.tp
    exposed, total = 0.0, 0.0
    calls, copied = 0, 0.0  # collective calls and bytes copied through communication buffers
    stage_layers = shape.n_layers / layout.pp

    # Tensor (sequence) parallel: per block 2 all-gathers + 2 reduce-scatters forward, as many
    # backward, of the block's activations; on the critical path.
    if layout.tp > 1:
        nbytes = act * tokens_rank_mb * shape.dim
        t = 8 * all_gather(cluster, layout.tp, nbytes) * stage_layers * layout.grad_accum
        calls += round(8 * stage_layers * layout.grad_accum)
        exposed += t
        total += t
    # Context parallel (ring attention): K and V pass around the ring, hidden behind attention.
    if layout.cp > 1:
        kv_bytes = 2 * act * tokens_rank_mb * shape.kv_dim / layout.tp
        t = 3 * (layout.cp - 1) * p2p(cluster, kv_bytes, False) * stage_layers * layout.grad_accum
        calls += round(3 * (layout.cp - 1) * stage_layers * layout.grad_accum)
        attn_compute = t_mb * layout.grad_accum * 0.3
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, attn_compute))
        total += t
    # Pipeline: stage-boundary activations forward and their gradients backward per micro-batch.
    if layout.pp > 1:
        spans = layout.pp * layout.tp * layout.cp > cluster.gpus_per_node
        t = 2 * p2p(cluster, act * tokens_rank_mb * shape.dim / layout.tp, spans) * layout.grad_accum
        calls += 2 * layout.grad_accum
        exposed += t
        total += t
    # Data parallel: gradient reduction (+ parameter gathers for sharded modes), over dp x cp: the
    # cp ranks of a replica hold the same weights and average their gradients too (kiln and
    # torchtitan shard FSDP over dp_shard x cp).
    dp_stride = layout.tp
    replicas, shards = layout.dp_replicate, layout.dp_shard * layout.cp
    if layout.dp_mode in ("ddp", "zero1"):
        replicas, shards = layout.dp * layout.cp, 1
    if replicas * shards > 1:
        grad_bytes = 4 * stage_params
        if layout.dp_mode in ("ddp", "zero1"):
            buckets = ddp_buckets(grad_bytes)
            t = all_reduce(cluster, replicas, grad_bytes, dp_stride, calls=buckets)
            calls += buckets
            copied += 2 * grad_bytes  # gradients into the buckets and back
            if layout.dp_mode == "zero1":  # ZeroRedundancyOptimizer broadcasts each updated parameter
                tensors = shape.param_tensors(layout.pp)
                t += broadcast(cluster, replicas, 4 * stage_params, dp_stride, calls=tensors)
                calls += tensors
            overlappable = compute * 2 / 3 / layout.grad_accum  # only the last micro-batch's backward
        else:
            units = fsdp_units(shape, layout)
            # FSDP2 all-gathers each unit before its forward and (fsdp: resharded after forward)
            # again before its backward, except the last block and the root, which backward needs
            # first; it reduce-scatters each unit's gradients once per step.
            gathers, gathered = units, stage_params
            if layout.dp_mode == "fsdp":
                gathers += units - 2
                gathered += (units - 2) * shape.layer_params / layout.tp
            gathers *= layout.grad_accum
            shard = shards
            gather_bytes = param_bytes * gathered * layout.grad_accum
            t = all_gather(cluster, shard, gather_bytes, dp_stride, calls=gathers)
            t += all_gather(cluster, shard, grad_bytes, dp_stride, calls=units)  # reduce-scatter
            t += all_reduce(cluster, replicas, grad_bytes / shard, dp_stride * shard, calls=units)  # HSDP
            calls += gathers + units * (2 if replicas > 1 else 1)
            # copy-in of the local shard and copy-out of the gathered unit; gradients into the
            # reduce-scatter buffer and the reduced shard out
            copied += gather_bytes * (1 + 1 / shard) + grad_bytes * (1 + 1 / shard)
            overlappable = compute
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, overlappable))
        total += t
    bubble = compute * bubble_fraction(layout)
    # The optimizer step reads/writes weights, grads and state once: memory-bandwidth bound.
    shard = replicas * shards if layout.dp_mode != "ddp" else 1
    opt_bytes = stage_params / shard * (2 * 4 + 4 + 2 * optimizer_bytes_per_param)
    mem_bw = dev.memory_bandwidth_gbps * 1e9
    optimizer = opt_bytes / mem_bw / share
    # Host work: each copy reads and writes its bytes; each call pays the launch cost.
    host = (2 * copied / mem_bw + calls * cluster.collective_launch_us * 1e-6) / share
    return StepTime(compute=compute, comm_exposed=exposed, comm_total=total, bubble=bubble,
                    optimizer=optimizer, flops=model_flops, host=host, collectives=calls)

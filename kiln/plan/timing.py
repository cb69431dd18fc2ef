"""Step-time model: compute from FLOPs and the device efficiency curve, each collective from an
alpha-beta model of the cluster's links, pipeline bubbles per schedule, and overlap of
communication with compute where the strategy allows it.

Collective costs (n ranks, S bytes, alpha latency, B bandwidth per rank and direction), the
textbook ring forms (Thakur et al. 2005; NCCL's docs use the same bus-bandwidth factors):
  all-reduce 2(n-1)/n * S/B + 2(n-1) alpha  (in-network reduction: S/B + 2 alpha across nodes)
  all-gather / reduce-scatter (n-1)/n * S/B + (n-1) alpha,  all-to-all (n-1)/n * S/B + (n-1) alpha.
A group that spans nodes runs at the inter-node link's bandwidth (one NIC per GPU); a rail-only
network adds an NVLink hop to all-to-all, which leaves its rail. FLOPs per token are the PaLM
convention 6N + 12*L*dim*seq (Chowdhery et al. 2022, appendix B), plus one more forward for
recomputed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.plan.cluster import Cluster, LinkSpec
from kiln.plan.memory import Layout, ModelShape, recomputed_blocks


@dataclass
class StepTime:
    compute: float
    comm_exposed: float
    comm_total: float
    bubble: float
    optimizer: float
    flops: float  # model FLOPs of the whole step, all ranks (for MFU; no recompute)

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed + self.bubble + self.optimizer

    def mfu(self, cluster: Cluster, precision: str, world: int) -> float:
        return self.flops / (self.total * world * cluster.device.peak_flops(precision))


def _link(cluster: Cluster, group: int, stride: int) -> tuple[LinkSpec, bool]:
    """The link a group of `group` ranks spaced `stride` apart uses, and whether it spans nodes."""
    spans = group > 1 and group * stride > cluster.gpus_per_node
    return (cluster.inter_node if spans else cluster.intra_node), spans


def all_reduce(cluster: Cluster, n: int, nbytes: float, stride: int = 1) -> float:
    if n <= 1:
        return 0.0
    link, spans = _link(cluster, n, stride)
    alpha, bw = link.latency_us * 1e-6, link.bandwidth_gbps * 1e9
    if spans and link.in_network_reduction:
        return nbytes / bw + 2 * alpha
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def all_gather(cluster: Cluster, n: int, nbytes: float, stride: int = 1) -> float:
    """Also reduce-scatter: `nbytes` is the full (unsharded) size."""
    if n <= 1:
        return 0.0
    link, _ = _link(cluster, n, stride)
    return (n - 1) / n * nbytes / (link.bandwidth_gbps * 1e9) + (n - 1) * link.latency_us * 1e-6


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
    t_mb = rank_flops_mb / (dev.peak_flops(layout.precision) * dev.efficiency(work))
    compute = t_mb * layout.grad_accum

    act = {"fp32": 4}.get(layout.precision, 2)
    param_bytes = 4 if layout.precision == "fp32" else 2
    stage_params = (shape.embedding_params + shape.n_layers * shape.layer_params / layout.pp) / layout.tp
    exposed, total = 0.0, 0.0

    # Tensor (sequence) parallel: per block 2 all-gathers + 2 reduce-scatters forward, as many
    # backward, of the block's activations; on the critical path.
    if layout.tp > 1:
        nbytes = act * tokens_rank_mb * shape.dim
        t = 8 * all_gather(cluster, layout.tp, nbytes) * shape.n_layers / layout.pp * layout.grad_accum
        exposed += t
        total += t
    # Context parallel (ring attention): K and V pass around the ring, hidden behind attention.
    if layout.cp > 1:
        kv_bytes = 2 * act * tokens_rank_mb * shape.kv_dim / layout.tp
        t = 3 * (layout.cp - 1) * p2p(cluster, kv_bytes, False) * shape.n_layers / layout.pp * layout.grad_accum
        attn_compute = t_mb * layout.grad_accum * 0.3
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, attn_compute))
        total += t
    # Pipeline: stage-boundary activations forward and their gradients backward per micro-batch.
    if layout.pp > 1:
        spans = layout.pp * layout.tp * layout.cp > cluster.gpus_per_node
        t = 2 * p2p(cluster, act * tokens_rank_mb * shape.dim / layout.tp, spans) * layout.grad_accum
        exposed += t
        total += t
    # Data parallel: gradient reduction (+ parameter gathers for sharded modes).
    dp_stride = layout.tp * layout.cp
    if layout.dp > 1:
        grad_bytes = 4 * stage_params
        if layout.dp_mode in ("ddp", "zero1"):
            t = all_reduce(cluster, layout.dp, grad_bytes, dp_stride)
            if layout.dp_mode == "zero1":
                t += all_gather(cluster, layout.dp, 4 * stage_params, dp_stride)  # updated shards broadcast
            overlappable = compute * 2 / 3 / layout.grad_accum  # only the last micro-batch's backward
        else:
            gathers = (2 if layout.dp_mode == "fsdp" else 1) * layout.grad_accum
            t = gathers * all_gather(cluster, layout.dp_shard, param_bytes * stage_params, dp_stride)
            t += all_gather(cluster, layout.dp_shard, grad_bytes, dp_stride)  # reduce-scatter
            t += all_reduce(cluster, layout.dp_replicate, grad_bytes / layout.dp_shard,
                            dp_stride * layout.dp_shard)  # HSDP: across replicas
            overlappable = compute
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, overlappable))
        total += t
    bubble = compute * bubble_fraction(layout)
    # The optimizer step reads/writes weights, grads and state once: memory-bandwidth bound.
    shard = layout.dp if layout.dp_mode != "ddp" else 1
    opt_bytes = stage_params / shard * (2 * 4 + 4 + 2 * optimizer_bytes_per_param)
    optimizer = opt_bytes / (dev.memory_bandwidth_gbps * 1e9)
    return StepTime(compute=compute, comm_exposed=exposed, comm_total=total, bubble=bubble,
                    optimizer=optimizer, flops=model_flops)

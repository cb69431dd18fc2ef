"""Step-time model: compute from FLOPs and the device efficiency curve, each collective from an
alpha-beta model of the cluster's links, pipeline bubbles per schedule, and overlap of
communication with compute where the strategy allows it.

Collective costs: kiln/plan/comm_cost.py (alpha-beta ring forms). Pipeline bubbles and
stage-boundary sends: kiln/plan/pipeline_time.py.

Every collective call pays its latency steps: a mode's traffic split over k calls costs k times
the alpha term. The calls per step are counted on kiln's own layouts (torch.profiler around a
step on 2 or 4 gloo processes; tests/plan/test_collective_counts.py keeps them equal to
`StepTime.calls`), not guessed: DDP one all-reduce per 25 MiB bucket; ZeRO-1 those plus one
broadcast per parameter tensor and per run cut off one (torch's ZeroRedundancyOptimizer,
parameters_as_bucket_view off, over kiln's partition);
FSDP2 one all-gather per unit (the blocks, an untied embedding, the root: head and final norm)
before forward, again before backward for every block but the last, one reduce-scatter per unit
and one all-reduce of the gradient norm (under pp, a resharded block m + 1 gathers a step, a kept
unit one: torch's stage keeps units gathered after a backward); TP+SP per micro-batch 4 all-gathers and 4 reduce-scatters of the activations per
block plus 2 and 2 at the embedding / head and 3 all-reduces of loss_parallel's per-token
statistics, per step one all-reduce of every norm weight's gradient (settled from Partial before
the gradient norm) and one of the gradient norms. On gloo (`cluster.backend`) torch's ProcessGroupGloo runs a
reduce-scatter as an all-reduce of the whole tensor (the profiler shows gloo:all_reduce under
each reduce-scatter), so it costs one.
Expert parallelism: 4 all-to-alls of the routed rows (one per token and expert rank,
`ranks_per_token`) per MoE block and micro-batch, plus one of the counts per dispatch and two of
the assignments' row index and gate (two levels, parallel.ep_node_ranks, count them once among
the nodes and once inside each, kiln/parallel/functional.py),
over ep ranks tp apart (etp = tp) or ep consecutive ranks each routing its 1/tp of the tokens
(etp = 1, whose MoE blocks skip tp's all-gather / reduce-scatter pair); the experts' FSDP or
all-reduce traffic over edp (`_expert_reduction`) and the experts' gradient norm, one all-reduce
per dimension of their mesh they are split over. MoE blocks under tp: once a step the router
weight's partial gradient all-reduced (the tokens' gradient rides the block's input
reduce-scatter), and ep borrowing tp, per block and micro-batch, the whole sequence's routing
statistics all-gathered (3 small calls); under cp the queue counts and balance
shares all-gathered over cp (2 calls, the shares' backward a reduce-scatter). Pipeline: the sends
and receives of torch's schedule, and per step the gradient norm's all-reduce over the stages and
the loss broadcast (MoE: two more all-reduces, of the aux losses and of the largest expert load);
tied embeddings one all-reduce per step of the embedding gradient between the first and the
last stage's ranks; FSDP's units counted on the fuller end's rank (`fuller_end`), a block kept
gathered from forward to backward at the end of each of its stage chunks. Context parallel: the ring's sends, each with its receive.
A group that spans nodes runs at the inter-node link's bandwidth (one NIC per GPU); a rail-only
network adds an NVLink hop to all-to-all, which leaves its rail. FLOPs per token are the PaLM
convention 6N + 12*L*dim*seq (Chowdhery et al. 2022, appendix B), plus one more forward for
recomputed blocks.

Host-side terms (what a GPU hides and a CPU/gloo run does not): each collective the caller waits
on in turn costs the cluster's `collective_launch_us` (dispatch, FSDP2's per-group hooks and
buffer setup, DTensor's wait) on top of the link's alpha; ZeRO-1's broadcasts do not: torch issues
them all with async_op=True and waits once (the profiler: 56 calls issued in under 1 ms of host
time); FSDP2 copies parameters into and out of its all-gather buffer and gradients into
its reduce-scatter buffer, and DDP copies gradients into and out of its buckets, at the device's
memory bandwidth; the optimizer step moves `optimizer_step_bytes` per parameter at the memory
bandwidth (torch's fused AdamW reads parameter, gradient and both moments and writes three: 28
bytes; its foreach AdamW makes eight passes, _multi_tensor_adamw's weight decay, lerp, mul,
addcmul, sqrt, div, add and addcdiv: 80 bytes), Muon's Newton-Schulz its matmuls on the matrices
a rank orthogonalizes (kiln/plan/muon_cost.py); when the processes of a node outnumber
`cores_per_node`, compute, the optimizer step and that host work run at cores / processes of a
core each.

Single-device terms beyond the matmul FLOPs, counted by mechanism (kernel names and call counts
from benchmarks/results/gpu_profile_h100.json, bytes from what each fused kernel reads and
writes; no fitted constant), for compiled runs (inductor's fused kernels; an eager run's unfused
elementwise traffic is not modelled, the efficiency curve absorbs it on CPU): the step's
elementwise kernels run at the device's memory bandwidth (`elementwise_bytes`: norms, residual
adds, RoPE, SDPA's output copy and the MLP activation, backward twice the forward's traffic);
the fused loss reads the low-precision logits forward and reads them and writes their gradient
backward; gradient clipping (torch's foreach clip_grad_norm_) reads every fp32 gradient for the
norm and reads and writes it to scale: 12 bytes per parameter. float8 (torchao's tensorwise
recipe on the blocks' linears; kiln leaves the LM head and SDPA in bf16): only the blocks'
linear FLOPs run at the float8 peak, and each linear's input and output gradient pay an amax
pass (read 2 bytes), a cast pass (read 2, write 1) and a transposed copy for the backward GEMM
layout (read 1, write 1): 7 bytes per element of both; each fp32 weight 11 bytes per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.parallel.ring_layout import ring_messages, window_hops
from kiln.plan.cluster import Cluster
# the communication and pipeline terms live beside this module; re-exported for callers of timing
from kiln.plan.comm_cost import all_gather, all_reduce, all_to_all, broadcast, p2p, reduce_scatter  # noqa: F401
from kiln.plan.diloco import outer_sync_seconds, replica_cluster
from kiln.plan.memory import (DDP_BUCKET_BYTES, OPTIM_STATE_BYTES, V_SHAPED, ZERO1_CUTS, ZERO_BUBBLE, Layout,
                              ModelShape, fsdp_end_units, rank_memory, rank_params, recomputed_blocks,
                              rank_chunks, recomputed_matmul_blocks, muon_matrix_fraction,
                              resharded_after_forward, stage_contents, ulysses_first_round_share, ulysses_kv_repeat,
                              ulysses_round_kv_share, zero1_fullest_share)
from kiln.plan.muon_cost import muon_exchanges, muon_seconds
from kiln.plan.pipeline_time import bubble_fraction, pass_split, pipeline_p2p_per_microbatch  # noqa: F401

# Bytes one optimizer step reads and writes per fp32 parameter, by (optimizer, implementation),
# where counted from torch's code (see the module docstring); others: read and write the
# parameter and its state, read the gradient.
OPTIM_STEP_BYTES = {("adamw", "fused"): 28, ("adamw", "foreach"): 80, ("adamw", "single"): 80}


def optimizer_step_bytes(optimizer: str = "adamw", implementation: str = "fused") -> float:
    if (optimizer, implementation) in OPTIM_STEP_BYTES:
        return OPTIM_STEP_BYTES[(optimizer, implementation)]
    return 2 * 4 + 4 + 2 * OPTIM_STATE_BYTES.get(optimizer, 8)


@dataclass
class StepTime:
    compute: float
    comm_exposed: float
    comm_total: float
    bubble: float
    optimizer: float
    flops: float  # model FLOPs of the whole step, all ranks (for MFU; no recompute)
    host: float = 0.0  # collective launches and communication-buffer copies
    memory_bound: float = 0.0  # compiled runs: elementwise kernels, fused loss, gradient clipping, float8 casts
    calls: dict = field(default_factory=dict)  # collective calls one rank issues per step, by op
    outer_sync: float = 0.0  # DiLoCo: the outer step every H steps, per step (kiln/plan/diloco.py)

    @property
    def collectives(self) -> int:
        return round(sum(self.calls.values()))

    @property
    def total(self) -> float:
        return (self.compute + self.comm_exposed + self.bubble + self.optimizer + self.host + self.memory_bound
                + self.outer_sync)

    def mfu(self, cluster: Cluster, precision: str, world: int) -> float:
        return self.flops / (self.total * world * cluster.device.peak_flops(precision))


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduces DDP issues per step: buckets of bucket_cap_mb (kiln passes 25 MiB; torch's
    smaller 1 MiB first bucket applies only when bucket_cap_mb is left at its default)."""
    return max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))


def fsdp_units(shape: ModelShape, layout: Layout, last: bool = False) -> tuple[int, int, float]:
    """(units, blocks, their dense parameters outside the blocks) on one rank of the first (or,
    `last`, last) stage: the FSDP2 parameter groups kiln/parallel/parallelize.py apply_fsdp makes,
    each gathered and reduced by its own collective: one per block, an untied embedding's and the
    root's where they hold parameters (memory.py fsdp_end_units)."""
    blocks = stage_contents(shape, layout, last)[0]
    own_embedding, root = fsdp_end_units(shape, layout, last)
    return blocks + (own_embedding > 0) + (root > 0), blocks, own_embedding + root


def fuller_end(shape: ModelShape, layout: Layout) -> bool:
    """Whether the pipeline's last rank (True) or first (False) holds more parameters
    (rank_params: the embedding on the first stage, the head - for tied embeddings a copy - and
    the final norm on the last): the rank whose collectives step_time counts. pp = 1: False."""
    if layout.pp == 1:
        return False
    first, last = (sum(rank_params(shape, layout, end)[:2]) for end in (False, True))
    return last > first


def compute_share(cluster: Cluster, layout: Layout) -> float:
    """The fraction of a device each rank computes at: 1, or cores / processes when a node's
    processes outnumber its `cores_per_node` (CPU processes time-share the cores)."""
    if cluster.cores_per_node <= 0:
        return 1.0
    ranks = min(layout.world_size, cluster.gpus_per_node)
    return min(1.0, cluster.cores_per_node / ranks)


def step_time(shape: ModelShape, layout: Layout, seq_len: int, cluster: Cluster, optimizer: str = "adamw",
              optimizer_impl: str = "fused") -> StepTime:
    """Predicted wall time of one optimizer step (grad_accum micro-batches) on every rank."""
    if layout.diloco_inner_steps:  # one replica's step on its part of the cluster, plus the outer
        # step every H steps (kiln/plan/diloco.py); FLOPs over all replicas (for MFU)
        replica = layout.replica
        t = step_time(shape, replica, seq_len, replica_cluster(cluster, layout), optimizer, optimizer_impl)
        shard_bytes = rank_memory(shape, replica, seq_len, optimizer).parameters
        # P fragment syncs per H steps (Streaming DiLoCo), each hidden behind up to tau inner steps
        t.outer_sync = (outer_sync_seconds(cluster, layout, shard_bytes, t.total) * layout.diloco_fragments
                        / layout.diloco_inner_steps)
        t.flops *= layout.dp_replicate
        return t
    dev = cluster.device
    tokens_rank_mb = layout.micro_batch * seq_len / layout.cp  # tokens one rank computes per micro-batch
    # the LM head matmul counts; a MoE block's token passes through its top-k experts only
    non_embed = shape.active_params - shape.embedding_params + shape.vocab * shape.dim
    flops_token = 6 * non_embed + 12 * shape.q_dim * shape.attention_keys(seq_len)
    global_tokens = layout.micro_batch * seq_len * layout.grad_accum * layout.dp
    model_flops = flops_token * global_tokens
    # Recompute adds one forward (a third of 6N) of the recomputed blocks.
    recompute = recomputed_matmul_blocks(layout.ac, shape.n_layers) / shape.n_layers
    layer_flops_token = 6 * shape.layer_params + 12 * shape.q_dim * shape.attention_keys(seq_len) / shape.n_layers
    rank_flops_mb = (flops_token + recompute * layer_flops_token * shape.n_layers / 3) * tokens_rank_mb
    rank_flops_mb /= layout.tp * layout.pp
    work = tokens_rank_mb * shape.dim / layout.tp  # a matmul's M*K scale on this rank
    share = compute_share(cluster, layout)  # wall time below: at this rank's share of a device
    t_mb = rank_flops_mb / (dev.peak_flops(layout.precision) * dev.efficiency(work) * share)
    if layout.precision == "float8":  # the blocks' linears at the float8 peak, the head and SDPA at bf16's
        linear_flops = (6 + 2 * recompute) * shape.n_layers * shape.layer_params * tokens_rank_mb
        linear_flops /= layout.tp * layout.pp
        t_mb = (linear_flops / dev.peak_flops("float8") + (rank_flops_mb - linear_flops) / dev.peak_flops("bf16"))
        t_mb /= dev.efficiency(work) * share
    compute = t_mb * layout.grad_accum

    act = {"fp32": 4}.get(layout.precision, 2)
    param_bytes = 4 if layout.precision == "fp32" else 2
    # the data-parallel reduction waits for the fuller end of the pipeline
    fuller_last = fuller_end(shape, layout)
    dense, experts, _ = rank_params(shape, layout, fuller_last)
    exposed, total = 0.0, 0.0
    calls: dict[str, float] = {}  # collective calls by op
    launched, copied = 0.0, 0.0  # calls waited on in turn (each pays the launch cost); bytes copied

    def count(op: str, n: float, waited: bool = True) -> None:
        nonlocal launched
        calls[op] = calls.get(op, 0) + n
        launched += n if waited else 0

    stage_layers = shape.n_layers / layout.pp
    ga = layout.grad_accum

    # Tensor (sequence) parallel (counted; see the module docstring): per micro-batch the block's
    # activations all-gathered and reduce-scattered 4 times each per block (a recomputed block's
    # forward ones again) and twice at the embedding / head, and loss_parallel's 3 per-token
    # statistics all-reduced; per step each norm weight's gradient (a Partial DTensor after
    # backward) all-reduced once, settled before the
    # gradient norm (kiln/train/step.py settle_grad_placements; left Partial, torch 2.13's ops
    # all-reduced it at every read: 2 or, foreach, 4 per step), and the stacked gradient norms
    # once. All on the critical path.
    moe_stage_layers = shape.moe_layers / layout.pp if layout.ep > 1 else 0.0
    if layout.tp > 1:
        nbytes = act * tokens_rank_mb * shape.dim
        # ep borrowing tp leaves a MoE block's input sequence-sharded (MoELocalSequence): its MLP
        # has no all-gather / reduce-scatter pair forward and backward
        boundary = 4 * stage_layers + 2 - (2 * moe_stage_layers if layout.ep_borrows_tp else 0)
        # a recomputed block runs its forward's all-gathers again in backward, and its
        # reduce-scatters unless "op" keeps their outputs
        recomputed = recomputed_blocks(layout.ac, shape.n_layers) / shape.n_layers
        forward = 2 * stage_layers - (moe_stage_layers if layout.ep_borrows_tp else 0)
        gathers = boundary + recomputed * forward
        scatters = boundary + (0.0 if layout.ac == "op" else recomputed * forward)
        norm_reads = 2 * stage_layers + 1  # the norm weights' gradients, settled once
        t = all_gather(cluster, layout.tp, nbytes * gathers * ga, calls=gathers * ga)
        t += reduce_scatter(cluster, layout.tp, nbytes * scatters * ga, calls=scatters * ga)
        t += all_reduce(cluster, layout.tp, 4 * shape.dim * norm_reads, calls=norm_reads)
        t += all_reduce(cluster, layout.tp, 3 * 4 * tokens_rank_mb * ga, calls=3 * ga)
        t += all_reduce(cluster, layout.tp, 4 * shape.param_tensors(layout.pp), calls=1)
        count("all_gather", gathers * ga)
        count("reduce_scatter", scatters * ga)
        count("all_reduce", norm_reads + 3 * ga + 1)
        # MoE blocks (kiln/model/moe.py): the router weight's gradient is partial over tp (the
        # gates see the experts' hidden slices, or, ep borrowing tp, each rank routes its own
        # tokens) and summed once a step; the tokens' gradient rides the block's input
        # reduce-scatter. Borrowing tp, forward all-gathers per block and micro-batch the whole
        # sequence's queue counts per expert, balance shares (f, P) and z-loss.
        moe = shape.moe_layers / layout.pp
        if moe:
            t += all_reduce(cluster, layout.tp, 4 * shape.moe_experts * shape.dim * moe, calls=moe)
            count("all_reduce", moe)
        if moe and layout.ep_borrows_tp:
            stats = (8 * layout.micro_batch * (shape.moe_top_k + 1) * shape.moe_experts + 4) * layout.tp
            t += all_gather(cluster, layout.tp, stats * moe * ga, calls=3 * moe * ga)
            count("all_gather", 3 * moe * ga)
        exposed += t
        total += t
    # Context parallel. Ring attention: K and V pass around the ring, hidden behind attention's
    # score and value products only (the ring issues the next block's K/V before this block's
    # attention): their FLOP share of the step, 12*L*dim*seq of the token's FLOPs. A sliding-window
    # layer whose window reaches few ranks exchanges with those neighbours only (ring_layout.py);
    # its sends both ways share the rank's link, so they are timed one after the other. Ulysses
    # (kiln/parallel/ulysses.py): per layer and micro-batch q, k, v together (K/V repeated to a
    # multiple of its ranks) and the output all-to-all'd over its ranks forward, the same backward;
    # attention waits for its inputs and the output projection for its output: exposed. In R rounds
    # (parallel.ulysses_rounds) R times the calls; forward, all but the first round's inputs and the
    # last round's output can hide behind the other rounds' attention (forward: 4 of attention's
    # 12*L*dim*seq FLOPs a token), backward stays exposed; credited where Ulysses runs alone (under
    # the hybrid the ring's sends hide behind the same attention). Where
    # cp x tp outgrows a node the ring waits on its hops between nodes (under Ulysses x ring,
    # parallel.ulysses_degree, its ranks are ulysses_degree x tp apart), timed on that link.
    if layout.ulysses_ranks > 1:
        u = layout.ulysses_ranks
        per_token = 2 * shape.q_dim + 2 * shape.kv_dim * ulysses_kv_repeat(shape, layout)
        rounds = layout.ulysses_rounds
        exchanges = 4 * rounds * stage_layers * ga
        t = all_to_all(cluster, u, 2 * act * tokens_rank_mb * per_token / layout.tp * stage_layers * ga,
                       layout.tp, calls=exchanges)
        count("all_to_all", exchanges)
        hidden = 0.0
        if rounds > 1 and layout.ring_ranks == 1:
            inputs = t / 2 * (per_token - shape.q_dim) / per_token  # forward: q, k, v; then the output
            hideable = inputs * (1 - ulysses_first_round_share(shape, layout)) + (t / 2 - inputs) * (1 - 1 / rounds)
            attn_forward = t_mb * ga * 4 * shape.q_dim * shape.attention_keys(seq_len) / flops_token
            hidden = min(hideable, cluster.overlap_efficiency * attn_forward * (rounds - 1) / rounds)
        exposed += t - hidden
        total += t
    if layout.ring_ranks > 1:  # after Ulysses (if any) a rank's K/V: u x its tokens, 1/u of the heads
        ring = layout.ring_ranks
        kv_bytes = 2 * act * tokens_rank_mb * shape.kv_dim * ulysses_kv_repeat(shape, layout) / layout.tp
        # under the hybrid in rounds, a ring a round: R times the messages, each with the round's K/V
        rounds = layout.ulysses_rounds if layout.ulysses_ranks > 1 else 1
        kv_bytes *= ulysses_round_kv_share(shape, layout) if rounds > 1 else 1
        local = shape.local_layers / shape.n_layers * stage_layers
        hops = window_hops(ring, seq_len // (2 * ring), shape.window)
        sends = (ring_messages(ring, None) * (stage_layers - local) + ring_messages(ring, hops) * local) * ga * rounds
        t = sends * p2p(cluster, kv_bytes, layout.cp * layout.tp > cluster.gpus_per_node)  # a hop between nodes
        count("p2p", sends)  # each with its receive in one batch_isend_irecv, waited on once
        count("p2p", sends, waited=False)
        attn_compute = t_mb * ga * 12 * shape.q_dim * shape.attention_keys(seq_len) / flops_token
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, attn_compute))
        total += t
    if layout.cp > 1:
        # MoE blocks route over the whole sequence (kiln/model/moe.py): per block and micro-batch the
        # queue counts per expert (int64, per sequence, choice and chunk) and the balance shares
        # (f, P) all-gathered over cp, the shares' backward a reduce-scatter; on the critical path
        moe = shape.moe_layers / layout.pp
        if moe:
            b, e = layout.micro_batch, shape.moe_experts
            t = all_gather(cluster, layout.cp, (16 * b * shape.moe_top_k * e + 8 * b * e) * layout.cp * moe * ga,
                           layout.tp, calls=2 * moe * ga)
            t += reduce_scatter(cluster, layout.cp, 8 * b * e * layout.cp * moe * ga, layout.tp, calls=moe * ga)
            count("all_gather", 2 * moe * ga)
            count("reduce_scatter", moe * ga)
            exposed += t
            total += t
    # Expert parallel (kiln/parallel/functional.py dispatch_and_combine): per MoE block and
    # micro-batch a dispatch and a combine all-to-all of one row per token and expert rank
    # forward, their reverses backward; before them a small all-to-all of the per-expert and
    # per-rank counts, and one of each assignment's row index and gate (two float64) with its
    # reverse; on the critical path. With etp = tp the group is one tp coordinate's ep ranks
    # (stride tp) and every tp rank routes the whole gathered sequence; borrowing tp (etp = 1) the
    # group is ep consecutive ranks spanning tp and each rank routes only its own 1/tp of the tokens.
    # Two-level (parallel.ep_node_ranks = L): the same pattern once among the nodes (ep / L ranks
    # L x stride apart, one row per token and node) and once inside each (L ranks, one row per
    # token and rank, as one level sends).
    if moe_stage_layers:
        routed = tokens_rank_mb / (layout.tp if layout.ep_borrows_tp else 1)
        stride = 1 if layout.ep_borrows_tp else layout.tp
        a2a = 4 * moe_stage_layers * ga
        local = layout.ep_node_ranks if 1 < layout.ep_node_ranks < layout.ep else 1
        levels = [(layout.ep, stride)] if local == 1 else [(layout.ep // local, stride * local), (local, stride)]
        t = 0.0
        for level, (n, apart) in enumerate(levels):
            # rows per token: to each of the level's ranks (nodes) holding its experts; inside a
            # node a received row goes on to each of the node's ranks holding them
            rows = routed * ranks_per_token(shape.moe_experts, shape.moe_top_k, n if level == 0 else layout.ep,
                                            shape.moe_groups, shape.moe_topk_groups)
            t += all_to_all(cluster, n, act * rows * shape.dim * a2a, apart, calls=a2a)
            t += all_to_all(cluster, n, 16 * routed * shape.moe_top_k * a2a / 2, apart, calls=a2a / 2)
            t += all_to_all(cluster, n, 8 * (shape.moe_experts + n) * a2a / 4, apart, calls=a2a / 4)
            count("all_to_all", 1.75 * a2a)
        exposed += t
        total += t
    # Pipeline: stage-boundary activations forward and their gradients backward, the sends and
    # receives a rank issues per micro-batch on average (`pipeline_p2p_per_microbatch`).
    if layout.pp > 1:
        spans = layout.pp * layout.tp * layout.cp > cluster.gpus_per_node
        hops = pipeline_p2p_per_microbatch(layout)
        t = hops * p2p(cluster, act * tokens_rank_mb * shape.dim / layout.tp, spans) * ga
        count("p2p", hops * ga)
        # per step (kiln/train/pipeline_step.py pipeline_train_step) the gradient norm's squares summed
        # over the stages and the last stage's loss broadcast to them, over ranks the rest apart
        # (MoE: also the aux and z-losses summed and the largest expert load taken over the stages)
        apart = layout.dp * layout.cp * layout.tp
        sums, nbytes = (3, 16) if shape.moe_layers else (1, 4)
        t += all_reduce(cluster, layout.pp, nbytes, apart, calls=sums) + broadcast(cluster, layout.pp, 4, apart)
        count("all_reduce", sums)
        count("broadcast", 1)
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
        grad_bytes = 4 * dense  # the experts are reduced over their own group, below
        wire_bytes = grad_bytes * layout.grad_wire_bytes / 4  # parallel.reduce_dtype on the wire
        if layout.dp_mode in ("ddp", "zero1"):
            buckets = ddp_buckets(grad_bytes)
            t = all_reduce(cluster, replicas, wire_bytes, dp_stride, calls=buckets)
            count("all_reduce", buckets)
            copied += 2 * grad_bytes  # gradients into the buckets and back
            overlappable = compute * 2 / 3 / ga  # only the last micro-batch's backward
            if layout.dp_mode == "zero1":  # a broadcast of each updated parameter, after the step
                # ... and of each run kiln's partition cuts (each of the n - 1 boundaries between
                # ranks' even shares cuts one tensor in two: memory.py zero1_fullest_share)
                cuts = replicas - 1 if ZERO1_CUTS.get(optimizer, "none") != "none" else 0
                tensors = shape.param_tensors(layout.pp) + cuts
                t_b = broadcast(cluster, replicas, 4 * dense, dp_stride, calls=tensors)
                count("broadcast", tensors, waited=False)
                exposed += t_b
                total += t_b
            elif optimizer == "muon":  # ddp: each replica orthogonalizes its share and broadcasts it
                matrices = 4 * (dense * muon_matrix_fraction(shape, layout, fuller_last)
                                + (experts if layout.ep == 1 else 0.0))
                t_b = broadcast(cluster, replicas, matrices, dp_stride, calls=replicas)
                count("broadcast", replicas)
                exposed += t_b
                total += t_b
        else:
            units, blocks, ends = fsdp_units(shape, layout, fuller_last)
            own_embedding = fsdp_end_units(shape, layout, fuller_last)[0]
            # FSDP2 all-gathers each unit before its forward and (fsdp: resharded after forward)
            # each block again before its backward, except each stage chunk's last (kiln keeps it:
            # under pp one per chunk of the rank, interleaved v of them), not the root
            # (kept from forward: it starts backward) nor an untied embedding (its backward reads no
            # weight). pp = 1: every micro-batch. Under pp torch's stage keeps a unit gathered from
            # a backward until a forward reshards it (`set_reshard_after_backward(False)` until the
            # step's REDUCE_GRAD), so a unit's pass gathers only after one of its forwards: whatever
            # the schedule, a resharded block m + 1 times a step (its first pass and each pass after
            # a forward; the last pass is a backward), an untied embedding m, a kept unit once.
            # Zero-bubble pipelines keep every unit gathered until backward (kiln/parallel/
            # pipeline.py keep_gathered_until_backward); zero2 keeps its blocks.
            kept = sum(1 for chunk in rank_chunks(shape, layout, fuller_last) if chunk)
            resharded_blocks = blocks - kept if resharded_after_forward(layout) else 0
            again = (dense - ends) * resharded_blocks / blocks if blocks else 0.0
            if layout.pp == 1:
                gathers, gathered = (units + resharded_blocks) * ga, (dense + again) * ga
                if layout.fsdp_reshard_to:  # the backward gathers are counted apart, below
                    gathers, gathered = units * ga, dense * ga
            elif layout.schedule in ZERO_BUBBLE:
                gathers, gathered = units, dense
            else:
                gathers = units + resharded_blocks * ga + (own_embedding > 0) * (ga - 1)
                gathered = dense + again * ga + own_embedding * (ga - 1)
            shard = shards
            gather_bytes = param_bytes * gathered
            t = all_gather(cluster, shard, gather_bytes, dp_stride, calls=gathers)
            if layout.fsdp_reshard_to and again:
                # parallel.fsdp_reshard_to = k (pp = 1): backward gathers over k consecutive shard ranks
                # (tp = 1: k consecutive ranks, a node's when they fit) from the 1/k each rank kept after forward
                k, again_bytes = layout.fsdp_reshard_to, param_bytes * again * ga
                t += all_gather(cluster, k, again_bytes, dp_stride, calls=resharded_blocks * ga)
                gathers += resharded_blocks * ga
                copied += again_bytes * (1 + 1 / k) + again_bytes / k  # and the post-forward copy of the 1/k
            # every micro-batch reduce-scatters (the gradients stay sharded); HSDP all-reduces across
            # the replicas in the last one only (kiln/parallel/data_parallel.py sync_on_last_micro_batch).
            # Under pp torch's stage syncs the last backward only (PipelineStage: no gradient sync
            # before it): one reduce-scatter a step.
            scatters = ga if layout.pp == 1 else 1
            t += reduce_scatter(cluster, shard, wire_bytes * scatters, dp_stride, calls=units * scatters)
            t += all_reduce(cluster, replicas, wire_bytes / shard, dp_stride * shard, calls=units)  # HSDP
            # the gradient norm of the sharded gradients: one all-reduce per step
            t += all_reduce(cluster, replicas * shards, 4, dp_stride)
            count("all_gather", gathers)
            count("reduce_scatter", units * scatters)
            count("all_reduce", 1 + (units if replicas > 1 else 0))
            # copy-in of the local shard and copy-out of the gathered unit; gradients into the
            # reduce-scatter buffer and the reduced shard out, each micro-batch
            copied += gather_bytes * (1 + 1 / shard) + grad_bytes * scatters * (1 + 1 / shard)
            overlappable = compute
        t += _expert_reduction(cluster, shape, layout, experts, param_bytes, count, fuller_last)
        exposed += max(0.0, t - cluster.overlap_efficiency * min(t, overlappable))
        total += t
    elif layout.ep > 1:  # no dense data parallel, yet the experts' norm (and, ep borrowing tp, their edp)
        t = _expert_reduction(cluster, shape, layout, experts, param_bytes, count, fuller_last)
        exposed += t
        total += t
    # Tied embeddings under pp (kiln/parallel/pipeline_tied.py, Megatron-LM's embedding group): once
    # per step, after the schedule's backward and before clipping, the first stage's and the last
    # stage's ranks sum the embedding's and the head copy's gradients (their local tp shard, under
    # fsdp/zero2 their dp shard too): an all-reduce over 2 ranks (pp - 1) stages apart, waited on.
    # A V's (ZBV, DualPipeV) rank 0 holds both stages: a local sum.
    if layout.pp > 1 and shape.tied and layout.schedule not in V_SHAPED:
        tied_shard = layout.dp_shard * layout.cp if layout.dp_mode in ("fsdp", "zero2") else 1
        stride = layout.world_size // layout.pp * (layout.pp - 1)
        t = all_reduce(cluster, 2, 4 * shape.vocab * shape.dim / (layout.tp * tied_shard), stride)
        count("all_reduce", 1)
        exposed += t
        total += t
    # A stage idle in the bubble leaves its core to the node's other processes: where ranks share
    # cores (share < 1, CPU), the step is the longer of the full-speed pipeline (compute at a whole
    # core, plus its bubble) and the node's total work over its cores (= compute at the share).
    idle = bubble_fraction(layout, pass_split(shape, layout, seq_len))
    bubble = max(0.0, compute * share * (1 + idle) - compute) if share < 1 else compute * idle
    # The optimizer step reads and writes weights, gradients and state: memory-bandwidth bound.
    # Each rank steps its partition: zero2/fsdp over the shards, zero1 the fullest rank's
    # (memory.py zero1_fullest_share; the others wait for its broadcasts).
    shard = {"zero2": shards, "fsdp": shards}.get(layout.dp_mode, 1)
    expert_shard = layout.expert_dp if layout.dp_mode in ("zero2", "fsdp") else 1
    if layout.dp_mode == "zero1":
        partitioned = dense + (experts if layout.ep == 1 else 0.0)
        stepped = (partitioned * zero1_fullest_share(shape, layout, fuller_last, optimizer)
                   + (experts if layout.ep > 1 else 0.0))
    else:
        stepped = dense / shard + experts / expert_shard
    opt_bytes = stepped * optimizer_step_bytes(optimizer, optimizer_impl)
    mem_bw = dev.memory_bandwidth_gbps * 1e9
    optimizer_s = opt_bytes / mem_bw / share
    if optimizer == "muon":  # and its Newton-Schulz matmuls and their exchanges (kiln/plan/muon_cost.py)
        optimizer_s += muon_seconds(shape, layout, cluster, share)
        t, muon_calls = muon_exchanges(shape, layout, cluster)
        for op, n in muon_calls.items():
            count(op, n)
        exposed += t  # after backward, before the parameters change: nothing to hide behind
        total += t
    # Host work: each copy reads and writes its bytes; each waited-on call pays the launch cost.
    host = (2 * copied / mem_bw + launched * cluster.collective_launch_us * 1e-6) / share
    memory_bound = 0.0
    if layout.compiled:
        per_mb = elementwise_bytes(shape, layout, seq_len) * tokens_rank_mb / (layout.tp * layout.pp)
        if layout.precision == "float8":  # the fp32 weights per micro-batch: amax (4), cast (4 + 1), transpose (2)
            per_mb += 11 * shape.n_layers * shape.layer_params / (layout.tp * layout.pp)
        memory_bound = (per_mb * ga + 12 * stepped) / mem_bw / share
    elif layout.ac == "op":  # eager: every block's cheap ops run again in backward, at least their fused bytes
        per_mb = shape.n_layers * block_elementwise_forward_bytes(shape, layout) * tokens_rank_mb
        memory_bound = per_mb * ga / (layout.tp * layout.pp) / mem_bw / share
    return StepTime(compute=compute, comm_exposed=exposed, comm_total=total, bubble=bubble,
                    optimizer=optimizer_s, flops=model_flops, host=host, calls=calls, memory_bound=memory_bound)


def _expert_reduction(cluster: Cluster, shape: ModelShape, layout: Layout, experts: float, param_bytes: int,
                      count, last: bool = False) -> float:
    """The experts' data-parallel traffic over "edp" (`Layout.expert_dp`; kiln/parallel/
    expert_parallel.py): fsdp/zero2 gather each MoE block's experts per micro-batch (fsdp again for
    backward, but for the stage's last block, kept gathered as its dense unit is) and
    reduce-scatter their gradients once per step; ddp/zero1 (experts replicated, DDP ignores them)
    all-reduce each expert weight tensor (w1, w2 and, gated, w3) once per step
    (`ReplicatedExpertGrads`; under pp in every micro-batch's backward). The group's ranks are ep
    x tp apart (etp = tp) or ep apart (ep borrowing tp). The gradient norm takes one all-reduce
    per step for each dimension of the experts' mesh their gradients are split over (DTensor's
    full_tensor of the experts' norm, kiln/train/step.py clip_grad_norm): ep, tp (etp = tp) and,
    fsdp/zero2, edp."""
    edp = layout.expert_dp
    moe_blocks = shape.moe_layers / layout.pp
    if not (layout.ep > 1 and moe_blocks):
        return 0.0
    replicated = layout.dp_mode in ("ddp", "zero1")
    stride = layout.ep * (1 if layout.ep_borrows_tp else layout.tp)
    split = [(layout.ep, 1 if layout.ep_borrows_tp else layout.tp)]
    split += [(layout.tp, 1)] if layout.tp > 1 and not layout.ep_borrows_tp else []
    split += [(edp, stride)] if edp > 1 and not replicated else []
    count("all_reduce", len(split))
    norm = sum(all_reduce(cluster, n, 4, apart) for n, apart in split)
    if edp == 1:
        return norm
    chunks = rank_chunks(shape, layout, last)
    calls = sum(shape.is_moe_block(i) for chunk in chunks for i in chunk)  # the rank's MoE blocks
    if replicated:
        passes = layout.grad_accum if layout.pp > 1 else 1
        tensors = calls * (3 if shape.gated else 2) * passes
        count("all_reduce", tensors)
        return norm + all_reduce(cluster, edp, layout.grad_wire_bytes * experts * passes, stride, calls=tensors)
    resharded = 0  # expert units resharded after forward: all but each stage chunk's last block's
    if resharded_after_forward(layout):
        resharded = calls - sum(shape.is_moe_block(chunk[-1]) for chunk in chunks if chunk)
    m = layout.grad_accum
    if layout.pp == 1:  # every micro-batch; a resharded unit again for its backward
        gathers = (calls + resharded) * m
    else:  # as the dense units under pp (step_time): a resharded unit m + 1 times a step, a kept one once
        gathers = calls + resharded * m
    count("all_gather", gathers)
    count("reduce_scatter", calls)
    return (norm + all_gather(cluster, edp, param_bytes * experts * gathers / calls, stride, calls=gathers)
            + reduce_scatter(cluster, edp, layout.grad_wire_bytes * experts, stride, calls=calls))


def block_elementwise_forward_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes per token one block's forward moves in its memory-bound kernels, compiled (the
    fused kernels of `elementwise_bytes`' docstring)."""
    a = {"fp32": 4}.get(layout.precision, 2)
    d, q, kv, f = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn
    norms = 2 * (4 + a) * d
    adds = 2 * (4 + a + 4) * d
    rope = 2 * a * (q + kv) * 2 if shape.rope else 0
    copy = 2 * a * q if shape.rope else 0
    act = ((3 if shape.gated else 2) * a) * f
    return norms + adds + rope + copy + act


def elementwise_bytes(shape: ModelShape, layout: Layout, seq_len: int) -> float:
    """Bytes per token that a compiled step's memory-bound kernels move over the whole model, one
    micro-batch, forward and backward (see the module docstring). Forward per block: each norm
    reads the fp32 residual and writes its low-precision output (4 + a bytes per element), each
    residual add reads the stream and the projection's output and writes the stream (4 + a + 4),
    RoPE reads and writes q and k, SDPA's output is copied to (b, s, h*d) with RoPE (the compiled
    graph's copy; memory.py), the activation reads its 1 (plain) or 2 (gated) inputs and writes
    one; backward moves twice that. A recomputed block runs its forward again."""
    a = {"fp32": 4}.get(layout.precision, 2)
    d, q, kv, f = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn
    forward = block_elementwise_forward_bytes(shape, layout)
    recompute = recomputed_blocks(layout.ac, shape.n_layers) / shape.n_layers
    blocks = shape.n_layers * forward * (3 + recompute)
    loss = 3 * a * shape.vocab  # the fused loss: logits read forward, read + gradient written backward
    casts = 0.0
    if layout.precision == "float8":  # each linear's input and output gradient: amax, cast, transposed copy
        linears = (d + q) + 2 * (d + kv) + (q + d) + (3 if shape.gated else 2) * (d + f)  # sum of in + out features
        casts = 7 * linears * shape.n_layers * (1 + recompute)
    return blocks + loss + casts


def ranks_per_token(experts: int, top_k: int, ep: int, groups: int = 1, topk_groups: int = 1) -> float:
    """The expected number of ep ranks a token's top-k experts sit on (each rank holds E / ep
    consecutive experts), under uniform routing: the rows expert parallelism exchanges per token
    (kiln/parallel/functional.py `dispatch_and_combine` sends a token once per rank, not once per
    expert). Group-limited routing (model.moe_groups G, moe_topk_groups M: the k experts come from
    the M chosen of G groups of consecutive experts, uniformly) confines them: with G = ep (or
    the number of nodes) it is DeepSeek-V3's node-limited routing, at most M ranks (nodes) per
    token. A trained router's choices are not uniform, which this does not model."""
    ep = max(ep, 1)
    per_rank, k = experts // ep, top_k
    if groups <= 1 or (ep % groups and groups % ep):  # ungrouped (or groups not aligned with ranks)
        return ep * (1 - math.comb(experts - per_rank, k) / math.comb(experts, k))
    pool = topk_groups * experts // groups  # the experts a token's top-k come from

    def hit(held: int) -> float:  # P(one of the k lands on `held` of the pool's experts)
        return 1 - math.comb(pool - held, k) / math.comb(pool, k)

    if groups <= ep:  # a rank holds part of one group: hit if that group is chosen
        return ep * topk_groups / groups * hit(per_rank)
    mine = groups // ep  # a rank holds whole groups: j of them chosen (hypergeometric)
    chosen = range(1, min(mine, topk_groups) + 1)
    return ep * sum(math.comb(mine, j) * math.comb(groups - mine, topk_groups - j) / math.comb(groups, topk_groups)
                    * hit(j * experts // groups) for j in chosen)

"""Layout search: enumerate valid parallel layouts for a model on a cluster, prune those that do
not fit a device's memory (kiln/plan/memory.py), rank the rest by predicted step time
(kiln/plan/timing.py), and write the best as a config `kiln train` runs as is.

Dimensions searched: tp (divides the GPUs of a node and the attention/KV heads), pp (divides the
layers; schedules gpipe, 1f1b and, with 2 virtual stages, interleaved_1f1b, interleaved_zero_bubble,
zbv_zero_bubble and dualpipev where kiln runs them: `pipeline_schedules`), cp (powers of two that split the
sequence into 2*cp chunks), data parallel as ddp, zero1, zero2, fsdp and hsdp (dp_replicate x
dp_shard), micro-batch (powers of two dividing the per-rank batch) and activation checkpointing
(kiln/plan/ac.py: the least recompute that fits, none, every_k:K or full, or op where faster).
For a mixture-of-experts model also ep (divisors of the expert count) and, with tp > 1, whether
ep borrows the tp ranks (parallel.etp = 1: whole experts) or each expert is sharded over tp too
(etp = tp); the ep / dp mode / degree combinations are kept only
where kiln's own layout checks pass (kiln/parallel/dims.py `check_ep_layout`,
`check_ep_borrowing_tp_layout`, the ones `ParallelDims.from_config` runs). Every mesh (dp mode,
dp_replicate x dp_shard x cp x tp x pp, ep, etp) is put to `ParallelDims.from_config` itself
(`kiln_accepts`), so legality has one place: what kiln's dims accept (e.g. ddp/zero1 x tp x pp
once lifted there) the search considers, what they refuse it never proposes.

DiLoCo (parallel.diloco_inner_steps = H): on a cluster of islands one replica per island
(kiln/plan/diloco.py `check_islands`); the search runs over one island's devices with the
replica's share of the global batch and the data-parallel modes kiln runs inside a replica (ddp
only without data parallelism inside it, where every data-parallel rank is a replica; fsdp and
zero2 over dp_shard), each layout put to `ParallelDims.from_config` whole (replicas included);
the memory and time models add the outer state and the outer step's share of each step.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from kiln.config import JobConfig, ModelConfig, to_toml
from kiln.errors import KilnError
from kiln.plan.ac import plan_activation_checkpointing
from kiln.plan.cluster import Cluster
from kiln.plan.diloco import check_islands
from kiln.plan.memory import Layout, MemoryBreakdown, ModelShape, rank_memory
from kiln.plan.timing import StepTime, step_time

AC_CHOICES = ("none", "selective", "full")


@dataclass
class Plan:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int) -> list[int]:
    return [1 << k for k in range(0, n.bit_length()) if n % (1 << k) == 0]


def _dp_splits(dp: int, diloco: bool = False) -> list[tuple[str, int, int]]:
    """(dp_mode, dp_replicate, dp_shard) for `dp` data-parallel ranks (of one DiLoCo replica: DDP,
    ZeRO-1 or FSDP2 over its dp_shard ranks, never HSDP; kiln/parallel/dims.py diloco_layout)."""
    if dp == 1:
        return [("ddp", 1, 1)]
    if diloco:
        return [("ddp", 1, dp), ("zero1", 1, dp), ("zero2", 1, dp), ("fsdp", 1, dp)]
    out = [("ddp", dp, 1), ("zero1", dp, 1), ("zero2", 1, dp), ("fsdp", 1, dp)]
    return out + [("fsdp", r, dp // r) for r in divisors(dp) if 1 < r < dp]  # HSDP


def expert_layouts(shape: ModelShape, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) candidates for a layout: (1, -1) for a dense model, else every ep dividing the
    expert count, with etp = -1 (tp) and, under tp > 1, etp = 1. Which of them kiln runs is
    `kiln_accepts`' to say (ParallelDims.from_config's own ep checks), not repeated here."""
    out = [(1, -1)]
    for ep in divisors(shape.moe_experts)[1:] if shape.moe_layers else []:
        out += [(ep, etp) for etp in ((-1, 1) if tp > 1 else (-1,))]
    return out


@functools.lru_cache(maxsize=4096)
def kiln_accepts(world: int, mode: str, replicate: int, shard: int, tp: int, pp: int, cp: int, ep: int = 1,
                 etp: int = -1, seq_len: int | None = None, diloco_inner_steps: int = 0) -> bool:
    """Whether kiln's own mesh checks (`ParallelDims.from_config`, as `kiln train` calls it) accept
    this mesh on `world` processes and resolve it to the same degrees and dp mode."""
    from kiln.config import ParallelConfig
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    cfg = ParallelConfig(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp_mode=mode,
                         diloco_inner_steps=diloco_inner_steps)
    try:
        dims = ParallelDims.from_config(cfg, world_size=world, rank=0, local_rank=0, local_world_size=world,
                                        seq_len=seq_len)
    except ConfigError:
        return False
    return (dims.dp_replicate, dims.dp_shard, dims.dp_mode) == (replicate, shard, mode)


def pipeline_schedules(n_layers: int, pp: int, microbatches: int, dp_mode: str, replicas: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) `kiln train` runs for a pipeline of `pp` stages: gpipe and 1f1b;
    with 2 stages per rank (an even layer split) interleaved 1F1B and the zero-bubble ZB1P and ZBV
    where the micro-batches are a multiple of pp (kiln/parallel/pipeline.py check_pipeline_config),
    the zero-bubble ones not under ddp/zero1 across `replicas` = dp_replicate x cp > 1: kiln runs
    them there, but averages the gradients after the schedule's step with nothing overlapping
    (kiln/parallel/data_parallel.py SplitBackwardReplicas, as torch's split weight pass bypasses
    DDP's hooks), which the timing model's DDP overlap does not describe, so they are not proposed
    (the other schedules overlap it, under tp too: OverlappedStageReplicas).
    DualPipeV too where torch has it and the micro-batches are at least its 2 pp stages.
    Compiled runs are never pipelined here (search compiles only one device), so the refusal of
    compile with zero bubble does not arise."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    if n_layers % (2 * pp) or microbatches % pp:
        return out
    out.append(("interleaved_1f1b", 2))
    if not (dp_mode in ("ddp", "zero1") and replicas > 1):
        out += [("interleaved_zero_bubble", 2), ("zbv_zero_bubble", 2)]
        if microbatches >= 2 * pp and _dualpipev_available():
            out.append(("dualpipev", 2))
    return out


@functools.cache
def _dualpipev_available() -> bool:
    from kiln.parallel.pipeline_layout import schedule_available  # imports torch: not at the top

    return schedule_available("dualpipev")


def enumerate_layouts(shape: ModelShape, cluster: Cluster, seq_len: int, global_batch: int,
                      precision: str, loss: str = "full", ac_choices: tuple[str, ...] = AC_CHOICES,
                      max_tp: int = 1024, max_pp: int = 64, max_cp: int = 8, diloco_inner_steps: int = 0,
                      diloco_stream: tuple[int, int, int] = (1, 0, 4), grad_wire_bytes: int = 4):
    """Every layout of `global_batch` sequences on `cluster` kiln's dims accept; with DiLoCo
    (H = diloco_inner_steps) the layouts of one replica per island (module docstring), each with
    Streaming DiLoCo's `diloco_stream` = (fragments, sync delay, wire bytes per element)."""
    replicas = check_islands(cluster, diloco_inner_steps)
    if global_batch % replicas:
        return
    global_batch //= replicas  # one replica's share; world below is one replica's devices
    world = cluster.world_size // replicas
    head = shape.q_dim // shape.n_heads
    kv_heads = shape.kv_dim // head
    for tp in divisors(cluster.gpus_per_node):
        if world % tp or shape.n_heads % tp or kv_heads % tp or tp > max_tp:
            continue
        for pp in divisors(world // tp):
            if shape.n_layers % pp or pp > max_pp:
                continue
            for cp in _powers_of_two_dividing(world // (tp * pp)):
                if cp > max_cp or seq_len % (2 * cp) or (cp > 1 and seq_len // cp < 128):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                for mode, rep, shard in _dp_splits(dp, diloco=replicas > 1):
                    rep *= replicas
                    experts = [(ep, etp) for ep, etp in expert_layouts(shape, tp)
                               if kiln_accepts(world * replicas, mode, rep, shard, tp, pp, cp, ep, etp, seq_len,
                                               diloco_inner_steps)]
                    for mb in _powers_of_two_dividing(per_rank):
                        ga = per_rank // mb
                        if pp > 1 and ga < pp:
                            continue
                        ddp_ranks = (rep if replicas == 1 else shard) * cp  # DiLoCo: inside a replica
                        for sched, v in pipeline_schedules(shape.n_layers, pp, ga, mode, ddp_ranks):
                            reshard = fsdp_reshard_choices(cluster, mode, shard * cp, tp, pp, replicas > 1)
                            for (ep, etp), ac, k, (cp_mode, degree, rounds) in itertools.product(
                                    experts, ac_choices, reshard, cp_modes(shape, cluster, tp, cp)):
                                yield Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode,
                                             ulysses_degree=degree, ulysses_rounds=rounds, ep=ep,
                                             etp=etp, dp_mode=mode, micro_batch=mb, grad_accum=ga, ac=ac,
                                             schedule=sched, virtual_stages=v, precision=precision, loss=loss,
                                             diloco_inner_steps=diloco_inner_steps, fsdp_reshard_to=k,
                                             diloco_fragments=diloco_stream[0], diloco_sync_delay=diloco_stream[1],
                                             diloco_wire_bytes=diloco_stream[2], grad_wire_bytes=grad_wire_bytes,
                                             ep_node_ranks=ep_node_ranks(cluster, ep, 1 if etp == 1 else tp))


def cp_modes(shape: ModelShape, cluster: Cluster, tp: int, cp: int) -> list[tuple[str, int, int]]:
    """(parallel.cp_mode, parallel.ulysses_degree, parallel.ulysses_rounds) for cp: none without cp;
    the ring; Ulysses over all of cp where cp divides the heads of a tp rank (kiln/parallel/dims.py
    check_model), in one exchange and in 2 and 4 rounds where those divide the heads it leaves a
    rank; and where cp x tp outgrows a node, Ulysses over one node's cp ranks with the ring across
    the nodes (USP's layout), where those divide the heads."""
    if cp == 1:
        return [("ring", 0, 1)]
    heads = shape.n_heads // tp
    out = [("ring", 0, 1)]
    if heads % cp == 0:
        out += [("ulysses", 0, rounds) for rounds in (1, 2, 4) if (heads // cp) % rounds == 0]
    node = cluster.gpus_per_node // tp if cluster.gpus_per_node % tp == 0 else 0
    if 1 < node < cp and cp % node == 0 and heads % node == 0:
        out.append(("ulysses", node, 1))
    return out


def fsdp_reshard_choices(cluster: Cluster, mode: str, shard_ranks: int, tp: int, pp: int, diloco: bool) -> list[int]:
    """parallel.fsdp_reshard_to values worth weighing: 0 (reshard over all the shard ranks), and
    under fsdp whose shard ranks span nodes, a node's GPUs, so backward's gathers stay inside a
    node; only where kiln takes it (dims.check_fsdp_reshard_to: FSDP's mesh is every rank, so
    tp = pp = 1 and no DiLoCo replicas)."""
    if mode != "fsdp" or tp > 1 or pp > 1 or diloco:
        return [0]
    k = cluster.gpus_per_node
    return [0, k] if 2 <= k < shard_ranks and shard_ranks % k == 0 else [0]


def ep_node_ranks(cluster: Cluster, ep: int, stride: int) -> int:
    """parallel.ep_node_ranks for an ep group of ranks `stride` apart: the ranks of one node where
    the group spans nodes that its nodes split evenly (the exchange then crosses once per node,
    docs/parallel.md), else 0 (one level)."""
    local = cluster.gpus_per_node // stride if cluster.gpus_per_node % stride == 0 else 0
    return local if 1 < local < ep and ep % local == 0 else 0


def search(shape: ModelShape, cluster: Cluster, seq_len: int, global_batch: int, *, optimizer: str = "adamw",
           precision: str = "bf16", loss: str = "full", top: int | None = None, max_tp: int = 1024,
           max_pp: int = 64, max_cp: int = 8, compiled: bool = False, diloco_inner_steps: int = 0,
           op_checkpointing: bool = True, diloco_stream: tuple[int, int, int] = (1, 0, 4),
           grad_wire_bytes: int = 4) -> list[Plan]:
    """Every layout that fits, fastest first; a KilnError saying what would fit when none does.
    max_tp/max_pp/max_cp limit the degrees (1: layouts `kiln train` runs before TP/PP/CP land).
    compiled: train.compile with a whole-model scope, which kiln applies on one device (sharded
    layouts compile per block, which the compiled memory and time terms do not describe).
    diloco_inner_steps: DiLoCo with H inner steps, one replica per island of `cluster`;
    diloco_stream: Streaming DiLoCo's (fragments, sync delay, wire bytes per element).
    op_checkpointing: whether "op" activation checkpointing may be weighed (kiln refuses it with
    dropout). grad_wire_bytes: the data-parallel gradient reductions' bytes per element
    (parallel.reduce_dtype: 4 fp32, 2 bf16)."""
    replicas = check_islands(cluster, diloco_inner_steps)
    if precision == "float8" and cluster.device.peak_tflops_fp8 == 0:
        raise KilnError(f"{cluster.device.name} has no float8 tensor cores; use --precision bf16")
    budget = cluster.device.usable_bytes
    fits, smallest, count = [], None, 0
    for layout in enumerate_layouts(shape, cluster, seq_len, global_batch, precision, loss, ("none",),
                                    max_tp, max_pp, max_cp, diloco_inner_steps, diloco_stream, grad_wire_bytes):
        count += 1
        if compiled and layout.world_size == 1:
            layout = dataclasses.replace(layout, compiled=True)
        if cluster.backend == "nccl" and fuses_projections(layout):
            layout = dataclasses.replace(layout, fused_projections=True)
        if cluster.backend == "gloo":  # CPUs: the ring's blocks on torch's fused kernel (no dropout assumed)
            layout = dataclasses.replace(layout, fused_ring_blocks=True)
        try:  # the least recompute that fits (kiln/plan/ac.py); recompute only ever costs time
            ac, mem = plan_activation_checkpointing(
                shape, layout, seq_len, budget, optimizer,
                (lambda ac, layout=layout: step_time(shape, dataclasses.replace(layout, ac=ac), seq_len, cluster,
                                                     optimizer).total) if op_checkpointing else None)
        except KilnError:
            ac = "full"
            mem = rank_memory(shape, dataclasses.replace(layout, ac=ac), seq_len, optimizer)
        layout = dataclasses.replace(layout, ac=ac)
        if smallest is None or mem.total < smallest[1].total:
            smallest = (layout, mem)
        if mem.total <= budget:
            fits.append(Plan(layout, mem, step_time(shape, layout, seq_len, cluster, optimizer)))
    if not count:
        if global_batch % replicas:
            raise KilnError(f"no valid layout: global batch {global_batch} sequences cannot be split over "
                            f"{replicas} DiLoCo replicas (one per island); use a multiple of {replicas}")
        raise KilnError(f"no valid layout: global batch {global_batch} sequences cannot be split over "
                        f"{cluster.world_size} GPUs; use a multiple of {cluster.world_size // math.gcd(cluster.world_size, global_batch) * global_batch}")
    if not fits:
        layout, mem = smallest
        need_gpus = cluster.world_size * math.ceil(mem.total / budget)
        raise KilnError(
            f"nothing fits: the leanest layout ({layout.describe()}) needs {mem.total / 2**30:,.1f} GiB per GPU, "
            f"{cluster.device.name} has {budget / 2**30:,.1f} GiB usable; try about {need_gpus} GPUs "
            f"(--nodes {math.ceil(need_gpus / cluster.gpus_per_node)}), a device with more memory, a smaller "
            f"model or a shorter sequence")
    fits.sort(key=lambda p: (p.time.total, p.memory.total))
    return fits[:top] if top else fits


def model_for_params(n_params: float, vocab: int, seq_len: int) -> ModelConfig:
    """A kiln model shape with about `n_params` parameters: head dim 64 below dim 1024 and 128
    above, and the depth whose dim/n_layers ratio is nearest the usual 64-128 (GPT-2, Llama)."""
    best, best_score = None, math.inf
    for layers in range(2, 161):
        # per layer ~ 12 dim^2 (4 attention + 8 MLP with the 8/3 gated hidden); embeddings vocab*dim
        a, b, c = 12 * layers, vocab, -n_params
        dim = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        head = 64 if dim < 1024 else 128
        dim = max(head, round(dim / head) * head)
        m = ModelConfig(dim=dim, n_layers=layers, n_heads=dim // head, max_seq_len=seq_len, vocab_size=vocab)
        got = ModelShape.from_config(m, vocab).params
        score = abs(math.log(got / n_params)) * 4 + abs(math.log((dim / layers) / (64 if dim < 2048 else 128)))
        if score < best_score:
            best, best_score = m, score
    return best


def config_for_plan(cfg: JobConfig, layout: Layout) -> JobConfig:
    """`cfg` with `[parallel]` and `[train]` set to `layout`. Under pp the layout's grad_accum
    micro-batches are the schedule's micro-batches (kiln's pipeline step runs the accumulated batch
    as one schedule step split into parallel.pp_microbatches)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.ep = (layout.dp_replicate, layout.dp_shard, layout.tp,
                                                         layout.pp, layout.cp, layout.ep)
    p.etp, p.ep_node_ranks, p.cp_mode, p.ulysses_degree = (layout.etp, layout.ep_node_ranks, layout.cp_mode,
                                                           layout.ulysses_degree)
    p.ulysses_rounds = layout.ulysses_rounds
    p.dp_mode, p.fsdp_reshard_to = layout.dp_mode, layout.fsdp_reshard_to
    if layout.pp > 1:
        p.pp_schedule, p.pp_virtual_stages, p.pp_microbatches = layout.schedule, layout.virtual_stages, layout.grad_accum
    out.train.batch_size, out.train.grad_accum = layout.micro_batch, layout.grad_accum
    if cfg.train.global_batch_size:  # kept as the config's way of naming the batch: the plan's own
        out.train.global_batch_size = layout.micro_batch * layout.grad_accum * layout.dp
    out.train.activation_checkpointing = layout.ac
    if layout.precision == "float8":
        out.train.dtype, out.train.float8 = "bf16", True
    else:
        out.train.dtype = layout.precision
    return out.validate()


def fuses_projections(layout: Layout) -> bool:
    """Whether `model.fused_projections = "auto"` fuses q/k/v and w1/w3 on GPUs in this layout
    (kiln/train/system.py resolve_fused_projections: not where FSDP shards the weights; the
    separate linears under tp and float8, kiln/model/transformer.py)."""
    sharded = layout.dp * layout.cp > 1 and layout.dp_mode in ("fsdp", "zero2")
    return not sharded and layout.tp == 1 and layout.precision != "float8"


def kiln_refusal(cfg: JobConfig, layout: Layout, world_size: int) -> str | None:
    """Why `kiln train` would refuse `layout` for `cfg` on `world_size` processes, or None: the
    trainer's own checks (config validation, ParallelDims, the model and pipeline checks), so a
    plan is never one kiln cannot run (e.g. pp with tied embeddings)."""
    from kiln.parallel.dims import ParallelDims

    try:
        ParallelDims.for_job(config_for_plan(cfg, layout), world_size=world_size, rank=0, local_rank=0,
                             local_world_size=world_size)
    except KilnError as e:
        return str(e)
    return None


def plan_toml(cfg: JobConfig, plan: Plan) -> str:
    head = (f"# written by kiln plan: {plan.layout.describe()}\n# predicted step {plan.time.total:.4g} s, "
            f"{plan.memory.total / 2**30:.2f} GiB per rank\n")
    return head + to_toml(config_for_plan(cfg, plan.layout))

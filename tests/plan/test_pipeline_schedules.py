"""The planner's pipeline terms against torch's own schedules, and hand-computed values.

torch builds each schedule's per-rank action list (`pipeline_order`: F forward, I input-gradient
backward, W weight-gradient backward, B both) when the schedule is constructed; here it is built
with stand-in stages that carry only what the constructors read (no process group, no model).
`list_schedule` (written here; torch's `_simulate_comms_compute` counts unit steps only) runs the
lists with per-pass times: each rank takes its actions in order, an action starts when its rank is
free and its input exists (F after the previous stage's F, I/B after the next stage's I/B or, on
the last stage, after its own F, W after its I; DualPipeV's overlapped pair, F of one micro-batch
and B of another, runs as its two actions one after the other, as torch runs it without an overlap
callback). Idle time = makespan - a rank's busy time; the
activations a rank holds = its forwards done less its W/B done (torch keeps a micro-batch's graph
until its weight pass), a chunk counting 1/v of a stage."""

import dataclasses

import pytest
import torch
from torch.distributed import pipelining

from kiln.config import load_config
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape, in_flight_microbatches, rank_memory, ring_block_bytes
from kiln.plan.search import enumerate_layouts, kiln_refusal, pipeline_schedules
from kiln.plan.timing import bubble_fraction, pass_split, pipeline_p2p_per_microbatch, step_time

CLASSES = {"interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
           "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
           "zbv_zero_bubble": pipelining.ScheduleZBVZeroBubble}
if hasattr(pipelining, "ScheduleDualPipeV"):  # torch 2.9 and later
    CLASSES["dualpipev"] = pipelining.ScheduleDualPipeV
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class _Stage:
    """What torch's multi-stage schedule constructors read from a stage (rank 0's view: every
    schedule computes all ranks' orders)."""

    def __init__(self, index: int, n_stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = {}


def letter(action) -> str:
    """An action's letter ("F", "I", "W", "B", "SEND_F", ...): the enum's value from 2.7, its str
    on torch 2.6 (whose values are ints)."""
    value = action.computation_type.value
    return value if isinstance(value, str) else str(action.computation_type)


def torch_schedule(name: str, pp: int, m: int):
    n = 2 * pp  # two stages per rank
    ids = [0, n - 1] if name in ("zbv_zero_bubble", "dualpipev") else [0, pp]  # rank 0's: the V, or looped
    return CLASSES[name]([_Stage(i, n, pp) for i in ids], n_microbatches=m, loss_fn=lambda out, target: out)


def list_schedule(order: dict, f: float, b: float, w: float, v: int = 2):
    """(makespan, busy time of a rank, peak in-flight stage micro-batches per rank) of torch's
    per-rank action lists with pass times f, b, w per stage (a chunk takes 1/v of them)."""
    time = {"F": f / v, "I": b / v, "W": w / v, "B": (b + w) / v}
    lists = {r: [sub for a in ops if a is not None for sub in (a.sub_actions or [a] if letter(a) == "OVERLAP_F_B" else [a])
                 if letter(sub) in time] for r, ops in order.items()}
    last = max(a.stage_index for ops in lists.values() for a in ops)
    done, clock, nxt = {}, dict.fromkeys(lists, 0.0), dict.fromkeys(lists, 0)
    busy, live, peak = dict.fromkeys(lists, 0.0), dict.fromkeys(lists, 0), dict.fromkeys(lists, 0)
    while any(nxt[r] < len(lists[r]) for r in lists):
        moved = False
        for r, ops in lists.items():
            while nxt[r] < len(ops):
                stage, kind, mb = ops[nxt[r]].stage_index, letter(ops[nxt[r]]), ops[nxt[r]].microbatch_index
                if kind == "F":
                    needs = [] if stage == 0 else [(stage - 1, "F", mb)]
                elif kind in "IB":
                    needs = [(stage, "F", mb)] if stage == last else [(stage + 1, "I", mb), (stage + 1, "B", mb)]
                else:
                    needs = [(stage, "I", mb)]
                ready = [done[k] for k in needs if k in done]
                if needs and not ready:
                    break
                clock[r] = max([clock[r], *ready]) + time[kind]
                busy[r] += time[kind]
                done[(stage, kind, mb)] = clock[r]
                live[r] += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
                peak[r] = max(peak[r], live[r])
                nxt[r] += 1
                moved = True
        assert moved, "torch's order deadlocked in the list schedule"
    assert len(set(round(x, 9) for x in busy.values())) == 1  # every rank does the same work
    return max(clock.values()), next(iter(busy.values())), {r: p / v for r, p in peak.items()}


def _shape(layers=8, dim=64):
    m = load_config(None, [f"model.dim={dim}", f"model.n_layers={layers}", "model.n_heads=4", "model.vocab_size=300",
                           "model.tie_embeddings=false"]).model
    return ModelShape.from_config(m, 300)


# pass shares with w <= f <= b: the paper's equal thirds, this file's model (attention adds to
# f and twice to b), heavy attention, and full recompute (a forward more in b)
SPLITS = [(1 / 3, 1 / 3, 1 / 3), pass_split(_shape(), Layout(), 64), pass_split(_shape(), Layout(), 2048),
          pass_split(_shape(), Layout(ac="full"), 512), (0.3, 0.45, 0.25)]


def runnable(shapes):
    """(schedule, pp, m) for every schedule and shape it runs: DualPipeV takes at least 2 pp
    micro-batches (torch's rule; kiln refuses fewer)."""
    return [(name, pp, m) for name in CLASSES for pp, m in shapes if name != "dualpipev" or m >= 2 * pp]


@pytest.mark.parametrize("name,pp,m", runnable([(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12), (8, 16)]))
def test_bubble_and_in_flight_match_torchs_orders(name, pp, m):
    order = torch_schedule(name, pp, m).pipeline_order
    layout = Layout(pp=pp, grad_accum=m, schedule=name, virtual_stages=2)
    # ZB1P also where a weight pass outlasts a forward (its bubble then stops shrinking)
    for split in SPLITS + ([(0.3, 0.3, 0.4)] if name == "interleaved_zero_bubble" else []):
        span, busy, peak = list_schedule(order, *split)
        assert bubble_fraction(layout, split) == pytest.approx((span - busy) / busy, rel=1e-9), split
    assert in_flight_microbatches(layout) == pytest.approx(max(peak.values()))


@pytest.mark.parametrize("name,pp,m", runnable([(2, 4), (4, 8), (8, 8)]))
def test_pipeline_sends_and_receives_are_torchs(name, pp, m):
    schedule = torch_schedule(name, pp, m)
    if not hasattr(schedule, "pipeline_order_with_comms"):
        pytest.skip(f"torch {torch.__version__}'s schedules build no order with their sends and receives")
    comms = schedule.pipeline_order_with_comms
    per_rank = [sum(a is not None and letter(a) in COMMS for a in ops) / m for ops in comms.values()]
    assert pipeline_p2p_per_microbatch(Layout(pp=pp, grad_accum=m, schedule=name, virtual_stages=2)) == \
        pytest.approx(sum(per_rank) / pp)


def test_hand_computed_bubbles_and_in_flight():
    """p = 4, m = 8, T_F = T_B = T_W: 1F1B idles 3 stage-steps of 3 passes in 8 x 3 of work; the
    interleaved schedules split each stage in two."""
    for sched, v, bubble in [("gpipe", 1, 3 / 8), ("1f1b", 1, 3 / 8), ("interleaved_1f1b", 2, 3 / 16),
                             ("interleaved_zero_bubble", 2, 3 * (1 / 3) / 16), ("zbv_zero_bubble", 2, 3 * (1 / 3) / 16),
                             ("dualpipev", 2, 3 * (1 / 3) / 16)]:
        layout = Layout(pp=4, grad_accum=8, schedule=sched, virtual_stages=v)
        assert bubble_fraction(layout) == pytest.approx(bubble), sched
    # ZB-H1 (Qi et al. 2023): (p-1)(T_F + T_B - T_W); f=0.3, b=0.45, w=0.25 over m v = 16
    zb1p = Layout(pp=4, grad_accum=8, schedule="interleaved_zero_bubble", virtual_stages=2)
    assert bubble_fraction(zb1p, (0.3, 0.45, 0.25)) == pytest.approx(3 * 0.5 / 16)
    # torch's ZBV pads m = p to 2p - 1 micro-batches: (p-1)(b + max(f, b)) / (2m) = 3 * 2/3 / 8
    assert bubble_fraction(Layout(pp=4, grad_accum=4, schedule="zbv_zero_bubble", virtual_stages=2)) == \
        pytest.approx(0.25)
    assert bubble_fraction(Layout(pp=1, grad_accum=8, schedule="zbv_zero_bubble", virtual_stages=2)) == 0.0
    # DualPipeV without an overlap, full recompute's shape (f=0.2, b=0.7, w=0.1): its cool-down's
    # input passes dominate, (p-1)(2b - w) - f = 3.7 over 2m = 16
    assert bubble_fraction(Layout(pp=4, grad_accum=8, schedule="dualpipev", virtual_stages=2), (0.2, 0.7, 0.1)) == \
        pytest.approx(3.7 / 16)
    # in flight at p = 4, m = 8: gpipe all 8, 1f1b 4, interleaved 4(1 + 3/8) = 5.5, zero bubble 4,
    # DualPipeV one chunk (half a stage) more
    expect = {"gpipe": 8, "1f1b": 4, "interleaved_1f1b": 5.5, "interleaved_zero_bubble": 4, "zbv_zero_bubble": 4,
              "dualpipev": 4.5}
    for sched, n in expect.items():
        v = 1 if sched in ("gpipe", "1f1b") else 2
        assert in_flight_microbatches(Layout(pp=4, grad_accum=8, schedule=sched, virtual_stages=v)) == n


def test_pass_split_by_flops():
    shape = _shape(layers=2, dim=64)
    f, b, w = pass_split(shape, Layout(), 32)
    weights = 2 * (shape.params - shape.embedding_params + 300 * 64)  # 2 FLOPs per weight and token per pass
    attention = 4 * 2 * 64 * 32
    total = 3 * weights + 3 * attention
    assert (f, b, w) == pytest.approx(((weights + attention) / total, (weights + 2 * attention) / total,
                                       weights / total))
    rf, rb, rw = pass_split(shape, Layout(ac="full"), 32)
    assert rw < w and rb > b and rf + rb + rw == pytest.approx(1.0)  # the recompute lands in the input pass
    assert rw <= rf <= rb


def test_the_zero_bubble_schedules_are_timed_and_ranked():
    """Same layout, same cluster: ZB1P/ZBV idle less than interleaved 1F1B, which idles less than 1F1B."""
    shape, cluster = _shape(), load_cluster("h100")
    times = {s: step_time(shape, Layout(pp=4, grad_accum=8, schedule=s, virtual_stages=1 if s == "1f1b" else 2),
                          512, cluster).bubble for s in ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble",
                                                         "zbv_zero_bubble")}
    assert times["zbv_zero_bubble"] < times["interleaved_1f1b"] < times["1f1b"]
    assert times["interleaved_zero_bubble"] < times["interleaved_1f1b"]


def test_fsdp_stays_gathered_under_zero_bubble():
    """kiln/parallel/pipeline.py keep_gathered_until_backward: memory and all-gathers as zero2's."""
    shape, cluster = _shape(), load_cluster("h100")
    base = dict(pp=2, dp_shard=4, grad_accum=4, virtual_stages=2)
    zb = Layout(dp_mode="fsdp", schedule="zbv_zero_bubble", **base)
    as_zero2 = Layout(dp_mode="zero2", schedule="zbv_zero_bubble", **base)
    looped = Layout(dp_mode="fsdp", schedule="interleaved_1f1b", **base)
    assert rank_memory(shape, zb, 512).temporary == rank_memory(shape, as_zero2, 512).temporary
    assert rank_memory(shape, zb, 512).temporary > rank_memory(shape, looped, 512).temporary
    gathers = {lay.schedule + lay.dp_mode: step_time(shape, lay, 512, cluster).calls["all_gather"]
               for lay in (zb, as_zero2, looped)}
    assert gathers["zbv_zero_bubblefsdp"] == gathers["zbv_zero_bubblezero2"] < gathers["interleaved_1f1bfsdp"]


def test_context_parallel_divides_activations_per_rank():
    shape = _shape()
    # fp32: no weight casts; 8 sequences: every rank's eager peak is in the loss's backward
    one = rank_memory(shape, Layout(micro_batch=8, precision="fp32"), 1024)
    for cp in (2, 4):
        split = rank_memory(shape, Layout(micro_batch=8, cp=cp, precision="fp32", fused_ring_blocks=True), 1024)
        assert split.notes == one.notes == ["eager peak in the loss's backward"]
        assert split.activations == pytest.approx(one.activations / cp)
        assert split.temporary == pytest.approx(one.temporary / cp)  # the logits of the rank's tokens
        # the matmul block kernel (GPUs) adds its block's scores (test_memory_model.py)
        matmul = rank_memory(shape, Layout(micro_batch=8, cp=cp, precision="fp32"), 1024)
        assert matmul.temporary - split.temporary == pytest.approx(ring_block_bytes(shape, Layout(
            micro_batch=8, cp=cp), 1024))
        assert split.parameters == one.parameters  # cp ranks hold the whole model


def test_search_proposes_zero_bubble_where_kiln_runs_it():
    dualpipev = [("dualpipev", 2)] if "dualpipev" in CLASSES else []
    assert pipeline_schedules(8, 2, 4, "fsdp", 1)[3:] == [("interleaved_zero_bubble", 2), ("zbv_zero_bubble", 2),
                                                         *dualpipev]
    assert ("dualpipev", 2) not in pipeline_schedules(8, 4, 4, "fsdp", 1)  # 4 micro-batches, 8 stages: refused
    assert ("zbv_zero_bubble", 2) in pipeline_schedules(8, 2, 4, "ddp", 1)  # one replica: no DDP wrapper
    assert ("zbv_zero_bubble", 2) not in pipeline_schedules(8, 2, 4, "ddp", 2)  # runs, not modelled: SplitBackwardReplicas
    assert ("interleaved_1f1b", 2) in pipeline_schedules(8, 2, 6, "fsdp", 1)  # 6 micro-batches, pp 2: fine
    assert pipeline_schedules(8, 4, 6, "fsdp", 1) == [("gpipe", 1), ("1f1b", 1)]  # 6 % 4: refused by kiln
    assert pipeline_schedules(6, 2, 4, "fsdp", 1) == [("gpipe", 1), ("1f1b", 1)]  # 6 layers, 4 stages: uneven
    cfg = load_config(None, ["model.dim=64", "model.n_layers=8", "model.n_heads=4", "data.seq_len=64",
                             "model.max_seq_len=64", "model.tie_embeddings=false"])
    cluster = dataclasses.replace(load_cluster("cpu-local"), gpus_per_node=8)
    zero_bubble = [lay for lay in enumerate_layouts(_shape(), cluster, 64, 32, "bf16", ac_choices=("none",))
                   if lay.schedule in CLASSES and lay.schedule != "interleaved_1f1b"]
    assert {lay.schedule for lay in zero_bubble} == {"interleaved_zero_bubble", "zbv_zero_bubble", *dict(dualpipev)}
    for lay in zero_bubble:
        assert kiln_refusal(cfg, lay, 8) is None, lay.describe()

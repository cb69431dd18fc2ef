"""Pipeline terms of the step-time model (kiln/plan/timing.py): how a micro-batch's compute splits
over the forward, input-gradient and weight-gradient passes, the idle (bubble) fraction per
schedule, and the stage-boundary sends and receives per micro-batch. Closed forms checked against
torch's own schedule action lists in tests/plan/test_pipeline_schedules.py."""

from __future__ import annotations

from kiln.plan.memory import V_SHAPED, Layout, ModelShape, recomputed_matmul_blocks


def pass_split(shape: ModelShape, layout: Layout, seq_len: int) -> tuple[float, float, float]:
    """Shares (f, b, w) of a micro-batch's compute in the forward, the input-gradient backward and
    the weight-gradient backward, by FLOPs per token: every matmul weight costs 2 per pass (forward
    x W, grad x W^T for the input, grad^T x input for the weight); attention's score and value
    products (4 * seq * dim per layer forward, the 12*L*dim*seq convention) have no weight, so
    backward's 8 * seq * dim are all input gradient; a recomputed block's forward runs in the
    input pass (the checkpoint's unpack hook fires on backward's first read). Always w <= f <= b."""
    non_embed = shape.params - shape.embedding_params + shape.vocab * shape.dim
    attention = 4 * shape.q_dim * shape.attention_keys(seq_len)  # sliding-window layers: the window's keys
    per_layer = 2 * shape.layer_params + attention / shape.n_layers
    recompute = recomputed_matmul_blocks(layout.ac, shape.n_layers) * per_layer
    f, b, w = 2 * non_embed + attention, 2 * non_embed + 2 * attention + recompute, 2 * non_embed
    return f / (f + b + w), b / (f + b + w), w / (f + b + w)


def bubble_fraction(layout: Layout, split: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)) -> float:
    """Idle time of a pipeline step relative to its compute, p = pp stages, m micro-batches, v
    stages per rank, (f, b, w) the shares of forward, input-gradient and weight-gradient work
    (`pass_split`; the zero-bubble paper's T_F = T_B = T_W by default):
      gpipe, 1f1b          (p-1)/m                  (Narayanan et al. 2021, sec. 2.2)
      interleaved_1f1b     (p-1)/(m v)
      interleaved_zero_bubble  (p-1)(f + b - min(w, f))/(m v): ZB-H1 (Qi et al. 2023, sec. 3),
                           whose weight passes fill all but T_F + T_B - T_W of each warm-up slot
      zbv_zero_bubble (v=2)    (p-1) max(b, 2(b - w))/(2m) for m >= 2p - 1, else (p-1)(b + max(f, b))/(2m)
      dualpipev (v=2, m >= 2p) max((p-1)(f + b - w), (p-1)(2b - w) - f)/(2m)
    The two zero-bubble lines are torch's own orders (pipelining/schedules.py: ZB1P with one
    warm-up forward per hop, the V with its fixed F/I/W pattern, padded to 2p - 1 micro-batches),
    list-scheduled with these pass times: tests/plan/test_pipeline_schedules.py derives them from
    torch's action lists. torch's ZBV is not the paper's ideal (zero at T_F = T_B = T_W): its
    fixed order idles one input pass per hop. Checked for m a multiple of p (kiln's rule for
    multi-stage schedules) and, for ZBV, w <= f <= b, which `pass_split` always gives; outside it
    torch's order idles more. DualPipeV (DeepSeek-V3's, cut to a V) pairs one micro-batch's forward
    with another's backward (OVERLAP_F_B); torch runs the pair one after the other unless a callback
    overlaps them (kiln registers none), so its F&B is F + B here, and its line is its order's list
    schedule under that (same test file): about ZBV's, its gain is what an overlap would hide."""
    p, m = layout.pp, layout.grad_accum
    if p == 1:
        return 0.0
    f, b, w = split
    if layout.schedule == "interleaved_zero_bubble":
        return (p - 1) * (f + b - min(w, f)) / (m * layout.virtual_stages)
    if layout.schedule == "zbv_zero_bubble":
        warm = max(b, 2 * (b - w)) if m >= 2 * p - 1 else b + max(f, b)
        return (p - 1) * warm / (2 * m)
    if layout.schedule == "dualpipev":
        return max((p - 1) * (f + b - w), (p - 1) * (2 * b - w) - f) / (2 * m)
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    return (p - 1) / (m * v)


def pipeline_p2p_per_microbatch(layout: Layout) -> float:
    """Sends and receives a pipeline rank issues per micro-batch, on average over the pp ranks:
    every stage boundary between two ranks costs a send and a receive forward and again backward
    (4 ops), and there are p-1 such boundaries with one stage per rank, vp-1 with v looped stages,
    2p-2 with a V (ZBV, DualPipeV; its tip, stages p-1 and p, is one rank's: handed over in memory); so 4(p-1)/p,
    4v - 4/p and 8 - 8/p per rank. Counted in torch's action lists with communication
    (`pipeline_order_with_comms`, tests/plan/test_pipeline_schedules.py). The average, not the
    busiest rank (middle ranks issue 4, 4v, 8): at full speed the ranks wait for each other anyway,
    and where ranks share cores their host work adds up."""
    p = layout.pp
    if p == 1:
        return 0.0
    if layout.schedule in V_SHAPED:
        boundaries = 2 * p - 2
    elif layout.schedule in ("gpipe", "1f1b"):
        boundaries = p - 1
    else:
        boundaries = layout.virtual_stages * p - 1
    return 4 * boundaries / p

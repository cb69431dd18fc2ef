"""Pipeline layout: the schedules kiln offers, the micro-batch count, the checks of the `[parallel]`
pp keys against the model and the batch (before any work, one line naming the key), which stages a
rank holds, and the bubble fraction reported in the run row. Pure arithmetic on the config, so the
planner (kiln/plan/) and the memory estimate use it without building a pipeline
(kiln/parallel/pipeline.py builds and runs one)."""

from __future__ import annotations

from kiln.config import JobConfig
from kiln.errors import ConfigError

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv_zero_bubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank; the others take pp_virtual_stages per rank
# backward split into input and weight passes (DualPipeV: in its warm-up and cool-down)
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
V_SHAPED = ("zbv_zero_bubble", "dualpipev")  # two stages per rank, r and 2pp-1-r


def n_microbatches(cfg: JobConfig) -> int:
    """parallel.pp_microbatches, or (0) one per pipeline stage."""
    p = cfg.parallel
    return p.pp_microbatches or p.pp * p.pp_virtual_stages


def check_pipeline_config(cfg: JobConfig) -> None:
    """Everything about pp that can be wrong, checked before any work (one line naming the key)."""
    from kiln import torch_compat  # here: the planner imports this module without torch

    p = cfg.parallel
    if p.pp == 1:
        return
    stages = p.pp * p.pp_virtual_stages
    if stages > cfg.model.n_layers:
        raise ConfigError(f"parallel.pp={p.pp} x pp_virtual_stages={p.pp_virtual_stages} = {stages} pipeline "
                          f"stages but model.n_layers={cfg.model.n_layers}; lower parallel.pp (each stage "
                          f"needs at least one layer)")
    if p.pp_schedule in SINGLE_STAGE and p.pp_virtual_stages != 1:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} runs one stage per rank; set "
                          f"parallel.pp_virtual_stages=1 or use interleaved_1f1b")
    if p.pp_schedule in V_SHAPED and p.pp_virtual_stages != 2:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} places two stages per rank (a V); "
                          "set parallel.pp_virtual_stages=2")
    batch = cfg.train.batch_size * cfg.train.grad_accum
    m = n_microbatches(cfg)
    if p.pp_schedule == "dualpipev":
        import torch

        if not schedule_available("dualpipev"):
            raise ConfigError(f"parallel.pp_schedule='dualpipev' needs torch's ScheduleDualPipeV, which torch "
                              f"{torch.__version__} lacks (2.9 and later have it); use 'zbv_zero_bubble', the same V")
        if m < 2 * p.pp:  # torch's own rule, raised there only once the stages are built
            raise ConfigError(f"parallel.pp_microbatches={m} is fewer than the {2 * p.pp} stages of "
                              f"parallel.pp_schedule='dualpipev' with parallel.pp={p.pp}; set parallel.pp_microbatches "
                              f"to a multiple of {p.pp}, at least {2 * p.pp}, dividing train.batch_size x "
                              f"grad_accum = {batch}")
    if batch % m:
        raise ConfigError(f"parallel.pp_microbatches={m} must divide train.batch_size x grad_accum = {batch} "
                          f"(each micro-batch must be the same size)")
    if m < p.pp and (p.pp_schedule == "1f1b" or not torch_compat.gpipe_takes_fewer_microbatches()):
        import torch

        raise ConfigError(f"parallel.pp_microbatches={m} is fewer than the parallel.pp={p.pp} stages, which "
                          f"torch {torch.__version__}'s {p.pp_schedule!r} schedule refuses; set "
                          f"parallel.pp_microbatches to at least {p.pp} (0: one per stage), dividing "
                          f"train.batch_size x grad_accum = {batch}")
    if p.pp_schedule not in SINGLE_STAGE and m % p.pp:
        raise ConfigError(f"parallel.pp_microbatches={m} must be a multiple of parallel.pp={p.pp} for "
                          f"{p.pp_schedule!r}")
    if cfg.train.cuda_graphs:  # otherwise "auto" would compile blocks and drop the CUDA graphs silently
        raise ConfigError("train.cuda_graphs=true with parallel.pp > 1: CUDA graphs over the stage chunks "
                          "are not tested (compile_scope='model' compiles each chunk without them); "
                          "set train.cuda_graphs=false")
    if cfg.train.compile and p.pp_schedule in ZERO_BUBBLE:
        # A compiled block's backward is one autograd node (AOTAutograd's) for its input and weight
        # gradients. torch's input pass (pipelining/_backward.py stage_backward_input) runs it whole,
        # and its weight pass (stage_backward_weight) starts again from that node's gradient, running
        # the whole compiled backward a second time: the values are right but nothing is split, and
        # each micro-batch pays the block's backward twice (pinned in tests/parallel/
        # test_pipeline_ac_compile.py). torch refuses compiled stage modules there too
        # (_check_torch_compile_compatibility), but only for OptimizedModule and after the build.
        raise ConfigError(f"train.compile=true with parallel.pp_schedule={p.pp_schedule!r}: a compiled "
                          f"block's backward is one autograd node, so the zero-bubble weight pass would run "
                          f"it again (no input/weight split); set train.compile=false or use interleaved_1f1b")
    if cfg.train.activation_checkpointing == "op" and p.pp_schedule in ZERO_BUBBLE:
        # torch's split backward differentiates each block twice (input pass, then weight pass,
        # retain_graph), recomputing it each time; a selective checkpoint hands out its kept outputs
        # once ("Trying to backward an extra time", torch 2.13, seen with both schedules)
        raise ConfigError(f"train.activation_checkpointing='op' with parallel.pp_schedule={p.pp_schedule!r}: "
                          f"the zero-bubble weight pass runs each block's backward a second time, which a "
                          f"selective checkpoint allows once; set train.activation_checkpointing='full' or "
                          f"'every_k:K', or use interleaved_1f1b")
    if cfg.train.loss == "chunked" and not chunked_loss_fits_schedule(p.pp_schedule):
        import torch

        raise ConfigError(f"train.loss='chunked' with parallel.pp_schedule={p.pp_schedule!r} needs torch >= 2.13 "
                          f"(this is {torch.__version__}: its zero-bubble weight pass cannot differentiate "
                          f"through the chunked loss's autograd function); set train.loss='full' or use 1f1b")
    if (cfg.data.windows == "packed_masked" and p.pp_schedule in ZERO_BUBBLE
            and not torch_compat.input_pass_skips_inputs_without_grad()):
        import torch

        raise ConfigError(f"data.windows='packed_masked' with parallel.pp_schedule={p.pp_schedule!r} needs a torch "
                          f"whose zero-bubble input pass skips inputs without a gradient (the document ids; 2.9 "
                          f"does, this is {torch.__version__}); use 1f1b or interleaved_1f1b")
    if p.pp_split_points:
        stage_layer_ranges(cfg.model.n_layers, stages, p.pp_split_points)


def schedule_available(schedule: str) -> bool:
    """Whether this torch ships the schedule's class (DualPipeV from 2.9; the others from 2.6)."""
    import torch.distributed.pipelining as pipelining

    return hasattr(pipelining, SCHEDULES[schedule])


def chunked_loss_fits_schedule(schedule: str) -> bool:
    """The last stage's chunked head + loss is a custom autograd function, which the zero-bubble
    schedules' weight pass differentiates only from torch 2.13 (kiln/torch_compat.py)."""
    from kiln.torch_compat import weight_pass_takes_python_functions

    return schedule not in ZERO_BUBBLE or weight_pass_takes_python_functions()


def stage_layer_ranges(n_layers: int, n_stages: int, split_points: list[int]) -> list[range]:
    """The layers of each stage. split_points: the first layer of stages 1..n-1 (explicit split);
    empty: as even as possible, earlier stages taking the remainder."""
    if split_points:
        pts = list(split_points)
        if not all(type(x) is int for x in pts) or len(pts) != n_stages - 1 or pts != sorted(set(pts)) or pts[0] <= 0 or pts[-1] >= n_layers:
            raise ConfigError(f"parallel.pp_split_points={pts} must be {n_stages - 1} increasing layer indices "
                              f"in 1..{n_layers - 1} (the first layer of each stage after the first)")
        bounds = [0, *pts, n_layers]
    else:
        base, extra = divmod(n_layers, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def stages_of_rank(schedule: str, pp: int, virtual: int, pp_rank: int) -> list[int]:
    """Stage indices a pp rank holds: looped (r, r+pp, ...) or, for ZBV and DualPipeV, a V (r, 2pp-1-r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Idle share of a step (Narayanan et al. 2021, sec. 2.2): (p-1)/(m+p-1) for GPipe/1F1B, with v
    stages per rank the warm-up shrinks v-fold: (p-1)/(v*m+p-1). The zero-bubble schedules fill it
    with weight-gradient work, so this is their upper bound. torch exposes no such number."""
    if pp == 1:
        return 0.0
    v = 1 if schedule in SINGLE_STAGE else virtual
    return (pp - 1) / (v * microbatches + pp - 1)

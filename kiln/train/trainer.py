"""`kiln train`: build everything from a JobConfig, then run the loop.

Read top to bottom: run directory -> mesh -> data -> model on meta -> parallelize -> materialize
and init -> optimizer and schedule -> resume -> loop. The step itself (`train_step`) is pure
compute; logging, evaluation and checkpointing happen around it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln import torch_compat
from kiln.checkpoint.interval import CheckpointInterval
from kiln.checkpoint.manager import WEIGHTS_ONLY_MARKER, CheckpointManager, ModelOptimizerState, RNGState
from kiln.checkpoint.spike import SpikeGuard
from kiln.config import JobConfig, to_toml
from kiln.data.raw_to_shards import prepare_shards
from kiln.data.loader import Loader, TokenWindows
from kiln.data.shards import ShardSet
from kiln.data.mixture import MixtureWindows
from kiln.data.storage import open_store
from kiln.errors import DataError, KilnError, TrainingDiverged
from kiln.model.transformer import Transformer, count_params, flops_per_token
from kiln.parallel.context_parallel import ContextParallel
from kiln.parallel.diloco import DiLoCo, describe_layout, layout_key, replica_states, replicated_group
from kiln.parallel.diloco import Layout as DiLoCoLayout
from kiln.parallel.diloco import check_resume as check_diloco_resume
from kiln.parallel.data_parallel import batch_group, shard_optimizer_state, sum_over_ranks, window_stats_over_ranks
from kiln.parallel.dims import ParallelDims, pick_device
from kiln.parallel import zero1_shards
from kiln.parallel.parallelize import check_float8_device, compile_scope, parallelize
from kiln.parallel.pipeline import Pipeline, PipelineEvalModel
from kiln.parallel.pipeline_layout import chunked_loss_fits_schedule
from kiln.parallel.timeouts import CollectiveTimeouts, record_nccl_collectives
from kiln.report.run_metrics import read_metrics
from kiln.train.attention import configure_attention
from kiln.train.evaluate import Evaluator, autocast_context
from kiln.train.memory import check_fits_memory
from kiln.train.metrics import MetricsLogger
from kiln.train.optim import build_optimizer
from kiln.train.peak import peak_flops
from kiln.train.pipeline_step import pipeline_train_step
from kiln.train.profiling import StepProfiler
from kiln.train.run_files import check_resume_settings, write_run_files
from kiln.train.schedule import LRSchedule
from kiln.train.step import PendingSteps, skips_on_device, train_step
from kiln.train.system import compute_dtype, memory_mb, resolve_dtype, resolve_fused_projections, resolve_loss


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    final_loss: float
    best_val_loss: float
    last_val_loss: float
    stop_reason: str
    is_main: bool = True  # rank 0 (the one that writes metrics and prints)


class TrainState:
    """Counters that must survive a crash, as a Stateful for the checkpoint."""

    def __init__(self):
        self.step = 0
        self.tokens = 0
        self.best_val_loss = math.inf
        self.evals_without_improvement = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


class ScalerState:
    """torch's GradScaler as a Stateful for the checkpoint (fp16: the loss scale and its growth
    count, so a resumed run skips and grows as the uninterrupted one). Values from a checkpoint are
    checked before torch sees them: a bad one is one line naming the key (the checkpoint manager
    then falls back to an older checkpoint), not an error at the first step."""

    RULES = {"scale": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
             "growth_factor": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 1,
             "backoff_factor": lambda v: isinstance(v, (int, float)) and 0 < v < 1,
             "growth_interval": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
             "_growth_tracker": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0}

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        for key, ok in self.RULES.items():
            if key not in state or not ok(state[key]):
                raise KilnError(f"checkpoint scaler.{key}={state.get(key)!r} is not a valid GradScaler value")
        self.scaler.load_state_dict(state)


def build_mixture(cfg: JobConfig, reference: ShardSet) -> MixtureWindows:
    """data.mixture's shard directories as one weighted MixtureWindows (same tokenizer required)."""
    sources = []
    for i, url in enumerate(cfg.data.mixture):
        shards = ShardSet(url, "train", open_store(url, cfg.data))
        if (shards.vocab_size, shards.eos_id) != (reference.vocab_size, reference.eos_id):
            raise KilnError(f"data.mixture[{i}] {url}: vocab {shards.vocab_size} / eos {shards.eos_id} differ from "
                            f"data.source's {reference.vocab_size} / {reference.eos_id}; tokenize all sources alike")
        sources.append(TokenWindows(shards, cfg.data.seq_len, doc_starts=cfg.data.windows == "doc_start",
                                    doc_ids=cfg.data.windows == "packed_masked"))
    names = [f"mix{i}" for i in range(len(sources))]
    return MixtureWindows(sources, cfg.data.mixture_weights, seed=cfg.train.seed, names=names)


def build_model(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> Transformer:
    cfg.model.fused_projections = resolve_fused_projections(  # saved resolved with the run's config
        cfg.model.fused_projections, device, fsdp=dims.grad_ranks > 1 and dims.dp_mode in ("fsdp", "zero2"))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = parallelize(model, dims, cfg, device)
    model.to_empty(device=device)
    model.init_weights(torch.Generator(device=device).manual_seed(cfg.train.seed))
    return model


def train(cfg: JobConfig, run_dir: str | Path, *, resume: bool | None = None,
          stop_at: int | None = None) -> TrainResult:
    """Train per `cfg` in `run_dir`. resume: None = continue from the latest checkpoint if there is
    one, True = must resume, False = start fresh. stop_at: leave (with a checkpoint) after that
    step, as a time-limited job would; the schedule still spans train.steps. A collective that
    waits past its bound (kiln/parallel/timeouts.py) raises one line, CollectiveTimeout."""
    timeouts = CollectiveTimeouts(cfg.parallel.init_timeout_s, cfg.parallel.train_timeout_s)
    try:
        return _train(cfg, Path(run_dir), timeouts, resume, stop_at)
    except RuntimeError as e:
        if (line := timeouts.explain(e)) is not None:
            raise line from e
        raise


def _train(cfg: JobConfig, run_dir: Path, timeouts: CollectiveTimeouts, resume: bool | None,
           stop_at: int | None) -> TrainResult:
    dims, batch_note = ParallelDims.for_job(cfg)  # grad_accum derived for this layout, every layout check
    device = pick_device(cfg.train.device, dims)
    check_fits_memory(cfg, device, dims)  # before the tokenizer, the shards or the model allocate anything
    fsdp = dims.grad_ranks > 1 and dims.dp_mode in ("fsdp", "zero2")  # what apply_data_parallel shards
    if fsdp and device.type == "cpu" and not torch_compat.fsdp_runs_on_cpu():
        raise KilnError(f"parallel.dp_mode={dims.dp_mode!r} on CPU needs a torch whose FSDP2 runs there (this is "
                        f"{torch.__version__}; 2.11 and 2.13 do); set parallel.dp_mode='ddp' or update torch")
    if dims.grad_ranks > 1 and dims.dp_mode == "zero1":  # saves its share as boxes (zero1_shards.py)
        zero1_shards.require("parallel.dp_mode='zero1'")
    if dims.diloco and dims.grad_ranks > 1 and dims.dp_mode == "ddp" and dims.ep == 1:  # diloco.replicated_group
        zero1_shards.require("DiLoCo with parallel.dp_mode='ddp' inside a replica")
    if device.type == "cuda" and dims.world_size > 1:
        record_nccl_collectives(run_dir / "comm_traces", cfg.parallel.nccl_trace_entries)
    # probes gloo's AVG reduce-scatter (torch_compat.gloo_reduce_scatter_averages)
    dims.build_mesh(device.type, init_timeout_s=cfg.parallel.init_timeout_s)
    hsdp = fsdp and dims.dp_replicate > 1 and not dims.diloco  # FSDP's own all-reduce over dp_replicate
    if fsdp and device.type == "cpu" and not (torch_compat.gloo_reduce_scatter_averages()
                                              or torch_compat.fsdp_can_force_sum(hsdp=hsdp)):
        raise KilnError(f"parallel.dp_mode={dims.dp_mode!r} on CPU under torch {torch.__version__}: gloo sums the "
                        f"gradients where FSDP asks it to average, and this FSDP2 cannot be told to sum instead"
                        f"{' over dp_replicate (HSDP)' if hsdp else ''}; set parallel.dp_mode='ddp'"
                        f"{' or parallel.dp_replicate=1' if hsdp else ''} or use torch >= 2.8")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    cfg.train.dtype = resolve_dtype(cfg.train.dtype, device)
    if cfg.train.dtype == "fp16" and device.type != "cuda":
        raise KilnError("train.dtype='fp16' needs a CUDA device (use bf16 or fp32 on CPU)")
    if cfg.train.autotune and not torch_compat.max_autotune_trains_exactly():
        raise KilnError(f"train.autotune=true under torch {torch.__version__}: its max-autotune compile gives a wrong "
                        f"gradient for tied embeddings (2.7 and later do not); set train.autotune=false or update torch")
    if cfg.train.cuda_graphs and device.type != "cuda":
        raise KilnError(f"train.cuda_graphs=true needs a CUDA device; this run is on {device.type}")
    if cfg.train.float8:
        check_float8_device(device)
    ckpt = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last, dims.is_main,
                             keep_every=cfg.checkpoint.keep_every, async_save=cfg.checkpoint.async_save,
                             make_room=cfg.checkpoint.make_room, stop_on_error=cfg.checkpoint.on_error == "stop",
                             replica_dir=cfg.checkpoint.replica_dir if cfg.checkpoint.memory_replicas else None)
    timeouts.start(keep_init=[ckpt.group])
    if resume is not False:
        ckpt.clean_stray()
    resume_step = ckpt.latest_step()
    if resume and resume_step is None:
        raise KilnError(f"--resume: {run_dir}/checkpoints has no checkpoint to resume from")
    if resume is False and resume_step is not None:
        raise KilnError(f"{run_dir} already has checkpoints (latest step {resume_step}); resume it "
                        f"or choose another --run-dir")
    if resume_step is not None:  # before anything in run_dir is written
        check_resume_settings(cfg, run_dir, resume_step)

    # ---- data (rank 0 writes shards, the others wait and read them)
    if dims.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        shard_dir, tokenizer = prepare_shards(cfg.data, run_dir, log=lambda m: print(m, flush=True))
    _barrier()
    if not dims.is_main:
        shard_dir, tokenizer = prepare_shards(cfg.data, run_dir)
    store = open_store(shard_dir, cfg.data)
    train_windows = TokenWindows(ShardSet(shard_dir, "train", store), cfg.data.seq_len,
                                 doc_starts=cfg.data.windows == "doc_start",
                                 doc_ids=cfg.data.windows == "packed_masked")
    mixture = build_mixture(cfg, train_windows.shards) if cfg.data.mixture else None
    val_set = ShardSet(shard_dir, "val", store)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = train_windows.shards.vocab_size
    elif cfg.model.vocab_size < train_windows.shards.vocab_size:
        raise KilnError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                        f"{train_windows.shards.vocab_size}")

    # ---- model, optimizer, schedule
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, dims, device)
    model.train()
    if cfg.model.moe_experts:  # the expert loads are summed over the data-parallel ranks
        model.moe_load_group = batch_group(dims)
    pipeline = Pipeline(model, cfg, dims, device) if dims.pp > 1 else None
    # Under pp the full loss is the schedule's, outside the compiled stage graphs: no whole-model
    # graph fuses it as on one device. The Pipeline reads the result at each step.
    whole_model_compiled = cfg.train.compile and compile_scope(cfg, dims) == "model" and dims.pp == 1
    model.loss_impl = resolve_loss(cfg.train.loss, device, whole_model_compiled, tp=dims.tp)
    if pipeline is not None and model.loss_impl == "chunked":  # from "auto": check_pipeline_config checked "chunked"
        model.loss_impl = "chunked" if chunked_loss_fits_schedule(cfg.parallel.pp_schedule) else "full"
    attention = configure_attention(model, cfg.train.attention_backend, device, compute_dtype(cfg.train.dtype),
                                    cfg.train.batch_size, cfg.data.seq_len)
    context_parallel = ContextParallel(model, dims, cfg.data.seq_len, device)
    optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, device.type), dims, model)  # ZeRO-1
    schedule = LRSchedule(optimizer, cfg.schedule, cfg.train.steps)
    loader = Loader(mixture or train_windows, cfg.train.batch_size, seed=cfg.train.seed, dp_rank=dims.dp_rank,
                    dp_size=dims.dp_size, prefetch=cfg.data.prefetch, device=device, lookahead=cfg.data.lookahead)
    evaluator = Evaluator(PipelineEvalModel(pipeline) if pipeline else model, val_set, tokenizer, cfg, device,
                          dims, context_parallel)
    state = TrainState()
    stateful = {"app": ModelOptimizerState(model, optimizer), "schedule": schedule, "loader": loader,
                "rng": RNGState(device), "train": state}
    scaler = torch.amp.GradScaler(device.type) if cfg.train.dtype == "fp16" else None
    if scaler is not None:  # the loss scale and its growth count: an fp16 run resumes with its own
        stateful["scaler"] = ScalerState(scaler)
    diloco = None
    par = cfg.parallel
    diloco_layout = (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep, dims.ep_borrows_tp,
                     dims.dp_mode in ("ddp", "zero1") and dims.dp_shard > 1,  # DDP / ZeRO-1 inside a replica
                     par.diloco_fragments, par.diloco_sync_delay > 0)
    if par.diloco_inner_steps:  # replicas = dp_replicate (any layout inside): kiln/parallel/diloco.py
        across = dims.mesh["dp_replicate"] if dims.dp_replicate > 1 else None
        diloco = DiLoCo(model, par.diloco_inner_steps, par.diloco_outer_lr, par.diloco_outer_momentum,
                        group=across.get_group() if across else None,
                        inside=replicated_group(dims), fragments=par.diloco_fragments,
                        pattern=par.diloco_fragment_pattern, n_layers=cfg.model.n_layers,
                        sync_delay=par.diloco_sync_delay, mix=par.diloco_mix, comm_dtype=par.diloco_comm_dtype,
                        pipeline=dims.pp > 1)
        stateful["diloco"] = diloco
        stateful[layout_key(*diloco_layout)] = DiLoCoLayout(*diloco_layout)
        # every replica saves its own model and moments
        stateful = replica_states(stateful, across.get_local_rank() if across else 0)
    recovery, resharded = None, None
    if resume_step is not None and (ckpt.dir / f"step-{resume_step}" / WEIGHTS_ONLY_MARKER).is_file():
        ckpt.load({"app": ModelOptimizerState(model)}, resume_step)  # weights only: the rest starts fresh
    elif resume_step is not None:  # memory replica, else the newest checkpoint that verifies
        names = ckpt.saved_state_names(resume_step) if diloco is not None or scaler is not None else None
        # A checkpoint from before kiln saved the scaler: resume with a fresh scale (saved from now on).
        unsaved = {"scaler"} if names is not None and scaler is not None and "scaler" not in names else set()
        if names is not None and diloco is not None:
            where = f"{ckpt.dir}/step-{resume_step}"
            saved_layout = check_diloco_resume(names, dims.dp_replicate, where, *diloco_layout[1:3], pp=dims.pp,
                                               cp=dims.cp, ep=dims.ep, ep_borrows_tp=dims.ep_borrows_tp,
                                               replicated=diloco_layout[7], fragments=diloco_layout[8],
                                               overlapped=diloco_layout[9])
            if saved_layout is not None:  # each replica resharded (its layout entry is this run's from now on)
                resharded = (f"DiLoCo's {dims.dp_replicate} replicas resharded from {describe_layout(saved_layout)} "
                             f"to {describe_layout(layout_key(*diloco_layout))}")
        resume_step, recovered_from, recovery_s = ckpt.restore({k: v for k, v in stateful.items() if k not in unsaved})
        recovery = f"resumed step {resume_step} from {recovered_from} in {recovery_s:.2f} s"
    if dims.is_main:  # only now: a start that failed above leaves the run's files as they were
        write_run_files(run_dir, cfg, tokenizer, fresh=resume_step is None)
    autocast = autocast_context(device, cfg.train.dtype)

    # ---- metrics
    whole = getattr(model, "_full", model)  # under pp: the whole model, still on meta
    counts = count_params(whole)
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len * dims.dp_size
    flops_tok = flops_per_token(whole, cfg.data.seq_len)
    peak, peak_source = peak_flops(device, cfg.train.dtype, cfg.metrics.peak_flops)
    world_peak = sum_over_ranks(peak, device)  # MFU is of the whole job: every rank's peak
    metrics = MetricsLogger(run_dir / "metrics.jsonl", cfg.metrics, cfg.train.steps, state.step,
                            enabled=dims.is_main)
    metrics.log({"kind": "run", "step": state.step, "n_params": counts["total"],
                 "n_params_non_embedding": counts["non_embedding"], "flops_per_token": flops_tok,
                 "peak_flops": peak, "peak_source": peak_source, "device": str(device),
                 "dtype": cfg.train.dtype, "tokens_per_step": tokens_per_step, "grad_accum": cfg.train.grad_accum,
                 "global_batch_size": cfg.train.batch_size * cfg.train.grad_accum * dims.dp_size,
                 "world_size": dims.world_size,
                 "dp_mode": "diloco" if diloco else dims.dp_mode if dims.dp_size > 1 else "none",
                 "n_params_active": counts["active"],
                 "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp, "cp": dims.cp,
                 "world_peak_flops": world_peak, "resumed_from": resume_step, "pp": dims.pp,
                 **({"cp_mode": dims.cp_mode} if dims.cp > 1 else {}),
                 **({"ulysses_degree": dims.ulysses_degree} if dims.cp > 1 and dims.ulysses_degree else {}),
                 **({"ulysses_rounds": dims.ulysses_rounds} if dims.ulysses_rounds > 1 else {}),
                 **({"fsdp_reshard_to": cfg.parallel.fsdp_reshard_to} if cfg.parallel.fsdp_reshard_to else {}),
                 **({f"diloco_{k}": getattr(par, f"diloco_{k}") for k in ("inner_steps", "fragments", "sync_delay",
                                                                           "mix", "comm_dtype")} if diloco else {}),
                 **({"pp_schedule": cfg.parallel.pp_schedule, "pp_microbatches": pipeline.microbatches,
                     "pp_virtual_stages": cfg.parallel.pp_virtual_stages, "bubble_fraction": pipeline.bubble}
                    if pipeline else {}),
                 "nonfinite_check": "device" if skips_on_device(optimizer) else "host",
                 "loss_impl": model.loss_impl, **attention,
                 "compile": compile_scope(cfg, dims) if cfg.train.compile else "none"})
    for line in (recovery, resharded):
        if line:
            metrics.log({"kind": "event", "step": state.step, "message": line})
    for line in ([batch_note] if batch_note else []) + dims.node_crossings(cfg.model.n_heads):  # the layout runs as it is
        metrics.log({"kind": "event", "step": state.step, "message": line})  # printed as "[event] ..." too
    metrics.print(f"model {counts['total'] / 1e6:.2f}M params, {tokens_per_step} tokens/step, "
                  f"{len(train_windows)} training windows, peak {peak / 1e9:.0f} GFLOP/s ({peak_source})")

    def log_saves(results) -> None:
        for result in results:
            metrics.log(result.row())
            if not result.ok and cfg.checkpoint.on_error == "stop":
                raise KilnError(f"{result.error} (checkpoint.on_error='stop')")

    interval = CheckpointInterval(cfg.checkpoint.every, cfg.checkpoint.mtbf_hours, state.step)
    spikes = SpikeGuard(cfg.checkpoint.spike_zscore, cfg.checkpoint.spike_window,
                        cfg.checkpoint.spike_max_recoveries, cfg.checkpoint.spike_skip_batches)

    def save(step: int) -> None:
        t0 = time.perf_counter()
        results = ckpt.save(step, stateful, {"config.toml": to_toml(cfg)})
        planned = interval.saved(step, time.perf_counter() - t0)
        log_saves(results)
        if planned:
            metrics.log({"kind": "event", "step": step, "message": planned})

    last_loss, last_val, stop_reason = math.nan, math.nan, "completed"
    pending = PendingSteps()
    # the first window waits for the loader's first batches: it does not count towards the warning
    window = {"t0": time.perf_counter(), "warned_at": -10**9, "first": True}

    def flush() -> str:
        """Fetch the pending steps' results (one device sync) and write their rows. Returns "ok",
        "stop" (too many non-finite steps in a row; rows up to that step only) or "restored" (a loss
        spike: the newest good checkpoint was restored and the data around the spike skipped, so
        the window's later steps, taken on the spiking trajectory, are dropped)."""
        nonlocal last_loss, stop_reason
        results = pending.fetch()
        if not results:
            return "ok"
        elapsed = time.perf_counter() - window["t0"]
        window["t0"] = time.perf_counter()
        # The device ran asynchronously: time the window, not a step; the job runs at the pace of
        # its slowest rank; memory is per rank (max and min).
        stats = window_stats_over_ranks(elapsed, memory_mb(device), device)
        step_s = stats["window_s"] / len(results)
        tps = tokens_per_step / step_s  # global tokens (all data-parallel ranks) per second
        wait_share = sum(r.data_wait_s for r in results) / stats["window_s"]
        warn_every = 10 * cfg.metrics.log_every  # a persistent stall is repeated, not every row
        first, window["first"] = window["first"], False
        if cfg.data.wait_warn_fraction and not first and wait_share > cfg.data.wait_warn_fraction \
                and results[-1].step - window["warned_at"] >= warn_every:
            window["warned_at"] = results[-1].step
            metrics.log({"kind": "event", "step": results[-1].step,
                         "message": f"data wait is {100 * wait_share:.0f}% of step time (over data.wait_warn_fraction="
                                    f"{cfg.data.wait_warn_fraction}): raise data.prefetch (batches "
                                    f"ready ahead), data.lookahead and data.fetch_workers (remote shards)"})
        if mixture is not None:  # the realized mix: exact, from the loader's global position
            mix = mixture.realized(loader.position)
            metrics.log({"kind": "mixture", "step": results[-1].step,
                         **{f"{name}_tokens": m["tokens"] for name, m in mix.items()}})
        if rates := loader.cache_hit_rates():  # remote shards: the shard cache's hit rate, per epoch
            metrics.log({"kind": "cache", "step": results[-1].step,
                         **{f"epoch{e}_hit_rate": round(rate, 4) for e, rate in rates.items()}})
        for r in results:
            metrics.log({"kind": "train", "step": r.step, "loss": r.loss, "lr": r.lr,
                         "grad_norm": r.grad_norm, "tokens": r.tokens, "tokens_per_s": tps,
                         "mfu": flops_tok * tps / world_peak, "memory_mb": stats["memory_mb"],
                         "memory_mb_min": stats["memory_mb_min"],
                         "data_wait_ms": 1000 * r.data_wait_s, "step_ms": 1000 * step_s,
                         "skipped": r.skipped, **(r.extras or {})})
            if not r.skipped and (z := spikes.observe(r.loss)) is not None and spikes.can_recover():
                log_saves(ckpt.wait())
                if ckpt.latest_step() is not None:
                    # Detected at fetch time: the loader stands after step state.step >= r.step, so
                    # the skipped range (in the event row) also covers the window's later batches.
                    restored, row = spikes.recover(ckpt, stateful, loader, r.step, r.loss, z)
                    metrics.log(row)
                    interval.restart_from(restored)
                    return "restored"
            if not r.skipped:
                state.nonfinite_in_a_row = 0
                last_loss = r.loss
                continue
            state.nonfinite_in_a_row += 1
            state.nonfinite_total += 1
            metrics.log({"kind": "event", "step": r.step,
                         "message": f"non-finite loss/grad: step skipped ({state.nonfinite_in_a_row} in a row)"})
            if state.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps:
                stop_reason = (f"{state.nonfinite_in_a_row} non-finite steps in a row at step {r.step}; "
                               f"lower optim.lr, enable clipping or use fp32")
                metrics.log({"kind": "event", "step": r.step, "message": "stopped: " + stop_reason})
                state.step = r.step
                return "stop"
        return "ok"

    diverged = False
    profiler = StepProfiler(cfg.metrics.profile_every, cfg.metrics.profile_memory, run_dir, state.step, dims.rank,
                            device, metrics.log)
    try:
        while state.step < cfg.train.steps:
            loader.wait_s = 0.0
            # packed_masked batches carry a third tensor, the document ids (whole sequences under cp)
            batches = [loader.next() for _ in range(cfg.train.grad_accum)]
            micro = [context_parallel.shard(*b[:2]) + b[2:] for b in batches]
            step_fn = train_step if pipeline is None else pipeline_train_step
            with context_parallel:
                loss, grad_norm, skipped = step_fn(pipeline or model, optimizer, micro, autocast=autocast,
                                                   scaler=scaler, clip=cfg.train.clip_grad_norm)
            state.step += 1
            state.tokens += tokens_per_step
            if note := timeouts.step_done(state.step):
                metrics.log({"kind": "event", "step": state.step, "message": note})
            # MoE (last micro-batch): the unweighted load-balancing and z-losses, fetched with the loss.
            moe_losses = getattr(model, "moe_losses", None)  # under pp: the step's micro-batch mean, all stages
            extras = None if moe_losses is None else {"moe_aux_loss": moe_losses[0], "moe_z_loss": moe_losses[1]}
            if getattr(model, "moe_max_load", None) is not None:  # the step's global batch, every rank alike
                extras["moe_max_load"] = model.moe_max_load
            pending.add(state.step, loss, grad_norm, skipped, lr=schedule.lr, data_wait_s=loader.wait_s,
                        tokens=state.tokens, extras=extras)
            for sync in diloco.after_step(state.step) if diloco is not None else ():
                metrics.log({"kind": "diloco", "step": state.step, **sync})
            schedule.step()

            last_step = state.step == cfg.train.steps
            evaluate = bool(cfg.train.eval_every) and (state.step % cfg.train.eval_every == 0 or last_step)
            checkpoint = interval.due(state.step)
            pause = stop_at is not None and state.step >= stop_at and not last_step
            if state.step % cfg.metrics.log_every == 0 or last_step or evaluate or checkpoint or pause:
                status = flush()
                if status == "stop":
                    diverged = True
                    break
                if status == "restored":  # back at the restored step: re-decide eval/save/pause there
                    continue
            if evaluate:
                results = evaluator.run()
                metrics.log({"kind": "eval", "step": state.step, **results})
                last_val = results["val_loss"]
                if schedule.observe(last_val):
                    metrics.log({"kind": "event", "step": state.step,
                                 "message": f"plateau: lr decayed to {schedule.lr:.3e}"})
                if last_val < state.best_val_loss - cfg.train.early_stopping_min_delta:
                    state.best_val_loss, state.evals_without_improvement = last_val, 0
                else:
                    state.evals_without_improvement += 1
                patience = cfg.train.early_stopping_patience
                if patience and state.evals_without_improvement >= patience:
                    stop_reason = (f"early stop: no val_loss improvement > {cfg.train.early_stopping_min_delta} "
                                   f"in {patience} evaluations (best {state.best_val_loss:.4f})")
                    metrics.log({"kind": "event", "step": state.step, "message": stop_reason})
                    save(state.step)
                    break
            if checkpoint:
                save(state.step)
            if pause:
                stop_reason = f"paused at step {state.step} (--stop-at); resume with kiln train --resume"
                if ckpt.latest_step() != state.step:
                    save(state.step)
                break
            profiler.step_done(state.step)
        else:
            if cfg.checkpoint.save_final and ckpt.latest_step() != state.step:
                save(state.step)
        if diloco is not None:
            diloco.settle()  # no exchange left in flight (streaming DiLoCo's delay) when the ranks part
        log_saves(ckpt.close())
    finally:
        ckpt.close()
        loader.close()
        profiler.close(state.step)
        metrics.close()
    if ckpt.replicas is not None and not (diverged or stop_reason.startswith("paused")):
        ckpt.replicas.discard()  # finished: free the tmpfs copies (a paused run keeps them for its resume)
    if diverged:
        raise TrainingDiverged(f"stopped: {stop_reason}")
    if state.step == resume_step and dims.is_main:  # nothing left to train: the losses the run recorded there
        last_loss, last_val = _recorded_losses(run_dir / "metrics.jsonl", state.step)
    return TrainResult(run_dir, state.step, last_loss, state.best_val_loss, last_val, stop_reason, dims.is_main)


def _recorded_losses(path: Path, step: int) -> tuple[float, float]:
    """(training loss, validation loss) that metrics.jsonl holds for `step`, NaN where it holds none
    (or cannot be read: the summary line is all they feed)."""
    try:
        metrics = read_metrics(path)
    except (DataError, OSError):
        return math.nan, math.nan
    at = metrics.train["step"] == step
    loss = float(metrics.train["loss"][at][-1]) if at.any() else math.nan
    evals = [r.get("val_loss") for r in metrics.of("eval") if r.get("step") == step]
    val = float(evals[-1]) if evals and isinstance(evals[-1], (int, float)) else math.nan
    return loss, val


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()

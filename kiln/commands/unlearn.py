"""`kiln unlearn RUN --forget FILE [--retain FILE] [--chunk K]`: remove memorized sequences from a
trained run by gradient ascent (kiln.privacy.unlearn), into a NEW run directory.

The original run is only read (kiln.eval.load.load_run). The unlearned weights go to OUT (default
RUN-unlearned) through CheckpointManager.save, with config.toml, tokenizer.json, the canary record
if any, and OUT/reports/unlearning.json (metrics before/after, per chunk and per step, validation
loss before and after). Nothing is written to OUT before unlearning succeeds.

One process, or data parallel under `torchrun --nproc-per-node N kiln unlearn ...`: the run's
[parallel] layout (FSDP by default) over N ranks, the forget/retain batches sharded over the
ranks, metrics gathered, the validation windows split (kiln.privacy.validation), rank 0
writing the files, and a DCP save from every rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

from kiln.errors import KilnError
from kiln.privacy.unlearn import UnlearnOptions

D = UnlearnOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN", help="trained run directory (read only)")
    p.add_argument("--forget", required=True, metavar="FILE",
                   help="JSONL rows {text[, heldout, prefix, secret, digits]}; rows with heldout=true are the "
                        "'never seen' reference (a run's canaries.jsonl has both)")
    p.add_argument("--heldout", metavar="FILE", help="more held-out reference rows (same format)")
    p.add_argument("--retain", metavar="FILE", help="UTF-8 text to keep the model's quality on (regularizer)")
    p.add_argument("--retain-loss", choices=("lm", "kl"), default=D.retain_loss,
                   help="retain term: LM loss, or KL divergence from the original model")
    p.add_argument("--retain-weight", type=float, default=D.retain_weight)
    p.add_argument("--retain-batch", type=int, default=D.retain_batch, help="retain windows per step")
    p.add_argument("--chunk", type=int, default=D.chunk, help="forget sequences per sequential chunk (0: all at once)")
    p.add_argument("--lr", type=float, default=D.lr)
    p.add_argument("--clip-grad-norm", type=float, default=D.clip_grad_norm, help="0: no clipping")
    p.add_argument("--max-steps", type=int, default=D.max_steps, help="step budget per chunk")
    p.add_argument("--check-every", type=int, default=D.check_every,
                   help="check the stop rule every this many steps (1: stop at the first step at the reference)")
    p.add_argument("--bisect", type=int, default=D.bisect,
                   help="a step that takes the forget set seen so far below the reference - margin is cut "
                        "back by this many halvings (0: keep whole steps)")
    p.add_argument("--secret-only", action=argparse.BooleanOptionalAction, default=D.secret_only,
                   help="canary rows: ascend only on the secret's digits, not the format all canaries share")
    p.add_argument("--format-weight", type=float, default=D.format_weight,
                   help="with --secret-only: weight of an LM (descent) term on the canary rows' other tokens "
                        "(the shared format), so the ascent on the digits does not unlearn it (0: off)")
    p.add_argument("--margin", type=float, default=D.margin,
                   help="stop a chunk when the EL and MA of the forget set seen so far are <= the held-out "
                        "reference + this (and cut back steps that take them below the reference - this)")
    p.add_argument("--exposure-margin", type=float, default=D.exposure_margin,
                   help="canaries: memorized means exposure > the held-out canaries' + this (bits)")
    p.add_argument("--stop-on-exposure", action="store_true",
                   help="also stop a chunk only when the seen forget set's exposure is <= the held-out "
                        "canaries' + --exposure-margin (EL and MA alone can leave the secret ranked high)")
    p.add_argument("--force", action="store_true", help="unlearn even when the forget set does not look memorized")
    p.add_argument("--out", metavar="DIR", help="new run directory (default RUN-unlearned); must not exist")
    p.add_argument("--step", type=int, help="checkpoint to start from (default: latest)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda (one GPU per local rank under torchrun) or auto (cuda when there is one)")
    p.add_argument("--val-tokens", type=int, default=20000, help="validation tokens scored before/after (0: all)")
    p.add_argument("--ngram", type=int, default=D.ngram)
    p.add_argument("--candidates", type=int, default=D.candidates)
    p.add_argument("--seed", type=int, default=D.seed)


def options_from(args: argparse.Namespace) -> UnlearnOptions:
    opts = UnlearnOptions(**{f.name: getattr(args, f.name) for f in fields(UnlearnOptions) if hasattr(args, f.name)})
    for key in ("max_steps", "check_every", "ngram", "candidates", "retain_batch"):
        if getattr(opts, key) <= 0:
            raise KilnError(f"--{key.replace('_', '-')}={getattr(opts, key)} must be > 0")
    if opts.chunk < 0:
        raise KilnError(f"--chunk={opts.chunk} must be >= 0 (0: all at once)")
    if opts.bisect < 0:
        raise KilnError(f"--bisect={opts.bisect} must be >= 0 (0: no cut-back)")
    if not opts.lr > 0 or min(opts.margin, opts.exposure_margin, opts.retain_weight, opts.format_weight,
                                 opts.clip_grad_norm) < 0:
        raise KilnError("--lr must be > 0; --margin, --exposure-margin, --retain-weight, --format-weight and "
                        "--clip-grad-norm >= 0")
    return opts


def retain_windows(path: str, tokenizer, seq_len: int) -> list[list[int]]:
    """Non-overlapping windows of seq_len + 1 tokens of a UTF-8 text file."""
    from kiln.io import read_text_file

    file = Path(path)
    text = read_text_file(file, error=KilnError, missing=f"--retain {file} not found (expected a UTF-8 text file)")
    import numpy as np

    from kiln.data.loader import TokenWindows
    from kiln.errors import DataError

    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    try:  # the one windower: windows k*seq_len .. k*seq_len + seq_len (inputs and shifted targets)
        windows = TokenWindows([ids], seq_len, source=f"--retain {file}")
    except DataError as e:
        raise KilnError(str(e)) from None
    return windows.gather(np.arange(len(windows))).tolist()


def load_model(run_dir: Path, step: int | None, device_name: str):
    """The run's config, tokenizer and model (weights from `step`, default the newest checkpoint
    that verifies) on this process's part of the run's parallel layout: the mesh from
    ParallelDims, the model built on meta and parallelized as the trainer does
    (kiln.train.trainer.build_model), the weights loaded through CheckpointManager (DCP reshards).
    One process is the trivial layout whatever [parallel] says; several take the run's [parallel]
    data-parallel settings (dp_mode, dp_replicate, dp_shard). Returns (LoadedRun, ParallelDims, device)."""
    from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
    from kiln.config import ParallelConfig
    from kiln.eval.load import LoadedRun, read_trained_run
    from kiln.parallel.dims import ParallelDims, pick_device
    from kiln.train.trainer import build_model

    cfg, tokenizer = read_trained_run(run_dir)
    # Decoding many prefixes changes shapes every call (compile would recompile), float8 needs a
    # recent GPU and buys nothing at unlearning's scale: the unlearning model is plain.
    cfg.train.compile, cfg.train.float8, cfg.train.activation_checkpointing = False, False, "none"
    dims = ParallelDims.from_config(ParallelConfig())  # the trivial layout, and the world size
    if dims.world_size > 1:
        p = cfg.parallel
        if max(p.tp, p.cp, p.pp, p.ep) > 1 or p.diloco_inner_steps:
            raise KilnError(f"{run_dir}/config.toml [parallel] has tp={p.tp} cp={p.cp} pp={p.pp} ep={p.ep} "
                            f"diloco_inner_steps={p.diloco_inner_steps}; kiln unlearn runs on one process or "
                            f"data parallel only (FSDP/DDP): run it with one process")
        dims = ParallelDims.from_config(cfg.parallel)
    device = pick_device(device_name, dims)
    dims.build_mesh(device.type)
    model = build_model(cfg, dims, device)
    step = CheckpointManager(run_dir / "checkpoints", is_main=dims.is_main).load(
        {"app": ModelOptimizerState(model)}, step)
    model.eval()
    return LoadedRun(model, tokenizer, cfg, step, run_dir), dims, device


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    try:
        return _run(args)
    finally:  # a process group this command started (torchrun) ends with it
        if not initialized and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
    from kiln.eval.parts import EvalOptions, _seq_len, _shard_dir, validation_tokens
    from kiln.io import atomic_write_json
    from kiln.privacy.canaries import CANARY_FILE
    from kiln.privacy.metrics import Shard, reshard
    from kiln.privacy.sequences import read_sequences, split_heldout
    from kiln.privacy.unlearn import unlearn
    from kiln.privacy.validation import validation_score
    from kiln.train.run_files import write_run_files

    opts = options_from(args)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir.parent / f"{run_dir.name}-unlearned"
    if out.exists() and any(out.iterdir()):
        raise KilnError(f"--out {out} already exists and is not empty; unlearning writes a new run directory")
    loaded, dims, device = load_model(run_dir, args.step, args.device)
    say = print if dims.is_main else (lambda *a, **k: None)
    max_len = loaded.config.model.max_seq_len
    forget, heldout = split_heldout(read_sequences(args.forget, loaded.tokenizer, max_len))
    if args.heldout:
        heldout += read_sequences(args.heldout, loaded.tokenizer, max_len)
    if not forget:
        raise KilnError(f"--forget {args.forget}: every row is heldout=true; nothing to forget")
    if not heldout:
        raise KilnError(f"--forget {args.forget}: no held-out reference rows (\"heldout\": true); add some "
                        f"or pass --heldout FILE with sequences of the same source the model never saw")
    seq_len = _seq_len(loaded, EvalOptions(run_dir=str(run_dir)))
    retain = retain_windows(args.retain, loaded.tokenizer, seq_len) if args.retain else []
    original = None
    if retain and opts.retain_loss == "kl":  # the frozen reference of the KL term, same layout
        original = load_model(run_dir, loaded.step, args.device)[0].model
    shard = Shard(dims.dp_rank, dims.dp_size, device.type)
    val_ids, val_source, val_offsets = validation_tokens(loaded)

    def validate() -> dict:  # the perplexity part's windows, split over the ranks
        return {"source": [val_source], "seq_len": seq_len, **validation_score(
            loaded.model, loaded.tokenizer, val_ids, seq_len=seq_len, max_tokens=args.val_tokens, shard=shard,
            doc_offsets=val_offsets)}

    val_before = validate()
    report = unlearn(loaded.model, loaded.tokenizer, forget, heldout, retain, opts, shard=shard,
                     original=original, log=say)
    if report["status"] == "not_memorized":
        b, r = report["forget_before"], report["heldout_reference"]
        raise KilnError(f"--forget {args.forget}: these sequences do not look memorized (EL {b['el']:.3f}, MA "
                        f"{b['ma']:.3f} vs never-seen EL {r['el']:.3f}, MA {r['ma']:.3f}, within the margins); "
                        f"nothing was changed or written (--force unlearns anyway)")
    val_after = validate()
    report.update({"run_dir": str(run_dir), "step": loaded.step, "forget_file": str(args.forget),
                   "retain_file": args.retain, "val_before": val_before, "val_after": val_after,
                   "world_size": dims.world_size, "dp_mode": dims.dp_mode if dims.world_size > 1 else "none"})

    cfg = loaded.config
    if not cfg.data.shards_dir:  # the new run scores the original run's validation shards
        try:
            cfg.data.shards_dir = str(_shard_dir(loaded).resolve())
        except KilnError:  # the run has no shards (eval --data only): the new run has none either
            pass
    if dims.is_main:
        write_run_files(out, cfg, loaded.tokenizer, fresh=True)
        if (run_dir / CANARY_FILE).is_file():
            shutil.copyfile(run_dir / CANARY_FILE, out / CANARY_FILE)
    reshard(loaded.model)  # under FSDP: save the shards, not what the last forward left gathered
    results = CheckpointManager(out / "checkpoints", is_main=dims.is_main).save(
        loaded.step, {"app": ModelOptimizerState(loaded.model)}, {"unlearning.json": json.dumps(report, indent=1)})
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise KilnError(failed[0])
    if dims.is_main:
        atomic_write_json(out / "reports" / "unlearning.json", report, indent=1)
    fb, fa = report["forget_before"], report["forget_after"]
    say(f"forget set EL {fb['el']:.3f} -> {fa['el']:.3f}, MA {fb['ma']:.3f} -> {fa['ma']:.3f}"
        + (f", exposure {fb['exposure']:.2f} -> {fa['exposure']:.2f}" if "exposure" in fb else "")
        + f"; validation loss {val_before['loss']:.4f} -> {val_after['loss']:.4f} ({report['status']})")
    say(f"unlearned run: {out}  report: {out / 'reports' / 'unlearning.json'}")
    return 0

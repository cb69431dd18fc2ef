"""Streaming DiLoCo (Douillard et al. 2025): the blocks dealt into fragments synced at staggered
steps, each exchange overlapping `delay` inner steps, the merge keeping `mix` of a replica's own
parameters, the outer gradient crossing in bfloat16.

Numerics: 2 gloo ranks (whole replicas) and one 4-rank launch (2 replicas x DDP over 2 ranks, whose
ranks split the fragment's outer state; x pp 2, the anchor by name and a stage holding part of
each fragment; x FSDP over 2; x tp 2; x ep 2, MoE under FSDP over 2) give the per-step losses of the definition written out by hand in
one process below (relative 1e-5 over 9 steps, 4 merges); the bf16 sum of two replicas equals the
definition's bf16 add; float8 exchanges (block-scaled, all-gathered, summed in fp32) equal the
definition's quantization by hand. Negative controls: plain DiLoCo, the other fragment pattern and
bf16 instead of float8 give other losses. Resume (kiln's trainer, 2 ranks): a checkpoint taken with a fragment's exchange in flight
continues bit for bit.
"""

import re

import pytest
import torch

from ranks import run_ranks
from test_diloco import FIELDS, MOMENTUM, OUTER_LR, RESUME_AT, RESUME_STEPS, STEPS, adamw, inner_step_of_two, \
    model_and_data, resume_overrides, split_replica_run, train_losses, whole_replica_run

H, REL = 4, 1e-5
DEEP = {"n_layers": 4}  # strided and sequential fragments differ from 4 blocks on
STREAMING = {"fragments": 2, "sync_delay": 1, "mix": 0.5, "comm_dtype": "bfloat16"}


def fp8_roundtrip(x):
    """By hand: blocks of 256 elements, each scaled by its absolute maximum / 448 (e4m3's largest)."""
    padded = torch.cat([x, x.new_zeros(-len(x) % 256)]).view(-1, 256)
    scale = padded.abs().max(dim=1).values / 448.0
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).tiny))
    return ((padded / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]).reshape(-1)[:len(x)]


def simulated(fragments=2, strided=True, delay=1, mix=0.5, wire="bf16", **fields):
    """Streaming DiLoCo with 2 replicas in one process, written out by hand: fragment f merges
    after the steps s with s % H == (f + 1) H / P (mod H), its exchange starting `delay` steps
    earlier from the parameters then; the embedding goes with block 0, the final norm with the
    last. `wire`: fp32; bf16 (each replica's delta rounded, their sum rounded); fp8 (each replica's
    flat fragment delta block-quantized, the two summed in fp32). Returns the losses and the bytes
    one replica puts into each exchange."""
    import copy

    base, data = model_and_data(**fields)
    n_layers = fields.get("n_layers", 1)
    names = [n for n, _ in base.named_parameters()]

    def fragment(name):
        block = re.match(r"layers\.(\d+)\.", name)
        i = int(block.group(1)) if block else 0 if name.startswith("tok_embeddings") else n_layers - 1
        return i % fragments if strided else i * fragments // n_layers

    replicas = [copy.deepcopy(base), copy.deepcopy(base)]
    inner = [adamw(m) for m in replicas]
    anchor = [p.detach().clone() for p in base.parameters()]
    velocity = [torch.zeros_like(p) for p in anchor]
    losses, exchanged, waiting = [], [], None

    def merge(f, mean_delta):
        with torch.no_grad():
            for i, params in enumerate(zip(*(m.parameters() for m in replicas))):
                if fragment(names[i]) != f:
                    continue
                velocity[i] = MOMENTUM * velocity[i] + mean_delta[i]
                anchor[i] -= OUTER_LR * (mean_delta[i] + MOMENTUM * velocity[i])
                for p in params:
                    p.copy_(mix * p + (1 - mix) * anchor[i])

    for step, batch in enumerate(data, start=1):
        losses.append(inner_step_of_two(replicas, inner, batch))
        if waiting is not None and waiting[1] == step:
            merge(waiting[0], waiting[2])
            waiting = None
        for f in range(fragments):
            if step % H != ((f + 1) * H // fragments - delay) % H:
                continue
            mine = [i for i, name in enumerate(names) if fragment(name) == f]
            flat = [torch.cat([(anchor[i] - list(m.parameters())[i].detach()).reshape(-1) for i in mine])
                    for m in replicas]
            if wire == "bf16":
                mean = (flat[0].bfloat16() + flat[1].bfloat16()).float() / 2
                exchanged.append(2 * flat[0].numel())
            elif wire == "fp8":
                mean = (fp8_roundtrip(flat[0]) + fp8_roundtrip(flat[1])) / 2
                padded = flat[0].numel() + -flat[0].numel() % 256
                exchanged.append(padded + 4 * padded // 256)  # the bytes, then a scale per block
            else:
                mean = (flat[0] + flat[1]) / 2
                exchanged.append(4 * flat[0].numel())
            mean_delta, offset = {}, 0
            for i in mine:
                mean_delta[i] = mean[offset:offset + anchor[i].numel()].view_as(anchor[i])
                offset += anchor[i].numel()
            if delay:
                waiting = (f, step + delay, mean_delta)
            else:
                merge(f, mean_delta)
    return losses, exchanged


def test_fragments_are_dealt_by_block():
    from kiln.parallel.diloco import fragment_of

    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    named = [("tok_embeddings.weight", a)] + [(f"layers.{i}.w", torch.zeros(1)) for i in range(4)] + \
        [("norm.weight", b), ("output.weight", c)]
    assert fragment_of(named, 2, 4, "strided") == [0, 0, 1, 0, 1, 1, 1]
    assert fragment_of(named, 2, 4, "sequential") == [0, 0, 0, 1, 1, 1, 1]
    assert fragment_of(named, 2, 4, "strided", tied=(c,)) == [0, 0, 1, 0, 1, 1, 0]  # a tied head copy
    # a pipeline stage: global block indices, wrappers around the blocks
    stage = [("layers.2._checkpoint_wrapped_module.attention.wq.weight", a), ("layers.3._orig_mod.w", b),
             ("norm.weight", c)]
    assert fragment_of(stage, 4, 4, "strided") == [2, 3, 3]


def test_float8_exchange_packs_block_scaled_bytes():
    from kiln.parallel.diloco_fragment import FP8_BLOCK, dequantize_fp8, quantize_fp8

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 0, 1000)
    x[256:512] = 0.0  # an all-zero block
    packed = quantize_fp8(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 1024 + 4 * 1024 // FP8_BLOCK
    back = dequantize_fp8(packed, 1000)
    assert torch.equal(back, fp8_roundtrip(x)) and torch.equal(back[256:512], torch.zeros(256))
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, FP8_BLOCK).abs().amax(1)
    assert ((back - x).abs() <= blocks.repeat_interleave(FP8_BLOCK)[:1000] / 16).all()  # e4m3: 3 mantissa bits


def test_one_process_schedule_and_rows():
    from kiln.parallel.diloco import DiLoCo

    model, _ = model_and_data(**DEEP)
    diloco = DiLoCo(model, 8, n_layers=4, fragments=4, sync_delay=1, mix=0.5)
    rows = {step: diloco.after_step(step) for step in range(1, 17)}
    assert {s: [(r["fragment"], r["outer_step"]) for r in got] for s, got in rows.items() if got} == {
        1: [(0, 1)], 3: [(1, 1)], 5: [(2, 1)], 7: [(3, 1)], 9: [(0, 2)], 11: [(1, 2)], 13: [(2, 2)], 15: [(3, 2)]}
    assert diloco.pending is None  # fragment 3 launched at 15, merged at 16
    state = diloco.state_dict()
    assert state["outer_steps"].tolist() == [2, 2, 2, 2] and state["pending"].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="sync_delay < inner_steps / fragments"):
        DiLoCo(model, 8, n_layers=4, fragments=4, sync_delay=2)


def test_a_restore_with_an_exchange_in_flight_drops_it():
    # A loss-spike restore (kiln/train/spikes.py) loads an older state mid-run: the exchange started
    # since then must not merge into the restored run.
    from kiln.parallel.diloco import DiLoCo

    model, _ = model_and_data(**DEEP)
    diloco = DiLoCo(model, 4, n_layers=4, fragments=2, sync_delay=1)
    saved = {k: v.clone() for k, v in diloco.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # an inner step's drift
    assert [r["fragment"] for r in diloco.after_step(1)] == [0] and diloco.pending == (0, 2)
    diloco.load_state_dict(saved)
    before = [p.detach().clone() for p in model.parameters()]
    assert diloco.after_step(2) == [] and diloco.pending is None
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing merged
    now = diloco.state_dict()  # the saved anchor, momentum, counts and no pending sync
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match=r"pending sync \(fragment, merge step\) = \(7, 3\): expected \(-1, -1\) or a "
                                        r"fragment in 0..1"):
        diloco.load_state_dict({**saved, "pending": torch.tensor([7, 3])})


def test_streaming_settings_are_checked_in_one_line():
    from kiln.config import ConfigError, JobConfig, ParallelConfig
    from kiln.parallel.dims import ParallelDims

    for fields, message in (({"diloco_fragments": 2}, r"parallel.diloco_fragments=2 sets up DiLoCo's outer syncs, "
                                                        r"which are off \(parallel.diloco_inner_steps=0\)"),
                            ({"diloco_inner_steps": 6, "diloco_fragments": 4},
                             r"parallel.diloco_fragments=4 must divide parallel.diloco_inner_steps=6"),
                            ({"diloco_inner_steps": 8, "diloco_fragments": 4, "diloco_sync_delay": 2},
                             r"parallel.diloco_sync_delay=2 must be below .* = 2"),
                            ({"diloco_inner_steps": 8, "diloco_comm_dtype": "float16"}, r"parallel.diloco_comm_dtype")):
        with pytest.raises(ConfigError, match=message):
            ParallelConfig(**fields).validate()
    cfg = JobConfig()
    cfg.model.n_layers, cfg.parallel = 2, ParallelConfig(diloco_inner_steps=4, diloco_fragments=4)
    with pytest.raises(ConfigError, match=r"parallel.diloco_fragments=4 deals the model's model.n_layers=2 blocks"):
        ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0).check_model(cfg)


def streaming_rank(rank, world):
    from kiln.parallel.diloco import DiLoCo

    runs = {}
    for name, kwargs in (("strided", STREAMING), ("sequential", {"fragments": 2, "pattern": "sequential"}),
                         ("fp8", {**STREAMING, "comm_dtype": "float8_e4m3fn"})):
        model, data = model_and_data(**DEEP)
        runs[name] = whole_replica_run(rank, world, model, data, DiLoCo(model, H, OUTER_LR, MOMENTUM, n_layers=4,
                                                                          **kwargs))
    return runs


@pytest.mark.timeout(240)
def test_two_replicas_match_the_streaming_definition(tmp_path):
    runs, other = run_ranks(streaming_rank, 2, tmp_path)
    assert runs == other
    losses, sent = runs["strided"]
    expected, exchanged = simulated(**DEEP)
    assert losses == pytest.approx(expected, rel=REL)
    assert sent == exchanged and len(sent) == 5  # bf16: 2 bytes per element of the fragment, one per sync
    sequential = simulated(strided=False, delay=0, mix=0.0, wire="fp32", **DEEP)
    assert runs["sequential"][0] == pytest.approx(sequential[0], rel=REL)
    assert runs["sequential"][1] == sequential[1]
    fp8 = simulated(wire="fp8", **DEEP)  # block-quantized deltas, all-gathered, summed in fp32
    assert runs["fp8"][0] == pytest.approx(fp8[0], rel=REL) and runs["fp8"][1] == fp8[1]
    assert sum(fp8[1]) < 0.27 * sum(4 * e / 2 for e in exchanged)  # about a quarter of fp32's bytes
    # Controls: plain DiLoCo, the other pattern and bf16 instead of fp8 are other runs.
    assert losses != pytest.approx(simulated(fragments=1, delay=0, mix=0.0, wire="fp32", **DEEP)[0], rel=REL)
    assert sequential[0] != pytest.approx(simulated(strided=True, delay=0, mix=0.0, wire="fp32", **DEEP)[0], rel=REL)
    assert runs["fp8"][0] != pytest.approx(losses, rel=REL)


# DDP inside (outer state split over the replica's ranks), pp by name, FSDP shards, tp shards, experts over ep
SPLIT = ("ddp", "pp", "fsdp", "tp", "ep")


def split_streaming_ranks(rank, world):
    return {name: split_replica_run(name, rank, STEPS, fields={**FIELDS[name], **DEEP}, streaming=STREAMING,
                                    inner_steps=H)[:2]
            for name in SPLIT}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    return run_ranks(split_streaming_ranks, 4, tmp_path_factory.mktemp("streaming-split"), timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("layout", SPLIT)
def test_split_replicas_match_the_streaming_definition(split_runs, layout):
    expected, exchanged = simulated(**{**FIELDS[layout], **DEEP})
    for rank, runs in enumerate(split_runs):
        losses, sent = runs[layout]
        assert losses == pytest.approx(expected, rel=REL), (rank, layout)
        assert len(sent) == len(exchanged) == 5
    if layout == "ddp":  # the replica's 2 ranks each send half of the fragment (padded to 2 equal slices)
        assert [sum(pair) for pair in zip(split_runs[0][layout][1], split_runs[1][layout][1])] == \
            [e + e % 4 for e in exchanged]


def streaming_resume_ranks(rank, world, root, sets):
    import os
    from pathlib import Path

    import kiln.train.trainer as trainer
    from kiln.config import load_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    root = Path(root)
    trainer.train(load_config(None, sets), root / "whole")
    trainer.train(load_config(None, sets), root / "paused", stop_at=RESUME_AT)
    trainer.train(load_config(None, sets), root / "paused", resume=True)


@pytest.mark.timeout(300)
def test_resume_with_an_exchange_in_flight_continues_exactly(tmp_path, text_file):
    import json

    import torch.distributed.checkpoint as dcp

    # H 4, 2 fragments, delay 1: fragment 1's exchange starts at step 3 (the checkpoint) and merges at 4.
    sets = resume_overrides(text_file, tmp_path / "shards") + [
        "parallel.diloco_fragments=2", "parallel.diloco_sync_delay=1", "parallel.diloco_mix=0.5",
        "parallel.diloco_comm_dtype='bfloat16'"]
    (tmp_path / "work").mkdir()
    run_ranks(streaming_resume_ranks, 2, tmp_path / "work", str(tmp_path), sets, timeout=240)
    whole, paused = train_losses(tmp_path / "whole"), train_losses(tmp_path / "paused")
    assert sorted(whole) == sorted(paused) == list(range(1, RESUME_STEPS + 1))
    assert [paused[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fragment"], r["outer_step"]) for r in rows if r["kind"] == "diloco"] == \
        [(1, 0, 1), (3, 1, 1), (5, 0, 2)]
    reader = dcp.FileSystemReader(str(tmp_path / "paused" / "checkpoints" / f"step-{RESUME_AT}"))
    names = set(reader.read_metadata().state_dict_metadata)
    assert {"diloco.pending", "diloco_layout_2x1x1_frag2_overlap.fragments_overlapped"} <= names
    pending = {"diloco.pending": torch.zeros(2, dtype=torch.int64)}
    dcp.load(pending, storage_reader=reader)
    assert pending["diloco.pending"].tolist() == [1, 4]  # fragment 1, merging after step 4

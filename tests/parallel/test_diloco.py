"""DiLoCo on 2 gloo ranks gives the per-step losses of its own definition simulated in one process
(two replicas, each with its own AdamW and its own half of the batch, an outer Nesterov step on the
averaged delta every H steps) - DiLoCo, not plain data parallelism, which the last check tells apart.

Tolerance: fp32, relative 1e-5 per step over 9 steps (3 outer steps); observed ~1e-7.

Resume (kiln's trainer on 2 gloo ranks): a checkpoint between outer syncs holds every replica's
own parameters and AdamW moments, so the paused-and-resumed run equals the uninterrupted one to
the last bit; the old resume (rank 0's state on every rank) does not.

Model parallelism inside each replica (one 4-rank launch): 2 replicas x fsdp dp_shard 2, x tp 2,
x pp 2 (1F1B, tied embeddings), x cp 2 (DDP over cp) and x ep 2 (MoE, dropless top-2, FSDP over
dp_shard 2), x zero2 dp_shard 2, x tp 2 with ep 2 borrowing tp (etp 1, MoE, fsdp), x cp 2
with ep 2 = cp (MoE, ddp), and x DDP / ZeRO-1 over 2 ranks (whole parameters) through kiln's ParallelDims, parallelize, Pipeline and ContextParallel
give the same single-process definition's losses (relative 1e-5, 9 steps, 3 outer steps;
observed <= 1.3e-7), the
same anchor shard in both replicas, and parameters that stay equal where a replica holds them twice
(cp ranks; the pipeline's tied head copy and embedding), bit for bit; where both ranks of a
replica hold the same parameters (ddp, zero1, cp under ddp) each sends half of them across. Negative controls: HSDP
(gradients across replicas every step), and the outer step averaging over cp instead of the
replicas (8e-4 relative at step 4). kiln's trainer with 2 replicas x fsdp 2 resumes between outer
syncs bit for bit, and so do 2 replicas x pp 2 (the anchor keyed by parameter name), 2
replicas x ZeRO-1 over 2 (each replica's ranks saving their boxes of the moments), x ZeRO-2 over 2, x tp 2 with ep 2
borrowing tp (etp 1, MoE) and x cp 2 with ep 2 = cp (MoE).
One 8-rank launch: 2 replicas x pp 2 x cp 2 with ep 2 = cp (MoE, ddp), same definition and tolerance.
"""

import os

import json

import pytest
import torch

from ranks import run_ranks

H, STEPS, OUTER_LR, MOMENTUM, REL = 3, 9, 0.7, 0.9, 1e-5
VOCAB = 42  # even: tensor parallelism shards the embedding and the head on the vocabulary


# Models of the replicas split over pp, cp and ep (2 layers: one per pipeline stage; MoE: dropless
# top-2, so every token reaches its experts whichever rank routes it).
FIELDS = {"fsdp": {}, "tp": {}, "pp": {"n_layers": 2}, "cp": {"n_layers": 2},
          "ep": {"moe_experts": 4, "moe_top_k": 2, "moe_capacity_factor": 0.0}}
FIELDS.update(zero2={}, etp1=FIELDS["ep"], cp_ep={"n_layers": 2, **FIELDS["ep"]}, ddp={}, zero1={},
              pp_interleaved={"n_layers": 4}, pp_zbv={"n_layers": 4}, pp_izb={"n_layers": 4},
              pp_bfs={"n_layers": 4})  # a layer per stage


def model_config(**fields):
    from kiln.config import ModelConfig

    return ModelConfig(**{"vocab_size": VOCAB, "dim": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 16, **fields})


def model_and_data(**fields):
    from kiln.model.transformer import Transformer

    model = Transformer(model_config(**fields))
    model.init_weights(torch.Generator().manual_seed(0))
    data = torch.randint(0, VOCAB, (STEPS, 4, 13), generator=torch.Generator().manual_seed(1))
    return model, data


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def inner_step_of_two(replicas, inner, batch) -> float:
    """One inner step of each of the 2 simulated replicas (its AdamW) on its 2 rows of `batch`;
    returns their mean loss."""
    step_losses = []
    for r, (model, opt) in enumerate(zip(replicas, inner)):
        part = batch[2 * r:2 * r + 2]
        loss = model(part[:, :-1], part[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_losses.append(loss.item())
    return sum(step_losses) / 2


def simulated(outer_lr=OUTER_LR, momentum=MOMENTUM, **fields):
    """Algorithm 1 of Douillard et al. 2023 with 2 replicas in one process, written out by hand."""
    import copy

    base, data = model_and_data(**fields)
    replicas = [copy.deepcopy(base), copy.deepcopy(base)]
    inner = [adamw(m) for m in replicas]
    anchor = [p.detach().clone() for p in base.parameters()]
    velocity = [torch.zeros_like(p) for p in anchor]
    losses = []
    for step, batch in enumerate(data, start=1):
        losses.append(inner_step_of_two(replicas, inner, batch))
        if step % H == 0:
            with torch.no_grad():
                for i, params in enumerate(zip(*(m.parameters() for m in replicas))):
                    delta = anchor[i] - sum(params) / 2
                    velocity[i] = momentum * velocity[i] + delta  # Nesterov momentum
                    anchor[i] -= outer_lr * (delta + momentum * velocity[i])
                    for p in params:
                        p.copy_(anchor[i])
    return losses


def whole_replica_run(rank, world, model, data, diloco):
    """Each rank a whole DiLoCo replica training on its 2 rows of each step's batch (AdamW):
    the per-step loss averaged over the ranks, and the bytes of each outer sync started."""
    import torch.distributed as dist

    opt = adamw(model)
    losses, sent = [], []
    for step, batch in enumerate(data, start=1):
        part = batch[2 * rank:2 * rank + 2]
        loss = model(part[:, :-1], part[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sent += [sync["bytes_sent"] for sync in diloco.after_step(step)]
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, sent


def diloco_rank(rank, world):
    from kiln.parallel.diloco import DiLoCo

    model, data = model_and_data()
    diloco = DiLoCo(model, H, OUTER_LR, MOMENTUM)
    losses, sent = whole_replica_run(rank, world, model, data, diloco)
    n_params = sum(p.numel() for p in model.parameters())
    return losses, sent, n_params, diloco.state_dict()


@pytest.mark.timeout(240)
def test_two_ranks_match_the_single_process_definition(tmp_path):
    ranks = run_ranks(diloco_rank, 2, tmp_path)
    (losses, sent, n_params, state), other = ranks[0], ranks[1]
    assert losses == other[0]
    assert losses == pytest.approx(simulated(), rel=REL)
    assert sent == [4 * n_params] * (STEPS // H)  # one fp32 all-reduce of the parameters per outer step
    assert int(state["outer_steps"]) == STEPS // H
    # Not the same run as other outer settings (outer lr 1, no momentum = plain parameter averaging).
    assert losses != pytest.approx(simulated(outer_lr=1.0, momentum=0.0), rel=REL)


def test_kiln_train_logs_moe_losses_and_outer_steps(tmp_path, text_file):
    # One process: the trainer wiring (outer step every H steps with its row, MoE losses in every
    # train row, active parameters in the run row); the 2-rank numerics are checked above.
    import json

    from conftest import tiny_overrides
    from kiln.cli import main

    run = tmp_path / "run"
    sets = [x for o in tiny_overrides(text_file, **{
        "train.steps": 4, "train.eval_every": 0, "checkpoint.every": 2, "parallel.diloco_inner_steps": 2,
        "model.moe_experts": 4, "model.moe_top_k": 2, "train.device": "cpu"}) for x in ("--set", o)]
    assert main(["train", "--run-dir", str(run), *sets]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    run_row = next(r for r in rows if r["kind"] == "run")
    assert run_row["dp_mode"] == "diloco" and run_row["n_params_active"] < run_row["n_params"]
    assert (run_row["diloco_inner_steps"], run_row["diloco_fragments"], run_row["diloco_comm_dtype"]) == (2, 1, "float32")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in train)
    assert [(r["step"], r["outer_step"], r["bytes_sent"]) for r in rows if r["kind"] == "diloco"] == \
        [(2, 1, 0), (4, 2, 0)]  # one process: nothing to send


# ---- resume: every replica continues from its own parameters and inner AdamW moments
RESUME_STEPS, RESUME_H, RESUME_AT = 6, 4, 3  # the step-3 checkpoint falls before the outer sync at step 4


def resume_overrides(text_file, shards):
    from conftest import tiny_overrides

    return tiny_overrides(text_file, **{
        "train.steps": RESUME_STEPS, "train.eval_every": 0, "checkpoint.every": RESUME_AT,
        "checkpoint.keep_last": 5, "optim.name": "'adamw'", "train.device": "cpu",
        "parallel.diloco_inner_steps": RESUME_H, "data.shards_dir": repr(str(shards)),
        "metrics.peak_flops": 1e11})  # no matmul probe


def diloco_resume_ranks(rank, world, root, sets):
    """On every rank, with kiln's trainer: an uninterrupted run; a run paused after step 3 (its
    checkpoint is all that survives, as after a kill) and resumed; and the same resume with the
    old behaviour (every rank loading rank 0's model and moments) for the negative check."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    import kiln.train.trainer as trainer
    from kiln.config import load_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    root = Path(root)
    trainer.train(load_config(None, sets), root / "whole")
    trainer.train(load_config(None, sets), root / "paused", stop_at=RESUME_AT)
    dist.barrier()
    if rank == 0:
        shutil.copytree(root / "paused", root / "shared")
    dist.barrier()
    trainer.train(load_config(None, sets), root / "paused", resume=True)
    trainer.replica_states = lambda states, rank: states  # every rank under "app": rank 0's state wins
    trainer.train(load_config(None, sets), root / "shared", resume=True)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("diloco-resume")
    (root / "work").mkdir()
    run_ranks(diloco_resume_ranks, 2, root / "work", str(root), resume_overrides(text_file, root / "shards"),
              timeout=240)
    return root


def train_losses(run):
    import json

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.timeout(300)
def test_resume_between_outer_syncs_continues_each_replica_exactly(resumed):
    from kiln.checkpoint.manager import CheckpointManager

    whole, paused = train_losses(resumed / "whole"), train_losses(resumed / "paused")
    assert sorted(whole) == sorted(paused) == list(range(1, RESUME_STEPS + 1))
    # Same processes, same math: equal to the last bit, before and after the outer sync at step 4.
    assert [paused[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]
    names = CheckpointManager(resumed / "paused" / "checkpoints").saved_state_names(RESUME_AT)
    assert {"app", "diloco_rank1", "diloco"} <= names  # rank 1's replica in the one DCP checkpoint
    # The old resume (rank 0's state on every rank) gives other losses from step 4 on: the check can fail.
    old = train_losses(resumed / "shared")
    assert all(old[s] != pytest.approx(whole[s], rel=1e-6) for s in range(4, 7)), (old, whole)


def test_resume_with_another_replica_count_or_without_diloco_is_one_line(resumed, tmp_path, capsys):
    import shutil

    from kiln.cli import main

    run = tmp_path / "run"
    shutil.copytree(resumed / "paused", run)
    shutil.rmtree(run / "checkpoints" / f"step-{RESUME_STEPS}")
    before = (run / "metrics.jsonl").read_text()
    sets = [x for o in ["metrics.peak_flops=1e11"] for x in ("--set", o)]
    assert main(["train", "--resume", str(run), *sets]) == 2  # 2 replicas saved, 1 process now
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds 2 DiLoCo replicas' state, this run has 1" in err[0], err
    assert (run / "metrics.jsonl").read_text() == before  # nothing written
    # Without DiLoCo the run continues from replica 0 (what eval and export read as well).
    assert main(["train", "--resume", str(run), *sets, "--set", "parallel.diloco_inner_steps=0"]) == 0
    assert sorted(train_losses(run)) == list(range(1, RESUME_STEPS + 1))


def test_check_resume_names_both_counts():
    from kiln.errors import KilnError
    from kiln.parallel.diloco import check_resume

    check_resume({"app", "diloco", "diloco_rank1", "loader"}, 2, "x")
    check_resume({"app", "diloco"}, 1, "x")
    with pytest.raises(KilnError, match="x holds 3 DiLoCo replicas' state, this run has 2"):
        check_resume({"app", "diloco", "diloco_rank1", "diloco_rank2"}, 2, "x")
    with pytest.raises(KilnError, match="x holds 1 DiLoCo replicas' state, this run has 2"):
        check_resume({"app", "diloco"}, 2, "x")
    with pytest.raises(KilnError, match="x was saved without DiLoCo"):
        check_resume({"app", "loader"}, 2, "x")
    # Replicas split otherwise inside: resumed (the state reshards), the saved layout returned
    split = {"app", "diloco", "diloco_rank1", "diloco_layout_2x2x1"}
    assert check_resume(split, 2, "x", shards=2) is None
    assert check_resume(split, 2, "x", tp=2) == "diloco_layout_2x2x1"
    # pp, cp and ep inside a replica are in the key where > 1 (without them: the key kiln wrote before).
    from kiln.parallel.diloco import describe_layout, layout_key

    assert layout_key(2, 2, 1) == "diloco_layout_2x2x1"
    assert layout_key(2, 1, 2, pp=2, ep=2, ep_borrows_tp=True) == "diloco_layout_2x1x2_pp2_ep2_etp1"
    piped = {"app", "diloco", "diloco_rank1", layout_key(2, 1, 1, pp=2, cp=2)}
    assert check_resume(piped, 2, "x", pp=2, cp=2) is None
    assert describe_layout(check_resume(piped, 2, "x", pp=2)) == "dp_shard=1 x tp=1 x pp=2 x cp=2"
    assert check_resume({"app", "diloco", "diloco_rank1"}, 2, "x", shards=2) == "diloco_layout_2x1x1"
    # DDP / ZeRO-1 inside a replica (whole parameters) is its own layout: not FSDP's shards
    assert layout_key(2, 2, 1, replicated=True) == "diloco_layout_2x2x1_ddp"
    assert check_resume({"app", "diloco", "diloco_rank1", "diloco_layout_2x2x1_ddp"}, 2, "x", shards=2,
                        replicated=True) is None
    assert describe_layout(check_resume({"app", "diloco", "diloco_rank1", "diloco_layout_2x2x1_ddp"}, 2, "x",
                                        shards=2)) == "dp_shard=2 (ddp/zero1) x tp=1"
    # Streaming DiLoCo: the fragments (the outer state's slices follow them) and an overlapped sync
    # (the checkpoint then holds the sync awaiting its merge) must be as saved; the split need not.
    assert layout_key(2, 1, 1, fragments=4, overlapped=True) == "diloco_layout_2x1x1_frag4_overlap"
    streamed = {"app", "diloco", "diloco_rank1", layout_key(2, 1, 1, fragments=4, overlapped=True)}
    assert check_resume(streamed, 2, "x", fragments=4, overlapped=True) is None
    assert check_resume(streamed, 2, "x", tp=2, fragments=4, overlapped=True) == layout_key(2, 1, 1, fragments=4,
                                                                                          overlapped=True)
    with pytest.raises(KilnError, match=r"x holds DiLoCo replicas split dp_shard=1 x tp=1 x diloco_fragments=4 x "
                                        r"diloco_sync_delay > 0, this run's are dp_shard=1 x tp=1 x diloco_fragments=2;"
                                        r" .* set them as saved"):
        check_resume(streamed, 2, "x", fragments=2)
    with pytest.raises(KilnError, match=r"this run's are dp_shard=1 x tp=1 x diloco_fragments=4;"):
        check_resume(streamed, 2, "x", fragments=4)


def test_outer_state_keys_name_parameters_and_read_older_and_unpiped_checkpoints():
    """The anchor and momentum are keyed by parameter name. A checkpoint keyed by position (kiln
    before names, saved without pp) loads by position, not under pp; a pp head copy (`output.weight`
    tied to `tok_embeddings.weight`) that the checkpoint lacks loads the embedding's entry, also
    where this rank holds both; saves key by name again after the load."""
    from torch import nn

    from kiln.errors import KilnError
    from kiln.parallel.diloco import DiLoCo

    class Stage(nn.Module):  # a rank holding the first and the last stage of a tied model (ZBV)
        def __init__(self):
            super().__init__()
            self.tok_embeddings, self.output = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)

        def tied_embedding_copies(self):
            return (self.output.weight,)

    diloco, piped = DiLoCo(Stage(), 2), DiLoCo(Stage(), 2, pipeline=True)
    names = ["anchor.tok_embeddings.weight", "anchor.output.weight"]
    assert [k for k in diloco.state_dict() if k.startswith("anchor.")] == names
    assert diloco.match_checkpoint({"anchor.0", "anchor.1", "momentum.0", "momentum.1"}, "x")
    assert [k for k in diloco.state_dict() if k.startswith("anchor.")] == ["anchor.0", "anchor.1"]
    with pytest.raises(KilnError, match=r"^x holds DiLoCo's outer state keyed by position .* parallel\.pp=1"):
        piped.match_checkpoint({"anchor.0", "momentum.0"}, "x")
    assert piped.match_checkpoint({"anchor.tok_embeddings.weight", "momentum.tok_embeddings.weight"}, "x")
    template = piped.state_dict()
    assert [k for k in template if k.startswith("anchor.")] == ["anchor.tok_embeddings.weight"]
    saved = {k: torch.full_like(v, 7.0) if k.endswith(".weight") else v for k, v in template.items()}
    piped.load_state_dict(saved)
    assert all(torch.equal(a, torch.full_like(a, 7.0)) for a in piped.anchors() + piped.momenta())
    assert [k for k in piped.state_dict() if k.startswith("anchor.")] == names


def test_a_damaged_newest_checkpoint_falls_back_with_the_outer_state_keyed_for_the_older(tmp_path, text_file):
    """The outer state's keys are matched to each checkpoint the load tries (CheckpointManager.load
    calls match_checkpoint), not once from the newest: a replaced .metadata naming position keys
    fails its manifest and the run resumes from the older checkpoint (before: 'no usable
    checkpoint', the older one asked for the newest's keys)."""
    import pickle

    from conftest import tiny_overrides
    from kiln.config import load_config
    from kiln.train.trainer import train

    sets = tiny_overrides(text_file, **{"train.steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 5,
                                        "train.eval_every": 0, "parallel.diloco_inner_steps": 2,
                                        "checkpoint.async_save": "false"})
    run = tmp_path / "run"
    train(load_config(None, sets), run)
    path = run / "checkpoints" / "step-4" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    entries = metadata.state_dict_metadata
    for i, key in enumerate([k for k in entries if k.startswith("diloco.anchor.")]):
        entries[f"diloco.anchor.{i}"] = entries.pop(key)
    path.write_bytes(pickle.dumps(metadata))
    result = train(load_config(None, sets + ["train.steps=6"]), run, resume=True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "event" and r["message"].startswith("resumed step 2 from storage") for r in rows)
    assert result is not None and sorted({r["step"] for r in rows if r["kind"] == "train"})[-1] == 6


def test_diloco_layouts_kiln_does_not_run_are_refused_naming_the_keys():
    from kiln.config import ParallelConfig
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    for split in ({"pp": 2, "tp": 2}, {"cp": 2}, {"ep": 2}):  # any layout inside a replica
        ParallelConfig(diloco_inner_steps=2, **split).validate()
    # ep only from inside a replica: auto makes every data-parallel rank a replica (nothing to borrow
    # but cp); fsdp's replicas have dp_shard x cp ranks.
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 with parallel\.diloco_inner_steps=2 must divide a "
                                          r"replica's dp_shard x cp = 1 \(dp_mode='ddp'\): expert parallelism runs "
                                          r"inside a replica, never across replicas"):
        ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, ep=2), world_size=4, rank=0)
    with pytest.raises(ConfigError, match=r"must divide a replica's dp_shard x cp = 2 \(dp_mode='fsdp'\)"):
        ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="fsdp", dp_replicate=2, ep=4),
                                 world_size=4, rank=0)
    dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, cp=2, ep=2), world_size=4, rank=0)
    assert (dims.dp_replicate, dims.dp_shard, dims.grad_ranks) == (2, 1, 2)  # gradients over cp only
    # ddp/zero1: every data-parallel rank a replica, or dp_replicate replicas with DDP / ZeRO-1 inside
    for mode in ("ddp", "zero1"):
        dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode=mode), world_size=4, rank=0)
        assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode, dims.grad_ranks) == (4, 1, mode, 1)
        dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode=mode, dp_replicate=2, tp=2),
                                        world_size=8, rank=0)
        assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode, dims.grad_ranks) == (2, 2, mode, 2)
    # ep carved from the DDP / ZeRO-1 ranks inside a replica, never across replicas
    dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="zero1", dp_replicate=2, ep=2),
                                    world_size=4, rank=0)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep=4 with parallel\.diloco_inner_steps=2 must divide a "
                                          r"replica's dp_shard x cp = 2 \(dp_mode='ddp'\)"):
        ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="ddp", dp_replicate=2, ep=4),
                                 world_size=4, rank=0)
    with pytest.raises(ConfigError, match=r"^world size 6 is not divisible by parallel\.dp_replicate\*cp\*tp\*pp=4 "
                                          r"\(DiLoCo's replicas\)"):
        ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="ddp", dp_replicate=4), world_size=6,
                                 rank=0)
    explicit = ParallelConfig(diloco_inner_steps=2, dp_mode="zero1", dp_replicate=2, dp_shard=2)  # as kiln plan writes
    explicit.validate()
    dims = ParallelDims.from_config(explicit, world_size=4, rank=0)
    assert (dims.dp_replicate, dims.dp_shard, dims.grad_ranks) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"parallel degrees dp_replicate=2 x dp_shard=2 x cp=1 x tp=1 x pp=1 = 4, "
                                          r"but the world size is 8"):
        ParallelDims.from_config(explicit, world_size=8, rank=0)
    with pytest.raises(ConfigError, match=r"dp_mode='ddp' replicates the model on every data-parallel rank"):
        ParallelConfig(dp_mode="ddp", dp_replicate=2, dp_shard=2).validate()  # without DiLoCo: that is HSDP
    with pytest.raises(ConfigError, match=r"parallel degrees dp_replicate=2 x dp_shard=1"):  # not without DiLoCo
        ParallelDims.from_config(ParallelConfig(dp_mode="ddp", dp_replicate=2), world_size=4, rank=0)
    with pytest.raises(ConfigError, match=r"takes its replicas from parallel\.dp_replicate, which is 1 here"):
        ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="fsdp"), world_size=4, rank=0)
    ParallelConfig(diloco_inner_steps=2, tp=2).validate()
    # auto: every data-parallel rank a whole replica (tp inside); fsdp: dp_replicate replicas of dp_shard.
    dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, tp=2), world_size=8, rank=0)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode) == (4, 1, "ddp")
    dims = ParallelDims.from_config(ParallelConfig(diloco_inner_steps=2, dp_mode="zero2", dp_replicate=2),
                                    world_size=8, rank=0)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode) == (2, 4, "zero2")


# ---- model parallelism inside each replica (4 gloo ranks: 2 replicas x fsdp dp_shard 2, x tp 2,
# x pp 2, x cp 2, x ep 2 (MoE, FSDP over dp_shard 2 inside each replica))
LAYOUTS = {"fsdp": {"dp_mode": "fsdp", "dp_replicate": 2, "dp_shard": 2}, "tp": {"tp": 2},
           "pp": {"pp": 2, "pp_schedule": "1f1b"}, "cp": {"cp": 2},
           "ep": {"dp_mode": "fsdp", "dp_replicate": 2, "dp_shard": 2, "ep": 2},
           # ZeRO-2 over dp_shard 2; experts whole with ep borrowing tp (etp 1); ep carved from cp under ddp
           "zero2": {"dp_mode": "zero2", "dp_replicate": 2, "dp_shard": 2},
           "etp1": {"dp_mode": "fsdp", "dp_replicate": 2, "tp": 2, "ep": 2, "etp": 1},
           "cp_ep": {"cp": 2, "ep": 2},
           # DDP and ZeRO-1 over the 2 ranks inside each replica (whole parameters on both)
           "ddp": {"dp_mode": "ddp", "dp_replicate": 2}, "zero1": {"dp_mode": "zero1", "dp_replicate": 2},
           # the looped schedules: two stages per pp rank (interleaved 1F1B, interleaved zero bubble and looped
           # BFS: stages 0, 2 | 1, 3; ZBV: 0, 3 | 1, 2)
           "pp_interleaved": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 2},
           "pp_zbv": {"pp": 2, "pp_schedule": "zbv_zero_bubble", "pp_virtual_stages": 2, "pp_microbatches": 2},
           "pp_izb": {"pp": 2, "pp_schedule": "interleaved_zero_bubble", "pp_virtual_stages": 2, "pp_microbatches": 2},
           "pp_bfs": {"pp": 2, "pp_schedule": "looped_bfs", "pp_virtual_stages": 2, "pp_microbatches": 2}}
FOUR_RANK_LAYOUTS = list(LAYOUTS)  # the 8-rank one (below) runs in its own launch


def split_replica_run(name: str, rank: int, steps: int, hsdp: bool = False, wrong_group: str | None = None,
                      world: int = 4, fields: dict | None = None, streaming: dict | None = None,
                      inner_steps: int = H):
    """kiln's DiLoCo on 2 replicas, each split per LAYOUTS[name] ([parallel] keys), through kiln's
    own ParallelDims, parallelize, Pipeline (pp) and ContextParallel (cp), on FIELDS[name]'s model.
    Negative controls: `hsdp`, FSDP over dp_replicate x dp_shard (gradients all-reduced across the
    replicas every step); `wrong_group`, the outer step averaging over that mesh dimension instead
    of dp_replicate. Returns (losses, bytes sent per outer step, this rank's parameter elements,
    the per-parameter local shards of the anchor, {parameter name: local shard} at the end).
    `world` > 4: for checks by hand (2 replicas x fsdp 2 x tp 2 needs 8 ranks). `fields`: another
    model than FIELDS[name]'s; `streaming`: Streaming DiLoCo's DiLoCo arguments (fragments, ...), with `inner_steps`."""
    import contextlib

    import torch.distributed as dist

    from kiln.config import JobConfig, ParallelConfig
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.diloco import DiLoCo, replicated_group
    from kiln.parallel.diloco_fragment import local
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import apply_data_parallel, parallelize
    from kiln.parallel.pipeline import Pipeline
    from kiln.train.pipeline_step import pipeline_train_step

    cfg = JobConfig()
    fields = FIELDS[name] if fields is None else fields
    cfg.model = model_config(**fields)
    cfg.parallel = ParallelConfig(diloco_inner_steps=inner_steps, **LAYOUTS[name])
    cfg.train.batch_size = 2  # a replica's rows (pp: one micro-batch per stage)
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank, seq_len=12)
    dims.build_mesh("cpu")
    cpu = torch.device("cpu")
    with torch.device("meta"):  # as kiln builds it (trainer.build_model): parallelize, then initialize
        model = type(model_and_data(**fields)[0])(cfg.model)
    if hsdp:
        apply_data_parallel(model, dims, cfg, cpu, mesh_names=("dp_replicate", "dp_shard"))
    else:
        model = parallelize(model, dims, cfg, cpu)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    pipeline = Pipeline(model, cfg, dims, cpu) if dims.pp > 1 else None
    context_parallel = ContextParallel(model, dims, 12, cpu)
    opt = shard_optimizer_state(adamw(model), dims)  # zero1: partitioned over the replica's ranks
    diloco = DiLoCo(model, inner_steps, OUTER_LR, MOMENTUM, group=dims.mesh[wrong_group or "dp_replicate"].get_group(),
                    inside=None if wrong_group else replicated_group(dims),
                    n_layers=cfg.model.n_layers, **(streaming or {}))
    rows = 4 // dims.dp_size  # a replica's two rows, split over its dp_shard ranks
    _, data = model_and_data(**fields)
    losses, sent = [], []
    for step, batch in enumerate(data[:steps], start=1):
        part = batch[rows * dims.dp_rank:rows * (dims.dp_rank + 1)]
        x, y = context_parallel.shard(part[:, :-1], part[:, 1:])
        with context_parallel:
            if pipeline is not None:  # the schedule's backward and optimizer step (no clipping)
                loss = pipeline_train_step(pipeline, opt, [(x, y)], autocast=contextlib.nullcontext(),
                                           scaler=None, clip=0.0)[0]
            else:
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        sent += [sync["bytes_sent"] for sync in diloco.after_step(step)]
        mean = loss.detach().clone()  # pp: every stage's rank holds its pipeline's loss; cp: a slice's
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    if name == "zero1":  # the partition: each rank of a replica steps part of the tensors
        assert 0 < sum(p.numel() for g in opt.dense.optim.param_groups for p in g["params"]) < sum(
            p.numel() for p in model.parameters())
    return (losses, sent, sum(local(p).numel() for p in model.parameters()), [a.clone() for a in diloco.anchors()],
            params)


def split_replica_ranks(rank, world, root, sets, pp_sets, zero1_sets, zero2_sets, etp1_sets, cp_ep_sets):
    """The runs above, then kiln's trainer with 2 replicas x fsdp dp_shard 2: uninterrupted,
    and paused after step 3 (between outer syncs) and resumed; with 2 replicas x pp 2, x zero1
    over 2, x zero2 over 2, x tp 2 with ep 2 borrowing tp (etp 1, MoE) and x cp 2 with ep 2 carved
    from cp (MoE): uninterrupted, and the step-3 checkpoint continued in a copy."""
    from pathlib import Path

    import kiln.train.trainer as trainer
    from kiln.config import load_config
    from ranks import continue_in_copy

    runs = {name: split_replica_run(name, rank, STEPS) for name in FOUR_RANK_LAYOUTS}
    from kiln import torch_compat

    # the control, where this torch's HSDP averages on gloo (2.7's cannot: kiln refuses it)
    hsdp_runs = torch_compat.gloo_reduce_scatter_averages() or torch_compat.fsdp_can_force_sum(hsdp=True)
    runs["hsdp"] = split_replica_run("fsdp", rank, 4, hsdp=True) if hsdp_runs else None
    runs["cp_averaged_over_cp"] = split_replica_run("cp", rank, 4, wrong_group="cp")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    trainer.train(load_config(None, sets), Path(root) / "whole")
    trainer.train(load_config(None, sets), Path(root) / "paused", stop_at=RESUME_AT)
    trainer.train(load_config(None, sets), Path(root) / "paused", resume=True)
    trainer.train(load_config(None, pp_sets), Path(root) / "pp_whole")
    continue_in_copy(Path(root) / "pp_whole", RESUME_AT, Path(root) / "pp_resumed", pp_sets)
    trainer.train(load_config(None, zero1_sets), Path(root) / "zero1_whole")
    continue_in_copy(Path(root) / "zero1_whole", RESUME_AT, Path(root) / "zero1_resumed", zero1_sets)
    trainer.train(load_config(None, zero2_sets), Path(root) / "zero2_whole")
    continue_in_copy(Path(root) / "zero2_whole", RESUME_AT, Path(root) / "zero2_resumed", zero2_sets)
    for name, layout_sets in (("etp1", etp1_sets), ("cp_ep", cp_ep_sets)):
        trainer.train(load_config(None, layout_sets), Path(root) / f"{name}_whole")
        continue_in_copy(Path(root) / f"{name}_whole", RESUME_AT, Path(root) / f"{name}_resumed", layout_sets)
    # The step-3 checkpoints of runs with H = 2 (after the outer sync at step 2: the anchor and
    # momentum are the sync's, not the init and zero a fresh start would have) continued on another
    # split of the same 2 replicas, each replica's batch kept (its data-parallel ranks x
    # train.batch_size): fsdp 2 -> zero1 2 and -> pp 2 (the tied head copy takes the embedding's
    # anchor), pp 2 -> fsdp 2
    h2 = ["parallel.diloco_inner_steps=2"]
    trainer.train(load_config(None, sets + h2), Path(root) / "fsdp_h2")
    trainer.train(load_config(None, pp_sets + h2), Path(root) / "pp_h2")
    to_pp = pp_sets + ["parallel.dp_mode='auto'", "parallel.dp_replicate=1", "train.batch_size=8"]
    for source, target, target_sets in (("fsdp_h2", "fsdp_to_zero1", zero1_sets + h2),
                                        ("fsdp_h2", "fsdp_to_pp", to_pp + h2),
                                        ("pp_h2", "pp_to_fsdp", sets + ["parallel.pp=1", "train.batch_size=2"] + h2)):
        continue_in_copy(Path(root) / source, RESUME_AT, Path(root) / target, target_sets)
    return runs


@pytest.fixture(scope="module")
def split_root(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("diloco-split")
    (root / "work").mkdir()
    sets = resume_overrides(text_file, root / "shards")
    moe = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0.0"]  # dropless, as FIELDS["ep"]
    return root, run_ranks(split_replica_ranks, 4, root / "work", str(root),
                           sets + ["parallel.dp_mode='fsdp'", "parallel.dp_replicate=2"], sets + ["parallel.pp=2"],
                           sets + ["parallel.dp_mode='zero1'", "parallel.dp_replicate=2"],
                           sets + ["parallel.dp_mode='zero2'", "parallel.dp_replicate=2"],
                           sets + moe + ["parallel.dp_mode='fsdp'", "parallel.dp_replicate=2", "parallel.tp=2",
                                         "parallel.ep=2", "parallel.etp=1"],
                           sets + moe + ["parallel.cp=2", "parallel.ep=2"], timeout=400)


@pytest.fixture(scope="module")
def split_replicas(split_root):
    return split_root[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", FOUR_RANK_LAYOUTS)
def test_replicas_split_inside_match_the_single_process_definition(split_replicas, layout):
    # Ranks: (replica, inside) = (r // 2, r % 2), but pp's mesh is (pp, dp_replicate): (r % 2, r // 2).
    expected = simulated(**FIELDS[layout])
    n_params = sum(p.numel() for p in model_and_data(**FIELDS[layout])[0].parameters())
    peer_of = (lambda r: r ^ 1) if layout.startswith("pp") else (lambda r: (r + 2) % 4)
    for rank, runs in enumerate(split_replicas):
        losses, sent, n_local, anchor, _ = runs[layout]
        assert losses == pytest.approx(expected, rel=REL), (rank, losses, expected)
        # Each rank all-reduces its own shards (fp32) with its peer in the other replica, once per H
        # steps; where both ranks of a replica hold the same parameters (ddp, zero1; cp under ddp), half of them.
        split = 2 if layout in ("cp", "ddp", "zero1") else 1
        assert sent == [4 * -(-n_local // split)] * (STEPS // H)
        # and keeps that part of the anchor (and of the outer momentum, the same shape) only
        assert sum(a.numel() for a in anchor) == -(-n_local // split)
        peer = split_replicas[peer_of(rank)][layout]
        assert all(torch.equal(a, b) for a, b in zip(anchor, peer[3]))  # the same anchor shard in both replicas
    n_local = [runs[layout][2] for runs in split_replicas]
    params = [runs[layout][4] for runs in split_replicas]
    if layout in ("fsdp", "ep", "zero2"):  # a replica's two ranks hold the whole model, each element once
        assert n_local[0] + n_local[1] == n_params  # (ep: dense FSDP over dp_shard, experts over ep)
    elif layout == "tp":  # some parameters (the norms) are replicated over the tp ranks, the rest split
        assert n_params < n_local[0] + n_local[1] < 2 * n_params
    elif layout.startswith("pp"):  # pp coordinate 0 on ranks 0, 1 and 1 on ranks 2, 3; the tied head is the
        # last stage's copy (pp: stage 1, interleaved: stage 3 on coordinate 1; zbv: stage 3 on coordinate 0)
        last = 0 if layout == "pp_zbv" else 2
        head = params[last]["output.weight"]
        assert n_local[0] + n_local[2] == n_params + head.numel() and not set(params[0]) & set(params[2])
        for first, copy in ((0, last), (1, last + 1)):  # after the outer steps the copy still equals the embedding
            assert torch.equal(params[first]["tok_embeddings.weight"], params[copy]["output.weight"])
    elif layout in ("etp1", "cp_ep"):  # experts split over ep, the rest replicated (cp_ep) or tp-split (etp1)
        assert n_params < n_local[0] + n_local[1] < 2 * n_params
    else:  # cp, ddp, zero1: both ranks of a replica hold the whole model, equal to the last bit after the outer steps
        assert n_local[0] == n_params
        for a, b in ((0, 1), (2, 3)):
            assert params[a].keys() == params[b].keys()
            assert all(torch.equal(params[a][n], params[b][n]) for n in params[a])


def test_hsdp_across_replicas_is_not_diloco(split_replicas):
    # The negative control: gradients all-reduced across the replicas every step (HSDP) train
    # another model from step 2 on, so the check above can tell the layouts apart.
    if split_replicas[0]["hsdp"] is None:
        pytest.skip(f"HSDP cannot average over gloo under torch {torch.__version__} (kiln refuses it there)")
    expected = simulated()
    losses = split_replicas[0]["hsdp"][0]
    assert losses[0] == pytest.approx(expected[0], rel=REL)
    assert all(loss != pytest.approx(want, rel=REL) for loss, want in zip(losses[1:], expected[1:4])), losses


def test_outer_step_over_the_wrong_group_is_not_diloco(split_replicas):
    # The negative control for the split layouts: the outer step averaging over the cp ranks of one
    # replica (equal parameters: no averaging at all) instead of the replicas. The same until the
    # first outer step (step 3), another model after it (seen: 8e-4 relative at step 4).
    expected = simulated(**FIELDS["cp"])
    losses = split_replicas[0]["cp_averaged_over_cp"][0]
    assert losses[:3] == pytest.approx(expected[:3], rel=REL)
    assert losses[3] != pytest.approx(expected[3], rel=REL), losses


@pytest.mark.timeout(400)
def test_sharded_replicas_resume_between_outer_syncs_exactly(split_root):
    from kiln.checkpoint.manager import CheckpointManager

    root = split_root[0]
    whole, paused = train_losses(root / "whole"), train_losses(root / "paused")
    assert sorted(whole) == sorted(paused) == list(range(1, RESUME_STEPS + 1))
    # Same processes, same math: equal to the last bit, before and after the outer sync at step 4.
    assert [paused[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]
    names = CheckpointManager(root / "paused" / "checkpoints").saved_state_names(RESUME_AT)
    # One entry per replica (its two ranks' shards), the anchor once, the layout for check_resume.
    assert {n for n in names if n.startswith("diloco") or n == "app"} == \
        {"app", "diloco_rank1", "diloco", "diloco_layout_2x2x1"}
    # Every tensor's saved chunks tile it exactly once: a replica's shards (and the anchor, equal
    # across replicas) are written once, not once per rank.
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kiln.checkpoint.safe_load import load_metadata

    path = root / "paused" / "checkpoints" / f"step-{RESUME_AT}" / ".metadata"
    tensors = {fqn: m for fqn, m in load_metadata(path.read_bytes(), str(path)).state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    assert {"app.model.tok_embeddings.weight", "diloco_rank1.model.tok_embeddings.weight",
            "diloco.anchor.tok_embeddings.weight", "diloco.momentum.tok_embeddings.weight"} <= set(tensors)
    for fqn, m in tensors.items():
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), (fqn, m.chunks)
    assert len(tensors["diloco.anchor.tok_embeddings.weight"].chunks) == 2  # sharded over dp_shard, like the parameter


@pytest.mark.parametrize("source, target, saved, now", [
    ("fsdp_h2", "fsdp_to_zero1", "dp_shard=2 x tp=1", "dp_shard=2 (ddp/zero1) x tp=1"),
    ("fsdp_h2", "fsdp_to_pp", "dp_shard=2 x tp=1", "dp_shard=1 x tp=1 x pp=2"),
    ("pp_h2", "pp_to_fsdp", "dp_shard=1 x tp=1 x pp=2", "dp_shard=2 x tp=1")])
def test_replicas_resume_on_another_split_inside(split_root, source, target, saved, now):
    # A step-3 checkpoint (after the outer sync at 2, before the one at 4) continued with the same 2
    # replicas split otherwise inside: each replica's model and moments and the anchor and momentum
    # reshard (DCP, keyed by name), so steps 4-6 are the uninterrupted run's up to the reduction
    # order; the layout change is one event row. The pp source (replicas of half the batch) differs.
    import json

    root = split_root[0]
    want, got = train_losses(root / source), train_losses(root / target)
    assert sorted(got) == list(range(1, RESUME_STEPS + 1))
    assert [got[s] for s in range(4, 7)] == pytest.approx([want[s] for s in range(4, 7)], rel=1e-5)
    other = train_losses(root / ("pp_h2" if source == "fsdp_h2" else "fsdp_h2"))
    assert all(other[s] != pytest.approx(want[s], rel=1e-5) for s in range(4, 7))
    rows = [json.loads(x) for x in (root / target / "metrics.jsonl").read_text().splitlines()]
    events = [r["message"] for r in rows if r["kind"] == "event" and "resharded" in r["message"]]
    assert events == [f"DiLoCo's 2 replicas resharded from {saved} to {now}"]


def test_pipelined_replicas_resume_between_outer_syncs_exactly(split_root):
    # 2 replicas x pp 2 through kiln's trainer: the anchor is keyed by parameter name (each stage's
    # ranks hold other parameters), so the step-3 checkpoint continues each stage's anchor and
    # each replica's moments: the losses after the outer sync at step 4 equal the uninterrupted run's.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kiln.checkpoint.safe_load import load_metadata

    root = split_root[0]
    continued_exactly(root, "pp", "diloco_layout_2x1x1_pp2")
    path = root / "pp_whole" / "checkpoints" / f"step-{RESUME_AT}" / ".metadata"
    tensors = {fqn for fqn, m in load_metadata(path.read_bytes(), str(path)).state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    # the first stage's embedding and the last stage's tied head copy, each with its own anchor
    assert {"diloco.anchor.tok_embeddings.weight", "diloco.anchor.output.weight",
            "diloco.momentum.layers.1.attention.wq.weight"} <= tensors


def test_zero1_replicas_resume_between_outer_syncs_exactly(split_root):
    # 2 replicas x ZeRO-1 over 2 ranks each through kiln's trainer: each replica saves its own
    # inner moments (each rank its boxes), the step-3 checkpoint continues them bit for bit.
    continued_exactly(split_root[0], "zero1", "diloco_layout_2x2x1_ddp")


def test_zero2_replicas_resume_between_outer_syncs_exactly(split_root):
    # 2 replicas x ZeRO-2 (FSDP, parameters kept gathered through backward) over 2 ranks each:
    # FSDP's layout key, each replica's shards and moments continued bit for bit.
    continued_exactly(split_root[0], "zero2", "diloco_layout_2x2x1")


def test_expert_parallel_replicas_resume_between_outer_syncs_exactly(split_root):
    # 2 replicas x tp 2 with ep 2 borrowing tp (etp 1; experts whole on their ep rank) and 2 replicas
    # x cp 2 with ep 2 carved from cp (ddp over cp), MoE, through kiln's trainer: each layout's key
    # (ep and etp named) and the step-3 checkpoint continued bit for bit past the outer sync.
    continued_exactly(split_root[0], "etp1", "diloco_layout_2x1x2_ep2_etp1")
    continued_exactly(split_root[0], "cp_ep", "diloco_layout_2x1x1_cp2_ep2")


def continued_exactly(root, run: str, layout: str) -> None:
    """`run`'s copy continued from its step-3 checkpoint (between outer syncs) has the losses of
    the uninterrupted run bit for bit, and the checkpoint holds replica 0 (`app`), replica 1, the
    anchor once and the layout entry `layout`."""
    from kiln.checkpoint.manager import CheckpointManager

    whole, resumed = train_losses(root / f"{run}_whole"), train_losses(root / f"{run}_resumed")
    assert sorted(resumed) == list(range(1, RESUME_STEPS + 1))
    assert [resumed[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]
    names = CheckpointManager(root / f"{run}_whole" / "checkpoints").saved_state_names(RESUME_AT)
    assert {n for n in names if n.startswith("diloco") or n == "app"} == {"app", "diloco_rank1", "diloco", layout}


# ---- pp, cp and ep in one replica (the one 8-rank launch, with the trainer's resume): 2 replicas x
# pp 2 (1F1B) x cp 2 with ep 2 carved from cp (MoE, dp_mode auto = ddp over cp)
LAYOUTS["pp_cp_ep"] = {"pp": 2, "pp_schedule": "1f1b", "cp": 2, "ep": 2}
FIELDS["pp_cp_ep"] = {"n_layers": 2, **FIELDS["ep"]}


def pp_cp_ep_ranks(rank, world, root, sets):
    """Against the definition; then kiln's trainer, uninterrupted and its step-3 checkpoint
    (between outer syncs) continued in a copy."""
    from pathlib import Path

    import kiln.train.trainer as trainer
    from kiln.config import load_config
    from ranks import continue_in_copy

    losses, sent, n_local, anchor, _ = split_replica_run("pp_cp_ep", rank, STEPS, world=world)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    trainer.train(load_config(None, sets), Path(root) / "pp_cp_ep_whole")
    continue_in_copy(Path(root) / "pp_cp_ep_whole", RESUME_AT, Path(root) / "pp_cp_ep_resumed", sets)
    return losses, sent, n_local


@pytest.fixture(scope="module")
def pp_cp_ep_root(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("diloco-pp-cp-ep")
    (root / "work").mkdir()
    sets = resume_overrides(text_file, root / "shards") + [
        "model.n_layers=2", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0.0",
        "parallel.dp_replicate=2", "parallel.pp=2", "parallel.pp_schedule='1f1b'", "parallel.cp=2", "parallel.ep=2"]
    return root, run_ranks(pp_cp_ep_ranks, 8, root / "work", str(root), sets, timeout=400)


@pytest.mark.timeout(500)
def test_pipelined_context_and_expert_parallel_replicas_match_the_definition(pp_cp_ep_root):
    expected = simulated(**FIELDS["pp_cp_ep"])
    for rank, (losses, sent, n_local) in enumerate(pp_cp_ep_root[1]):
        assert losses == pytest.approx(expected, rel=REL), (rank, losses, expected)
        assert sent == [4 * n_local] * (STEPS // H)  # one all-reduce of its own shards per outer step


@pytest.mark.timeout(500)
def test_pipelined_context_and_expert_parallel_replicas_resume_between_outer_syncs_exactly(pp_cp_ep_root):
    # 2 replicas x pp 2 x cp 2 with ep 2 = cp through kiln's trainer: each stage's anchor, each
    # replica's moments and experts continued bit for bit past the outer sync at step 4.
    continued_exactly(pp_cp_ep_root[0], "pp_cp_ep", "diloco_layout_2x1x1_pp2_cp2_ep2")

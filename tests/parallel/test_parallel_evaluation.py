"""The trainer's evaluation under parallelism: split over data-parallel ranks and the cp ring, and
agreed on every rank (kiln/train/evaluate.py, kiln/data/loader.py `rank_batches`)."""

import numpy as np
import pytest
import torch

from kiln.config import load_config
from kiln.data.loader import TokenWindows, eval_batches, leading_batches
from kiln.data.shards import ShardSet, ShardWriter, write_meta
from kiln.data.tokenizer import ByteTokenizer
from kiln.model.transformer import Transformer
from kiln.train.evaluate import Evaluator
from ranks import run_ranks

SEQ, BATCH, EVAL_BATCHES = 16, 2, 3
# The held-out text has 5 windows: fewer than batch x ranks x eval_batches, and odd, so the
# ranks' blocks differ in length (3 and 2: the second padded).
HELD_OUT_WINDOWS = 5


def windows_of(n, seq=SEQ):
    return TokenWindows([np.arange(n * seq + 1, dtype=np.int64) % 250], seq)


@pytest.mark.parametrize("n,size", [(12, 2), (5, 2), (7, 3), (2, 4), (8, 1)])
def test_rank_batches_cover_the_one_process_windows_once_with_equal_shapes(n, size):
    windows = windows_of(n)
    one = torch.cat([x for x, _ in leading_batches(windows, BATCH * size)])
    counted, shapes = [], []
    for rank in range(size):
        batches = list(leading_batches(windows, BATCH, share=(rank, size)))
        shapes.append([tuple(x.shape) for x, _, _ in batches])
        counted += [x[:rows] for x, _, rows in batches]
        assert all(len(x) <= BATCH for x, _, _ in batches)
    assert all(s == shapes[0] for s in shapes)  # every rank: the same forwards
    assert torch.equal(torch.cat(counted), one)  # every window once, in order; padding never counted


def test_rank_batches_refuse_a_ragged_tail():
    ragged = TokenWindows([np.arange(3 * SEQ + 5, dtype=np.int64)], SEQ, ragged_tail=True)
    with pytest.raises(ValueError, match="full-length windows only"):
        list(leading_batches(ragged, BATCH, share=(0, 2)))


def test_spread_eval_windows_are_the_one_process_set_of_the_global_batch():
    windows = windows_of(40)
    one = torch.cat([x for x, _ in eval_batches(windows, BATCH * 2, EVAL_BATCHES)])
    shared = [x[:rows] for rank in range(2) for x, _, rows in eval_batches(windows, BATCH, EVAL_BATCHES, (rank, 2))]
    assert torch.equal(torch.cat(shared), one)


def write_val_shards(folder, val_docs):
    """Byte-tokenized shards: these validation documents and a token train split."""
    tok = ByteTokenizer()
    writers = []
    for split, docs in (("train", ["x" * 50]), ("val", val_docs)):
        w = ShardWriter(folder, split, tok.vocab_size, tok.eos_id, shard_tokens=400)
        for t in docs:
            w.add(tok.encode(t))
        w.finish()
        writers.append(w)
    write_meta(folder, writers)


@pytest.fixture(scope="module")
def data(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("parallel_eval")
    body = text_file.read_text()[:8000]
    write_val_shards(root / "shards", [body[i:i + 500] for i in range(0, 6000, 500)])
    held_out = root / "held-out.txt"
    held_out.write_text(body[6000:6000 + HELD_OUT_WINDOWS * SEQ + 3])  # + eos: 5 whole windows, not 6
    return root


@pytest.fixture(scope="module")
def docs_data(tmp_path_factory, text_file):
    """Packed documents (data.windows = "packed_masked"): validation shards of 3-12 byte documents
    and a JSONL eval set of such documents, so every 16-token window holds several."""
    import json

    root = tmp_path_factory.mktemp("parallel_eval_docs")
    body = text_file.read_text()[:4000]
    cuts = np.cumsum([3 + (7 * i) % 10 for i in range(300)])
    docs = [body[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b <= len(body)]
    write_val_shards(root / "shards", docs[:200])
    (root / "held-out.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[200:240]))
    return root


def overrides(data, **parallel):
    held_out = next(data.glob("held-out.*"))
    return [f"data.seq_len={SEQ}", f"train.batch_size={BATCH}", f"train.eval_batches={EVAL_BATCHES}",
            "train.dtype=fp32", "train.device='cpu'", f"train.eval_sets=[{str(held_out)!r}]",
            "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.vocab_size=257",
            f"model.max_seq_len={SEQ}", *[f"parallel.{k}={v!r}" for k, v in parallel.items()]]


def model_of(cfg, seed):
    model = Transformer(cfg.model)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def evaluate_rank(rank, world, data, parallel, seeds, extra=()):
    """Evaluator under `parallel` on this rank (the model from seeds[rank]; `extra` overrides);
    returns (results, the (batch, tokens) shapes its forwards saw)."""
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import parallelize

    cfg = load_config(None, overrides(data, **parallel) + list(extra))
    cpu = torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world, seq_len=SEQ)
    dims.build_mesh("cpu")
    model = parallelize(model_of(cfg, seeds[rank]), dims, cfg, cpu)
    context = ContextParallel(model, dims, SEQ, cpu)
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    evaluator = Evaluator(model, ShardSet(data / "shards", "val"), ByteTokenizer(), cfg, cpu, dims, context)
    return evaluator.run(), shapes


def one_process(data, seed=0, batch=BATCH * 2, extra=()):
    """The single process's numbers for the global batch of two data-parallel ranks."""
    cfg = load_config(None, overrides(data) + [f"train.batch_size={batch}", *extra])
    return Evaluator(model_of(cfg, seed), ShardSet(data / "shards", "val"), ByteTokenizer(), cfg,
                     torch.device("cpu")).run()


def assert_close(got, want):
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.parametrize("parallel,batch,tokens", [
    ({"dp_mode": "ddp"}, BATCH * 2, SEQ),                  # windows split over 2 ranks
    ({"dp_mode": "fsdp"}, BATCH * 2, SEQ),                 # the same under FSDP (forwards are collectives)
    ({"cp": 2}, BATCH, SEQ // 2),                          # every window, each rank its zig-zag half
])
def test_evaluation_is_split_and_equals_one_process(data, tmp_path, parallel, batch, tokens):
    if parallel.get("dp_mode") == "fsdp":
        from conftest import require_fsdp2_on_cpu

        require_fsdp2_on_cpu()
    ranks = run_ranks(evaluate_rank, 2, tmp_path, data, parallel, (0, 0))
    want = one_process(data, batch=batch)
    for results, shapes in ranks:
        assert_close(results, want)
        assert {s[1] for s in shapes} == {tokens}  # cp: the ring's slices, never whole sequences
    assert ranks[0][0] == ranks[1][0]
    # rows each rank ran: data parallel, its block (val 6 of 12; held-out 3 of 5, as 2 + 1);
    # cp, every window (val 6; held-out 5) at half length
    assert sum(s[0] for s in ranks[0][1]) == (6 + 5 if "cp" in parallel else 6 + 3)


def test_diloco_replicas_agree_on_replica_zeros_numbers(data, tmp_path):
    """DiLoCo's replicas hold different models between outer steps: each rank must take rank 0's
    numbers, or early stopping and the plateau schedule decide differently and the job hangs."""
    ranks = run_ranks(evaluate_rank, 2, tmp_path, data, {"dp_mode": "ddp", "diloco_inner_steps": 4}, (0, 1))
    want = one_process(data, seed=0, batch=BATCH)  # a replica: one rank, its own batch
    for results, _ in ranks:
        assert_close(results, want)
    assert one_process(data, seed=1, batch=BATCH)["val_loss"] != want["val_loss"]  # replica 1's own differ


def evaluate_pipeline_rank(rank, world, data, tp, extra=()):
    """Evaluator under pp=2 (x `tp`) as the trainer builds it (`extra` overrides); returns
    (results, the sizes of every tensor broadcast and the DTensors gathered whole during the
    evaluation)."""
    import torch.distributed as dist

    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.pipeline import Pipeline, PipelineEvalModel
    from kiln.train.trainer import build_model

    from torch.distributed.tensor import DTensor

    cfg = load_config(None, overrides(data, pp=2, pp_schedule="1f1b", tp=tp) + ["train.seed=0", *extra])
    cpu = torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world, seq_len=SEQ)
    dims.build_mesh("cpu")
    model = build_model(cfg, dims, cpu)
    evaluator = Evaluator(PipelineEvalModel(Pipeline(model, cfg, dims, cpu)), ShardSet(data / "shards", "val"),
                          ByteTokenizer(), cfg, cpu, dims, ContextParallel(model, dims, SEQ, cpu))
    sizes, broadcast, full_tensor = [], dist.broadcast, DTensor.full_tensor

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    def gathering(self, *args, **kwargs):
        whole = full_tensor(self, *args, **kwargs)
        sizes.append(whole.numel())
        return whole

    dist.broadcast, DTensor.full_tensor = recording, gathering
    try:
        return evaluator.run(), sizes
    finally:
        dist.broadcast, DTensor.full_tensor = broadcast, full_tensor


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_evaluation_sends_the_loss_not_the_logits(data, tmp_path, tp):
    """Under pp the last stage scores each batch and broadcasts one number: no stage but the last
    holds the logits (batch x seq x vocab), under tp not even whole there (vocab-parallel loss);
    the numbers are one process's."""
    ranks = run_ranks(evaluate_pipeline_rank, 2 * tp, tmp_path, data, tp)
    want = one_process(data, seed=0, batch=BATCH)
    hidden = BATCH * SEQ * 32  # what tp's stages gather between them: the hidden states, not logits
    for results, sizes in ranks:
        assert_close(results, want)
        assert sizes and max(sizes) <= max(len(want), hidden if tp > 1 else 0), sizes


MASKED = ["data.windows='packed_masked'"]


def evaluate_masked_rank(rank, world, data):
    """Packed documents' evaluation on 2 ranks: data parallel, cp's ring, pp's stages (one launch)."""
    return [evaluate_rank(rank, world, data, {"dp_mode": "ddp"}, (0, 0), MASKED)[0],
            evaluate_rank(rank, world, data, {"cp": 2}, (0, 0), MASKED)[0],
            evaluate_pipeline_rank(rank, world, data, 1, MASKED)[0]]


def test_packed_documents_are_scored_masked_under_every_layout(docs_data, tmp_path):
    """data.windows = "packed_masked": validation and eval sets are scored with attention inside
    each document, as training runs: split over data-parallel ranks, through the cp ring (the
    whole sequences' ids) and through pp's stages, each equal to one masked process; the mask
    changes the numbers on this data, so a layout ignoring it fails."""
    ranks = run_ranks(evaluate_masked_rank, 2, tmp_path, docs_data)
    masked = {batch: one_process(docs_data, batch=batch, extra=MASKED) for batch in (BATCH, BATCH * 2)}
    unmasked = one_process(docs_data, batch=BATCH * 2)
    assert set(masked[BATCH * 2]) == {f"{s}_{k}" for s in ("val", "held_out") for k in ("loss", "ppl", "bpb")}
    for key in ("val_loss", "held_out_loss"):
        assert masked[BATCH * 2][key] != pytest.approx(unmasked[key], rel=1e-6), key  # seen >= 4e-5 apart
    for ddp, cp, pp in ranks:
        assert_close(ddp, masked[BATCH * 2])
        assert_close(cp, masked[BATCH])
        assert_close(pp, masked[BATCH])

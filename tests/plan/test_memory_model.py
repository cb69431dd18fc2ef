"""The one memory model against exact byte counts of a real tiny model, and its layout rules."""

import pytest
import torch

from kiln.config import load_config
from kiln.plan.memory import Layout, ModelShape, in_flight_microbatches, rank_memory, zero1_fullest_share
from kiln.train.memory import estimate_train_bytes, layout_of


def _shape(overrides=()):
    cfg = load_config(None, ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=300",
                             "data.seq_len=32", "model.max_seq_len=32", *overrides])
    return cfg, ModelShape.from_config(cfg.model, 300)


def test_weights_grads_and_adamw_state_match_a_real_step():
    from kiln.model.transformer import Transformer

    cfg, shape = _shape()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 300, (2, 32))
    model(tokens, tokens).backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    mem = rank_memory(shape, Layout(precision="fp32", micro_batch=2), 32, "adamw")
    assert mem.notes == ["eager peak in the blocks' backward"]  # the phase that holds every gradient
    assert mem.parameters == params and mem.gradients == grads and mem.optimizer == state


def test_eager_peak_is_the_larger_phase():
    """The loss's backward (saved activations and 3 fp32 logits-sized tensors, 5 under loss
    parallel; no gradients with grad_accum 1) or the blocks' backward (every gradient, the block
    being recomputed), whichever is larger; never their sum."""
    _, shape = _shape(["model.n_layers=8"])
    logits = 4 * 32 * 32 * shape.vocab  # fp32, micro-batch 32 x 32 tokens
    at_loss = rank_memory(shape, Layout(micro_batch=32, precision="fp32", loss="full"), 32)
    assert at_loss.notes == ["eager peak in the loss's backward"] and at_loss.gradients == 0
    assert at_loss.temporary == pytest.approx(3 * logits)
    tp = rank_memory(shape, Layout(tp=2, micro_batch=32, precision="fp32", loss="full"), 32)
    assert tp.temporary == pytest.approx(5 * logits / 2)
    accumulated = rank_memory(shape, Layout(micro_batch=32, grad_accum=2, precision="fp32", loss="full"), 32)
    assert accumulated.gradients == accumulated.parameters  # the earlier micro-batch's, held through the loss
    assert accumulated.total == pytest.approx(at_loss.total + accumulated.parameters)
    # full recompute of one short sequence: the blocks' backward is larger
    full = rank_memory(shape, Layout(micro_batch=1, precision="fp32", ac="full", loss="full"), 8)
    assert full.notes == ["eager peak in the blocks' backward"] and full.gradients == full.parameters
    assert full.temporary == 0 and full.activations > 8 * 4 * shape.dim * 8  # block inputs + one recomputed block


def test_sharding_rules_per_mode():
    _, shape = _shape()
    base = dict(micro_batch=1, precision="bf16")
    ddp = rank_memory(shape, Layout(dp_replicate=4, dp_mode="ddp", **base), 32)
    zero1 = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", **base), 32)
    zero2 = rank_memory(shape, Layout(dp_shard=4, dp_mode="zero2", **base), 32)
    fsdp = rank_memory(shape, Layout(dp_shard=4, dp_mode="fsdp", **base), 32)
    hsdp = rank_memory(shape, Layout(dp_replicate=2, dp_shard=2, dp_mode="fsdp", **base), 32)
    # ZeRO-1 cuts AdamW's tensors to an even 1/4 (zero1_fullest_share); LAMB's stay whole, so the
    # fullest rank holds more
    assert zero1.optimizer == pytest.approx(ddp.optimizer / 4) and zero1.parameters == ddp.parameters
    lamb = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", **base), 32, optimizer="lamb")
    assert ddp.optimizer / 4 < lamb.optimizer < ddp.optimizer
    assert zero2.gradients == fsdp.gradients == ddp.gradients / 4
    assert fsdp.parameters == ddp.parameters / 4 and hsdp.parameters == ddp.parameters / 2
    # zero2 keeps every block gathered through backward, fsdp two at a time (and the root both)
    _, deep = _shape(["model.n_layers=4"])
    assert (rank_memory(deep, Layout(dp_shard=4, dp_mode="zero2", **base), 32).temporary
            > rank_memory(deep, Layout(dp_shard=4, dp_mode="fsdp", **base), 32).temporary)
    assert zero2.temporary == fsdp.temporary  # 2 blocks: fsdp's current and prefetched are all
    tp = rank_memory(shape, Layout(tp=2, **base), 32)
    one = rank_memory(shape, Layout(**base), 32)
    norms = (2 * shape.n_layers + 1) * shape.dim  # two per block and the final one
    assert tp.parameters == 4 * ((shape.params - norms) / 2 + norms)  # every norm is replicated
    # halved, but for the all-gathered normed inputs that DTensor's linears save whole (32 tokens, bf16)
    gathered = shape.n_layers * shape.gathered_bytes_per_token(2) * 32
    assert tp.activations == pytest.approx((one.activations - gathered) / 2 + gathered)


def test_activation_checkpointing_and_pipeline_schedules():
    _, shape = _shape(["model.n_layers=8"])
    lay = dict(micro_batch=4, precision="bf16")
    none, sel, full = (rank_memory(shape, Layout(ac=a, **lay), 32).activations for a in ("none", "selective", "full"))
    assert full < sel < none
    every4 = rank_memory(shape, Layout(ac="every_k:4", **lay), 32).activations
    assert sel < every4 < none
    pp = dict(pp=4, grad_accum=8)
    assert in_flight_microbatches(Layout(schedule="gpipe", **pp)) == 8
    assert in_flight_microbatches(Layout(schedule="1f1b", **pp)) == 4
    assert 4 < in_flight_microbatches(Layout(schedule="interleaved_1f1b", virtual_stages=2, **pp)) < 8
    gpipe = rank_memory(shape, Layout(schedule="gpipe", **pp, **lay), 32)
    f1b = rank_memory(shape, Layout(schedule="1f1b", **pp, **lay), 32)
    assert gpipe.activations == 2 * f1b.activations  # 8 micro-batches in flight against 4


def test_train_refusal_uses_the_same_model():
    cfg, shape = _shape(["train.batch_size=3", "train.dtype=bf16"])
    assert estimate_train_bytes(cfg) == int(rank_memory(shape, layout_of(cfg), 32, "adamw").total)


def _stage_params(cfg, rank):
    """Parameters kiln's own split (kiln/parallel/pipeline.py split_model, on meta) gives pp rank `rank`."""
    from kiln.model.transformer import Transformer
    from kiln.parallel import pipeline as pl

    with torch.device("meta"):
        full = Transformer(cfg.model)
    return sum(p.numel() for p in pl.split_model(full, cfg, rank).parameters())


def test_pipeline_end_ranks_hold_what_kilns_split_gives_them():
    """Under pp the first rank holds the embedding, the last the head: for tied embeddings the last
    stage's own copy (kiln/parallel/pipeline_tied.py); ZBV's rank 0 holds both ends."""
    from kiln.plan.memory import rank_params

    for tied in ("true", "false"):
        for sched, virtual in (("1f1b", 1), ("zbv_zero_bubble", 2)):
            cfg, shape = _shape([f"model.tie_embeddings={tied}", "model.n_layers=4", "parallel.pp=2",
                                 f"parallel.pp_schedule={sched}", f"parallel.pp_virtual_stages={virtual}",
                                 "train.grad_accum=2"])
            lay = Layout(pp=2, schedule=sched, virtual_stages=virtual, grad_accum=2)
            for rank, last in ((0, False), (1, True)):
                dense, experts, _ = rank_params(shape, lay, last)
                assert (dense, experts) == (_stage_params(cfg, rank), 0), (tied, sched, rank)


def test_tied_head_copy_costs_the_last_stage_like_an_untied_head():
    """The copy's weight, gradient, optimizer state and autocast cast sit on the last stage: a tied
    model under pp needs what an untied one needs on its fullest rank (both ends hold vocab x dim)."""
    lay = Layout(pp=2, grad_accum=2, micro_batch=1, precision="bf16")
    _, tied = _shape(["model.tie_embeddings=true", "model.vocab_size=4000"])
    _, untied = _shape(["model.tie_embeddings=false", "model.vocab_size=4000"])
    tied, untied = (ModelShape(**{**s.__dict__, "vocab": 4000}) for s in (tied, untied))
    t, u = rank_memory(tied, lay, 32), rank_memory(untied, lay, 32)
    head = 4000 * 64
    assert t.parameters == 4 * (head + tied.layer_params + 64)  # one block, the norm and the head copy
    assert t.as_dict() == u.as_dict()
    assert t.temporary >= 2 * head  # the copy's bf16 cast under autocast


def test_data_parallel_over_tensor_parallel_shards():
    """ddp / zero1 x tp: each rank holds its tp shard; ddp keeps its whole optimizer state, zero1
    splits its tensors over dp (the fullest rank's share); DDP's buckets hold the local gradients."""
    _, shape = _shape(["model.vocab_size=300"])
    base = dict(tp=2, micro_batch=1, precision="fp32")
    tp = rank_memory(shape, Layout(**base), 32)
    ddp = rank_memory(shape, Layout(dp_replicate=4, dp_mode="ddp", **base), 32)
    zero1 = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", **base), 32)
    norms = (2 * shape.n_layers + 1) * shape.dim  # two per block and the final one
    assert ddp.parameters == ddp.gradients == tp.parameters == 4 * ((shape.params - norms) / 2 + norms)
    share = zero1_fullest_share(shape, Layout(dp_replicate=4, dp_mode="zero1", **base))
    assert ddp.optimizer == tp.optimizer and zero1.optimizer == pytest.approx(tp.optimizer * share)
    assert share == pytest.approx(1 / 4)  # AdamW's tensors are cut: even
    assert 1 / 4 < zero1_fullest_share(shape, Layout(dp_replicate=4, dp_mode="zero1", **base), optimizer="lamb") < 1 / 2
    assert ddp.comm_buffers == tp.gradients  # the local gradients (under 2 x 25 MiB) in buckets


def _moe(overrides=()):
    return _shape(["model.moe_experts=4", "model.moe_top_k=2", *overrides])


def test_experts_counted_and_split_over_ep_and_etp():
    """Experts: all on one rank (the exact parameter count of kiln's MoE model); over ep x tp with
    etp = tp; over ep alone when ep borrows the tp ranks (etp = 1: whole experts), then FSDP over
    edp = dp_shard x tp / ep (kiln/parallel/dims.py _build_expert_mesh_borrowing_tp)."""
    from kiln.model.transformer import Transformer
    from kiln.plan.memory import rank_params

    cfg, shape = _moe()
    mem = rank_memory(shape, Layout(precision="fp32"), 32)
    assert mem.parameters == 4 * sum(p.numel() for p in Transformer(cfg.model).parameters())
    experts = shape.expert_params
    fsdp = dict(dp_shard=2, tp=2, dp_mode="fsdp", precision="fp32")
    etp_tp, borrow = Layout(ep=2, **fsdp), Layout(ep=2, etp=1, **fsdp)
    assert (etp_tp.expert_dp, borrow.expert_dp) == (1, 2)
    assert rank_params(shape, etp_tp)[1] == experts / 4 and rank_params(shape, borrow)[1] == experts / 2
    dense = rank_params(shape, borrow)[0]
    # tp shards the matrices and embedding; the norms and the routers (E x dim) are replicated
    replicated = (2 * shape.n_layers + 1) * shape.dim + shape.moe_layers * shape.moe_experts * shape.dim
    assert dense == rank_params(shape, etp_tp)[0] == (shape.params - experts - replicated) / 2 + replicated
    assert rank_memory(shape, borrow, 32).parameters == 4 * (dense / 2 + experts / 4)
    whole = rank_memory(shape, Layout(ep=4, etp=1, **fsdp), 32)  # ep over dp_shard x tp: edp = 1
    assert whole.parameters == 4 * (dense / 2 + experts / 4)
    zero2 = [rank_memory(shape, Layout(ep=2, etp=e, **{**fsdp, "dp_mode": "zero2"}), 32) for e in (-1, 1)]
    assert zero2[1].temporary - zero2[0].temporary == 4 * experts / 4  # gathered: whole experts, twice etp=tp's


def test_ring_matmul_blocks_hold_chunk_squared_scores_per_head():
    """Context parallel with the ring's matmul block kernel (GPUs; attention dropout) holds 5 fp32
    (chunk x chunk) tensors per head of the rank while a block runs (ring_block_bytes; measured by
    benchmarks/ring_attention.py); torch's fused CPU kernel holds none of them. The search sets the
    fused kernel on gloo (CPU) clusters, and the trainer's refusal on CPU without dropout."""
    import dataclasses

    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims
    from kiln.plan.memory import ring_block_bytes

    cfg, shape = _shape(["model.n_layers=4", "data.seq_len=4096", "model.max_seq_len=4096"])
    for tp, mb in ((1, 2), (2, 1)):
        gpu = Layout(cp=4, tp=tp, micro_batch=mb, dp_shard=1)
        cpu = dataclasses.replace(gpu, fused_ring_blocks=True)
        chunk = 4096 // 8
        expected = 5 * 4 * mb * (4 / tp) * chunk * chunk
        assert ring_block_bytes(shape, gpu, 4096) == expected
        assert rank_memory(shape, gpu, 4096).temporary - rank_memory(shape, cpu, 4096).temporary == expected
        assert rank_memory(shape, Layout(tp=tp, micro_batch=mb), 4096).total < rank_memory(
            shape, dataclasses.replace(gpu, cp=1), 4096).total + 1  # no cp, no ring term
    dims = ParallelDims.from_config(ParallelConfig(cp=2), world_size=2, rank=0, local_rank=0, seq_len=4096)
    assert layout_of(cfg, dims).fused_ring_blocks  # this CPU, no dropout
    cfg.model.dropout = 0.1
    assert not layout_of(cfg, dims).fused_ring_blocks


def test_search_counts_the_ring_kernel_of_the_cluster():
    """`kiln plan` on a GPU cluster counts the matmul blocks' scores for cp layouts, on a gloo
    (CPU) cluster the fused kernel: the same cp layout's memory differs by ring_block_bytes."""
    from kiln.plan.cluster import load_cluster
    from kiln.plan.memory import ring_block_bytes
    from kiln.plan.search import search

    _, shape = _shape(["model.n_layers=4", "data.seq_len=4096", "model.max_seq_len=4096"])
    found = {}
    for name in ("cpu-local", "h100"):
        cluster = load_cluster(name, nodes=1)
        plans = search(shape, cluster, 4096, 8, max_tp=1, max_pp=1)
        found[name] = next(p for p in plans if p.layout.cp == 2 and p.layout.dp == cluster.world_size // 2)
    cpu, gpu = found["cpu-local"].layout, found["h100"].layout
    assert cpu.fused_ring_blocks and not gpu.fused_ring_blocks
    assert found["h100"].memory.temporary >= ring_block_bytes(shape, gpu, 4096) > 0

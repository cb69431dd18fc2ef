"""The one memory model against exact byte counts of a real tiny model, and its layout rules."""

import torch

from kiln.config import load_config
from kiln.plan.memory import Layout, ModelShape, in_flight_microbatches, rank_memory
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
    assert mem.parameters == params and mem.gradients == grads and mem.optimizer == state


def test_sharding_rules_per_mode():
    _, shape = _shape()
    base = dict(micro_batch=1, precision="bf16")
    ddp = rank_memory(shape, Layout(dp_replicate=4, dp_mode="ddp", **base), 32)
    zero1 = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", **base), 32)
    zero2 = rank_memory(shape, Layout(dp_shard=4, dp_mode="zero2", **base), 32)
    fsdp = rank_memory(shape, Layout(dp_shard=4, dp_mode="fsdp", **base), 32)
    hsdp = rank_memory(shape, Layout(dp_replicate=2, dp_shard=2, dp_mode="fsdp", **base), 32)
    assert zero1.optimizer == ddp.optimizer / 4 and zero1.parameters == ddp.parameters
    assert zero2.gradients == fsdp.gradients == ddp.gradients / 4
    assert fsdp.parameters == ddp.parameters / 4 and hsdp.parameters == ddp.parameters / 2
    assert zero2.temporary > fsdp.temporary  # zero2 keeps every parameter gathered through backward
    tp = rank_memory(shape, Layout(tp=2, **base), 32)
    one = rank_memory(shape, Layout(**base), 32)
    assert tp.parameters == 4 * ((shape.params - shape.dim) / 2 + shape.dim)  # the final norm is replicated
    assert tp.activations == one.activations / 2


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

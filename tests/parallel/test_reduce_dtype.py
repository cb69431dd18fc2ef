"""parallel.reduce_dtype = "bf16" under the replicating modes: every data-parallel gradient
reduction sends bf16 (4 gloo ranks, one launch, each layout built as the trainer builds it):
torch's DDP (ddp, zero1: `bf16_compress_hook`), DDP around each pipeline stage (1F1B), kiln's
replicas (ddp x tp: `OverlappedReplicas`; ZBV: `SplitBackwardReplicas`) and the replicated experts
(ddp x ep, one micro-batch and two). FSDP's policy is checked in test_parallelize.py.

The sign: a sum made in bf16 and copied into the fp32 gradient is a bf16 value, so after the
step's reduction every weight matrix's gradient is exactly representable in bf16; with fp32 on the
wire (the control) it is not. The losses stay within bf16 rounding of the fp32 run's. Also: the
replicated experts' sums start inside the backward (`ReplicatedExpertGrads`' parameter hooks)."""

import pytest
import torch

from tests.parallel.ranks import run_ranks

OVERRIDES = ["model.dim=64", "model.n_layers=4", "model.n_heads=2", "model.vocab_size=256", "data.seq_len=32",
             "model.max_seq_len=32", "train.dtype=fp32", "model.tie_embeddings=false", "optim.lr=1e-2"]
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "parallel.ep=2"]
LAYOUTS = {  # 4 ranks each
    "ddp": ["parallel.dp_mode='ddp'"],
    "zero1": ["parallel.dp_mode='zero1'"],
    "ddp_tp": ["parallel.dp_mode='ddp'", "parallel.tp=2"],
    "ddp_pp_1f1b": ["parallel.dp_mode='ddp'", "parallel.pp=2", "parallel.pp_schedule='1f1b'",
                    "parallel.pp_microbatches=2"],
    "ddp_pp_zbv": ["parallel.dp_mode='ddp'", "parallel.pp=2", "parallel.pp_schedule='zbv_zero_bubble'",
                   "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=2"],
    "ddp_ep": ["parallel.dp_mode='ddp'", *MOE],
    "ddp_ep_ga2": ["parallel.dp_mode='ddp'", "train.grad_accum=2", *MOE],
}
STEPS = 3


def _train(rank, n):
    from kiln.config import load_config
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.pipeline import Pipeline
    from kiln.train.pipeline_step import pipeline_train_step
    from kiln.train.optim import build_optimizer
    from kiln.train.step import train_step
    from kiln.train.system import resolve_loss
    from kiln.train.trainer import build_model

    out = {}
    for name, extra in LAYOUTS.items():
        for wire in ("bf16", "fp32"):
            cfg = load_config(None, OVERRIDES + extra + [f"parallel.reduce_dtype={wire!r}"])
            dims = ParallelDims.from_config(cfg.parallel, world_size=n, rank=rank, local_rank=rank,
                                            local_world_size=n, seq_len=cfg.data.seq_len)
            dims.build_mesh("cpu")
            device = torch.device("cpu")
            model = build_model(cfg, dims, device)
            pipeline = Pipeline(model, cfg, dims, device) if dims.pp > 1 else None
            model.loss_impl = resolve_loss(cfg.train.loss, device, False, tp=dims.tp)
            optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)
            exact, step = [], optimizer.step

            def record_then_step(*args, **kwargs):  # the reduced gradients, before the update
                for p in model.parameters():
                    if p.grad is not None and p.ndim >= 2:
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        exact.append(bool(torch.equal(g, g.to(torch.bfloat16).float())))
                return step(*args, **kwargs)

            optimizer.step = record_then_step
            losses = []
            for i in range(STEPS):
                tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(i))
                rows = tokens[dims.dp_rank * 8 // dims.dp_size:(dims.dp_rank + 1) * 8 // dims.dp_size]
                batch = [(part[:, :-1], part[:, 1:]) for part in rows.chunk(cfg.train.grad_accum)]
                loss = (train_step if pipeline is None else pipeline_train_step)(
                    pipeline or model, optimizer, batch, autocast=torch.autocast("cpu", enabled=False),
                    scaler=None, clip=0.0)[0]
                losses.append(float(loss))
            experts = getattr(model, "replicated_expert_grads", None)  # ddp x ep: how the last step's sums started
            started = None if experts is None else (experts.started_in_backward, len(experts._weights()))
            out[name, wire] = {"bf16_exact": exact, "losses": losses, "experts_started_in_backward": started}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_train, 4, tmp_path_factory.mktemp("reduce_dtype"), timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_reduce_sends_every_gradient_in_bf16(runs, layout):
    for rank, result in enumerate(runs):
        exact = result[layout, "bf16"]["bf16_exact"]
        assert exact and all(exact), f"rank {rank}: {exact.count(False)} of {len(exact)} gradients not bf16 sums"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_reduce_is_not_bf16_rounded(runs, layout):
    """The control: the check above fails on an fp32 reduction."""
    for result in runs:
        assert not all(result[layout, "fp32"]["bf16_exact"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_reduce_trains_as_fp32_within_its_rounding(runs, layout):
    bf16, fp32 = (runs[0][layout, wire]["losses"] for wire in ("bf16", "fp32"))
    assert bf16[0] == fp32[0]  # the first loss comes before any reduction
    assert bf16[1:] != fp32[1:]  # the bf16 sums moved the weights differently
    assert bf16 == pytest.approx(fp32, rel=2e-3)


@pytest.mark.parametrize("layout", ["ddp_ep", "ddp_ep_ga2"])
def test_replicated_experts_sums_start_inside_the_last_backward(runs, layout):
    """ddp x ep: each expert weight's sum over its replicas starts from its post-accumulate hook
    while the backward still runs (overlapping it, as DDP's buckets), not at the backward's end."""
    for result in runs:
        for wire in ("bf16", "fp32"):
            started, weights = result[layout, wire]["experts_started_in_backward"]
            assert weights == 4 * 3 and started == weights  # 4 MoE blocks, w1 w2 w3 each

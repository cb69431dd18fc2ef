"""`parallelize`'s stages in one process. The final data-parallel stage applies what `[parallel]`
names (on a one-rank gloo mesh): ZeRO-2 never reshards after forward, FSDP reshards every block
but the last, reduce_dtype reaches FSDP2's mixed-precision policy, ddp/zero1 replicate in place, their gradients views into DDP's buckets.
Compile: the mode from train.cuda_graphs / train.autotune. Activation checkpointing: the selective
checkpoint passes uneven profiler markers through, and "op" (keep_compute_op_outputs) keeps what
it names and changes no value, eager, compiled and with float8 linears."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kiln.config import load_config
from kiln.model.transformer import Transformer
from kiln.parallel.dims import ParallelDims
from kiln.parallel.parallelize import apply_data_parallel, compile_mode


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def parallelized(mesh, mode, *overrides):
    cfg = load_config(None, ["model.dim=32", "model.n_layers=3", "model.n_heads=2", "model.vocab_size=64",
                             f"parallel.dp_mode={mode}", *overrides])
    dims = ParallelDims(1, 1, 1, 1, 1, 1, world_size=1, dp_mode=mode, reduce_dtype=cfg.parallel.reduce_dtype)
    dims.mesh = mesh
    with torch.device("meta"):
        model = Transformer(cfg.model)
    apply_data_parallel(model, dims, cfg, torch.device("cpu"))
    return model


def reshards_after_forward(module) -> bool:
    return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


def test_zero2_keeps_parameters_gathered_from_forward_to_backward(one_rank_mesh):
    model = parallelized(one_rank_mesh, "zero2")
    assert [reshards_after_forward(b) for b in model.layers] == [False, False, False]


def test_fsdp_reshards_every_block_but_the_last(one_rank_mesh):
    model = parallelized(one_rank_mesh, "fsdp")
    assert [reshards_after_forward(b) for b in model.layers] == [True, True, False]


@pytest.mark.parametrize("reduce_dtype, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_reduce_dtype_reaches_the_mixed_precision_policy(one_rank_mesh, reduce_dtype, expected):
    model = parallelized(one_rank_mesh, "fsdp", f"parallel.reduce_dtype={reduce_dtype}")
    for module in (*model.layers, model):
        policy = module._get_fsdp_state()._fsdp_param_group.mp_policy
        assert policy.reduce_dtype == expected and policy.param_dtype is None  # bf16 params: GPUs only


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicating_modes_keep_the_module_and_its_names(one_rank_mesh, mode):
    from torch.distributed._composable.replicate import replicate

    model = parallelized(one_rank_mesh, mode)
    assert replicate.state(model) is not None and not hasattr(model.layers[0], "_get_fsdp_state")
    with torch.device("meta"):
        plain = Transformer(load_config(None, ["model.dim=32", "model.n_layers=3", "model.n_heads=2",
                                               "model.vocab_size=64"]).model)
    # Checkpoints are keyed by these names: replication must not prefix them (as DDP's `module.`).
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicated_gradients_live_in_ddps_buckets(one_rank_mesh, mode):
    """gradient_as_bucket_view: each gradient is a view into DDP's all-reduce bucket, so the
    gradients take their bytes once, not once in `.grad` and again in the buckets; also after
    zero_grad(set_to_none) DDP points the new gradients back into the buckets."""
    model = parallelized(one_rank_mesh, mode)
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads = [p.grad for p in model.parameters()]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        assert len(grads) > 10 and len(storages) <= 2  # DDP's small first bucket and the rest


@pytest.mark.parametrize("cuda_graphs, autotune, mode", [
    (False, False, None), (True, False, "reduce-overhead"),
    (False, True, "max-autotune-no-cudagraphs"), (True, True, "max-autotune")])
def test_compile_mode_follows_cuda_graphs_and_autotune(cuda_graphs, autotune, mode):
    assert compile_mode(cuda_graphs, autotune) == mode
    import torch._inductor.config  # noqa: F401  (list_mode_options lives there)
    from torch._inductor import list_mode_options
    if autotune:  # torch's mode: inductor's GEMM autotuning on, CUDA graphs only with cuda_graphs
        options = list_mode_options(mode)
        assert options["max_autotune"] and options.get("triton.cudagraphs", False) == cuda_graphs


def test_autotuned_model_compile_matches_eager(monkeypatch):
    """train.autotune: the whole model compiled in max-autotune mode (on CPU inductor's own GEMM
    choices) gives eager's loss and gradients within fp32 tolerance."""
    import copy

    from torch import _dynamo

    from kiln import torch_compat

    if not torch_compat.max_autotune_trains_exactly():
        pytest.skip(f"torch {torch.__version__}: max-autotune's tied-embedding gradient is wrong (kiln refuses it)")
    from kiln.train.trainer import build_model

    cfg = load_config(None, ["model.vocab_size=61", "model.dim=32", "model.n_heads=4", "model.n_layers=2",
                             "model.max_seq_len=16", "data.seq_len=16"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    eager = build_model(cfg, dims, torch.device("cpu"))
    model = copy.deepcopy(eager)
    from kiln.parallel.parallelize import apply_compile
    modes, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: modes.append(k.get("mode")) or compile_(*a, **k))
    apply_compile(model, "model", autotune=True)
    assert modes == ["max-autotune-no-cudagraphs"]
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        losses = [m(x, targets=x) for m in (eager, model)]
        for loss in losses:
            loss.backward()
    finally:
        _dynamo.reset()
    assert model._compiled_call_impl is not None  # nn.Module.compile in place
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)



def test_autotune_is_refused_where_torch_gets_it_wrong(tmp_path, text_file, monkeypatch):
    from kiln import torch_compat
    from kiln.errors import KilnError
    from kiln.train.trainer import train

    from conftest import tiny_overrides

    monkeypatch.setattr(torch_compat, "max_autotune_trains_exactly", lambda: False)  # torch 2.6
    cfg = load_config(None, tiny_overrides(text_file, **{"train.compile": "true", "train.autotune": "true"}))
    with pytest.raises(KilnError, match=r"^train\.autotune=true under torch .*set train\.autotune=false"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


class _UnevenMarkers(torch.nn.Module):
    """A block that opens one more record-function range in each call than the last (as an FSDP
    unit inside a checkpointed block does in the recompute), with a random mask the selective
    checkpoint keeps."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = torch.nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        for _ in range(self.calls):  # one in the forward, two in the recompute
            with torch.profiler.record_function("marker"):
                pass
        h = self.linear(x)
        return h * (torch.rand_like(h) > 0.5)  # a random op kept from the forward


@pytest.mark.parametrize("fixed", [True, False])
def test_selective_checkpoint_lets_uneven_profiler_markers_through(monkeypatch, fixed):
    """parallelize.ignore_profiler_ops_in_selective_checkpoints: a block whose recompute opens more
    record-function ranges than its forward (the experts' FSDP unit under ep x tp) backpropagates
    under kiln's selective checkpoint, with the forward's random mask. Negative control: without
    it, torch's checkpoint stops in backward (2.13 on: its checkpoint looks up every op of the
    recompute by count; earlier ones looked up only the kept ones, so the markers never mismatched)."""
    import torch.utils.checkpoint as checkpoint

    from kiln.parallel import parallelize

    markers = {torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit.default,
               torch.ops.profiler._record_function_exit._RecordFunction}
    monkeypatch.setattr(checkpoint, "SAC_IGNORED_OPS", set(checkpoint.SAC_IGNORED_OPS) - markers)
    if not fixed:
        if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
            pytest.skip(f"torch {torch.__version__}'s selective checkpoint does not count recomputed ops")
        monkeypatch.setattr(parallelize, "ignore_profiler_ops_in_selective_checkpoints", lambda: None)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_UnevenMarkers()])
    parallelize.apply_activation_checkpointing(model, "full", keep_random_outputs=True)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(0)
    out = model.layers[0](x)
    if not fixed:
        with pytest.raises(RuntimeError, match="not found in storage"):
            out.sum().backward()
        return
    out.sum().backward()
    block = model.layers[0]._checkpoint_wrapped_module
    assert block.calls == 2  # the forward and its recompute
    reference, x_ref = _UnevenMarkers(), x.detach().clone().requires_grad_()
    reference.load_state_dict(block.state_dict())
    torch.manual_seed(0)
    reference(x_ref).sum().backward()  # the forward's mask (same seed)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(block.linear.weight.grad, reference.linear.weight.grad)


@pytest.mark.parametrize("scope", ["eager", "blocks", "model"])
def test_op_checkpointing_matches_no_checkpointing(scope):
    """train.activation_checkpointing = "op" (kiln/parallel/parallelize.py keep_compute_op_outputs)
    changes no value: a dense and a MoE block, eager or compiled per block / whole model (aot_eager),
    against the same model without checkpointing: loss and every gradient. (With dropout it is
    refused, tests/train/test_trainer.py.)"""
    import copy

    from torch import _dynamo

    from kiln import torch_compat
    from kiln.parallel.parallelize import apply_activation_checkpointing, apply_compile
    from kiln.train.trainer import build_model

    if scope != "eager" and not torch_compat.dynamo_traces_data_dependent_splits():
        pytest.skip(f"torch {torch.__version__}: kiln refuses compile with MoE (test_dims.py)")
    cfg = load_config(None, ["model.vocab_size=61", "model.dim=32", "model.n_heads=4", "model.n_layers=2",
                             "model.max_seq_len=16", "data.seq_len=16", "model.moe_experts=4", "model.moe_every=2"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    reference = build_model(cfg, dims, torch.device("cpu"))
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, "op")
    if scope != "eager":
        compile_ = torch.compile
        torch.compile = functools.partial(compile_, backend="aot_eager")
        try:
            apply_compile(model, scope)
        finally:
            torch.compile = compile_
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        losses = []
        for m in (reference, model):
            losses.append(m(x, targets=x))
            losses[-1].backward()
    finally:
        _dynamo.reset()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_op_checkpointing_keeps_the_heavy_ops_and_recomputes_the_rest(one_rank_mesh):
    """keep_compute_op_outputs' choices by op: matmuls, attention (SDPA, cp's ring), tp's
    reduce-scatter, ep's all-to-all and random ops kept; norms, activations, casts and tp's
    all-gathers recomputed; a row-parallel matmul (input sharded on the contraction dim) recomputed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from kiln.parallel.parallelize import keep_compute_op_outputs

    ctx, aten, funcol = SelectiveCheckpointContext(is_recompute=False), torch.ops.aten, torch.ops._c10d_functional
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    kept = [aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.kiln.ring_attention.default,
            funcol.reduce_scatter_tensor.default, funcol.all_to_all_single.default, aten.native_dropout.default,
            aten.max.default]
    recomputed = [aten.rsqrt.default, aten.silu.default, aten.mul.Tensor, aten._to_copy.default,
                  funcol.all_gather_into_tensor.default, funcol.wait_tensor.default]
    for op in kept:
        assert keep_compute_op_outputs(ctx, op, a, b) == CheckpointPolicy.MUST_SAVE, op
    for op in recomputed:
        assert keep_compute_op_outputs(ctx, op, a, b) == CheckpointPolicy.PREFER_RECOMPUTE, op
    mesh = one_rank_mesh
    column = distribute_tensor(a, mesh, [Replicate()])  # a column-parallel input: whole rows
    row = distribute_tensor(a, mesh, [Shard(1)])  # a row-parallel input: sharded on the contraction dim
    assert keep_compute_op_outputs(ctx, aten.mm.default, column, b) == CheckpointPolicy.MUST_SAVE
    assert keep_compute_op_outputs(ctx, aten.mm.default, row, b) == CheckpointPolicy.PREFER_RECOMPUTE


def test_op_checkpointing_with_float8_linears_matches_no_checkpointing():
    """float8 (torchao tensorwise, its real float8 GEMMs on the CPU) under "op" checkpointing: the
    float8 linears' matmuls are kept (they reach the policy as aten.mm on torchao's tensors), the
    casts recomputed; loss and gradients equal the same model without checkpointing, bf16 autocast."""
    import copy

    from conftest import float8_cpu_matmul_error, float8_import_error

    if (why := float8_import_error() or float8_cpu_matmul_error()) is not None:
        pytest.skip(why)
    from torchao.float8 import Float8LinearConfig

    from kiln.parallel.parallelize import apply_activation_checkpointing, convert_float8
    from kiln.train.trainer import build_model

    cfg = load_config(None, ["model.vocab_size=64", "model.dim=64", "model.n_heads=4", "model.n_layers=2",
                             "model.max_seq_len=32", "data.seq_len=32"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    reference = build_model(cfg, dims, torch.device("cpu"))
    convert_float8(reference, Float8LinearConfig.from_recipe_name("tensorwise"))
    assert type(reference.layers[0].attention.wq).__name__ == "Float8Linear"
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, "op")
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(m(x, targets=x))
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=0, msg=name)

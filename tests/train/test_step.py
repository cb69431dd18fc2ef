"""The sync-free step: the same numbers as the host-checked step it replaced, bit for bit on CPU,
for every optimizer kiln builds, on both of train_step's paths (on CPU it checks on the host;
`force_device_skip` makes it take the device path, found_inf, which GPUs take); a non-finite step
leaves parameters and optimizer state untouched; and on the device path the step never reads a
tensor on the host."""

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.config import ModelConfig, OptimConfig, ScheduleConfig
from kiln.model.loss import lm_loss
from kiln.model.transformer import Transformer
from kiln.train.optim import build_optimizer
from kiln.train.schedule import LRSchedule
from kiln.train.step import PendingSteps, force_device_skip, honours_found_inf, skips_on_device, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)

NO_AUTOCAST = contextlib.nullcontext()

# (optimizer, implementation, honours found_inf). torch's non-fused optimizers have no found_inf
# path: they keep one host check per step on every device (the run row's nonfinite_check: "host").
OPTIMIZERS = [("adamw", "fused", True), ("adamw", "foreach", False), ("adamw", "single", False),
              ("lion", "auto", True), ("lamb", "auto", True), ("muon", "auto", True),
              ("sgd", "auto", False), ("adafactor", "auto", False)]
IDS = [f"{name}-{impl}" for name, impl, _ in OPTIMIZERS]
# Each optimizer on the path train_step takes on CPU (host), and those that honour found_inf also
# on the path a GPU takes (device, forced on CPU by force_device_skip).
PATHS = [(name, impl, path) for name, impl, found_inf in OPTIMIZERS
         for path in (("host", "device") if found_inf else ("host",))]
PATH_IDS = [f"{name}-{impl}-{path}" for name, impl, path in PATHS]


def _setup(optim: str, impl: str = "auto", mesh=None, path: str = "host"):
    model = Transformer(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    model.init_weights(torch.Generator().manual_seed(0))
    if mesh is not None:  # FSDP2: every parameter becomes a DTensor sharded over the mesh
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, OptimConfig(name=optim, implementation=impl, lr=1e-2, momentum=0.9))
    LRSchedule(opt, ScheduleConfig(warmup_steps=0), 10)
    if path == "device":
        force_device_skip(opt)
    assert skips_on_device(opt) is (path == "device")  # CPU parameters: the host check unless forced
    return model, opt


def _batches(n: int):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        t = torch.randint(0, 50, (2, 17), generator=gen)
        out.append([(t[:, :-1], t[:, 1:])])
    return out


def _old_step(model, optimizer, micro_batches, clip):
    """The step as kiln ran it before: loss from logits, then a host check before stepping."""
    total = torch.zeros(())
    for x, y in micro_batches:
        loss = lm_loss(model(x), y) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf, foreach=True)
    finite = bool(torch.isfinite(total) and torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, finite


def _state(opt):
    """Every tensor of the optimizer state, per parameter, in a fixed order."""
    return [(k, v.clone()) for s in opt.state.values() for k, v in sorted(s.items()) if torch.is_tensor(v)]


@pytest.mark.parametrize("optim, impl, path", PATHS, ids=PATH_IDS)
def test_sync_free_step_is_bitwise_the_old_step(optim, impl, path):
    new_model, new_opt = _setup(optim, impl, path=path)
    old_model, old_opt = _setup(optim, impl)
    for batch in _batches(4):
        loss, gnorm, skipped = train_step(new_model, new_opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
        ref_loss, ref_gnorm, finite = _old_step(old_model, old_opt, batch, 1.0)
        assert torch.equal(loss, ref_loss) and torch.equal(gnorm, ref_gnorm) and bool(skipped) is not finite
    for a, b in zip(new_model.parameters(), old_model.parameters()):
        assert torch.equal(a, b)
    assert all(ka == kb and torch.equal(a, b) for (ka, a), (kb, b) in zip(_state(new_opt), _state(old_opt)))


def _poison(model, batch, how: str):
    """Make the next step non-finite: an inf weight (non-finite loss and gradients) or a NaN gradient
    (finite loss). Returns the parameters as they must be after the skipped step."""
    if how == "loss":
        model.loss_impl = "full"
        with torch.no_grad():
            model.layers[0].attention.wq.weight[0, 0] = float("inf")
        return [p.detach().clone() for p in model.parameters()], None
    handle = model.layers[1].feed_forward.w2.weight.register_hook(lambda g: g * float("nan"))
    return [p.detach().clone() for p in model.parameters()], handle


@pytest.mark.parametrize("how", ["loss", "grad"])
@pytest.mark.parametrize("optim, impl, path", PATHS, ids=PATH_IDS)
def test_non_finite_step_changes_nothing(optim, impl, path, how):
    model, opt = _setup(optim, impl, path=path)
    ref_model, ref_opt = _setup(optim, impl)
    first, second, third = _batches(3)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        train_step(m, o, first, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
    state = _state(opt)
    params, hook = _poison(model, second, how)
    loss, gnorm, skipped = train_step(model, opt, second, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
    assert bool(skipped)
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b.detach())
    after = _state(opt)
    assert [k for k, _ in after] == [k for k, _ in state]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state, after)), "optimizer state changed"
    if hook is not None:  # the run goes on as if the bad batch never came
        hook.remove()
        train_step(model, opt, third, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
        train_step(ref_model, ref_opt, third, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor's value by the host: item(), bool(), float(), int(), and the
    comparisons Python makes with them all reach aten._local_scalar_dense (on a GPU that is the
    device sync); is_nonzero is bool() of a one-element tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host read of a tensor value during the step: {func}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_host_reads(monkeypatch):
    """Also refuse the Python-level copies to the host, which do not dispatch an aten op on CPU."""
    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"Tensor.{name}() during the step")
        return method

    for name in ("tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    return _NoHostReads


@pytest.mark.parametrize("optim, impl", [("adamw", "foreach"), ("lion", "auto")])
def test_the_host_read_guard_catches_the_host_checked_step(optim, impl, no_host_reads):
    """Also with an optimizer that honours found_inf: on CPU train_step checks on the host."""
    model, opt = _setup(optim, impl)
    (batch,) = _batches(1)
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        train_step(model, opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)


@pytest.mark.parametrize("optim, impl", [(n, i) for n, i, found_inf in OPTIMIZERS if found_inf])
def test_step_never_reads_a_tensor_on_the_host(optim, impl, no_host_reads):
    """The device path, forced on CPU (force_device_skip), as a GPU takes it."""
    model, opt = _setup(optim, impl, path="device")
    assert honours_found_inf(opt)
    batches = _batches(3)
    with no_host_reads():
        for batch in batches[:2]:  # the first step creates the optimizer state
            train_step(model, opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
        _poison(model, batches[2], "grad")
        _, _, skipped = train_step(model, opt, batches[2], autocast=NO_AUTOCAST, scaler=None, clip=1.0)
    assert skipped.item()


class _ScaledLoss(torch.nn.Module):
    """The model's loss times `scale`: NaN makes the loss and every gradient non-finite, also when
    the parameters are FSDP shards (a hook on a sharded parameter never sees its gradient)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.scale = model, 1.0

    def forward(self, x, y):
        return self.model(x, y) * self.scale


# Every optimizer. kiln's on both paths: the host path is what CPU ranks run, the device path
# (found_inf) what GPU ranks run; torch's fused AdamW on the device path, its non-fused SGD and
# kiln's Adafactor have only the host path.
FSDP_CASES = ["adamw-device", "sgd-host", "adafactor-host", *(f"{name}-{path}" for name in ("lion", "lamb", "muon")
                                                              for path in ("host", "device"))]


# Ops with a DTensor sharding rule in torch 2.6.0 and in 2.11.0 (read in their
# torch/distributed/tensor/_ops/ sources), so kiln's optimizers step sharded parameters across the
# declared range: e.g. the out-of-place _foreach_lerp and _foreach_sign have no rule there.
DTENSOR_RULES_SINCE_2_6 = frozenset(f"aten.{op}" for op in (
    "_foreach_add_.List", "_foreach_add_.Scalar", "_foreach_addcmul_.Scalar", "_foreach_div.List",
    "_foreach_lerp_.Scalar", "_foreach_mul.Scalar", "_foreach_mul.Tensor", "_foreach_mul_.List",
    "_foreach_mul_.Scalar", "_foreach_mul_.Tensor", "_foreach_norm.Scalar", "_foreach_sqrt_.default",
    "_fused_adamw_.default", "add_.Tensor", "bitwise_and.Tensor", "div.Tensor", "gt.Scalar",
    "lerp.Scalar", "lerp_.Scalar", "lerp_.Tensor", "mul_.Tensor", "nan_to_num_.default",
    "ones_like.default", "sign_.default", "where.self", "zeros_like.default"))


class _DTensorOps(TorchDispatchMode):
    """Records the aten ops that receive a DTensor (those need a DTensor sharding rule)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _recording_step(opt, recorder):
    plain_step = opt.step

    def step(*args, **kwargs):
        with recorder:
            return plain_step(*args, **kwargs)
    return step


def _fsdp_rank(rank: int, world: int) -> dict[str, tuple[float, list[bool], set[str]]]:
    """Three steps (the second one non-finite) of each optimizer and path, sharded and unsharded,
    on the same batches on every rank (so the mean gradient is the unsharded one): the largest
    difference, and the ops the sharded optimizer step ran on DTensors."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case in FSDP_CASES:
        name, path = case.split("-")
        runs = []
        for shard_mesh in (None, mesh):
            model, opt = _setup(name, mesh=shard_mesh, path=path)
            recorder = _DTensorOps()
            opt.step = _recording_step(opt, recorder)
            scaled = _ScaledLoss(model)
            skipped = []
            for i, batch in enumerate(_batches(3)):
                scaled.scale = math.nan if i == 1 else 1.0
                skipped.append(bool(train_step(scaled, opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)[2]))
            params = [p.full_tensor() if shard_mesh is not None else p.detach() for p in model.parameters()]
            runs.append((params, skipped))
        (ref, ref_skipped), (got, got_skipped) = runs
        assert ref_skipped == got_skipped == [False, True, False], (case, ref_skipped, got_skipped)
        out[case] = (max(float((a - b).abs().max()) for a, b in zip(got, ref)),
                     [bool(torch.isfinite(p).all()) for p in got], recorder.ops)
    return out


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_optimizer_skips_on_fsdp2_shards_like_one_process(tmp_path):
    """2 gloo ranks, FSDP2 (DTensor) parameters: each optimizer's step on either path, a skipped
    non-finite step included, gives the unsharded run's parameters (to float reduction order), and
    kiln's optimizers run only ops with DTensor rules since torch 2.6 on the shards."""
    results = run_ranks(_fsdp_rank, 2, tmp_path, timeout=200)
    for case in FSDP_CASES:
        for rank in results:
            diff, finite, ops = rank[case]
            assert all(finite), f"{case}: non-finite parameters after the skipped step"
            assert diff < 1e-5, f"{case}: sharded differs from one process by {diff}"
            if case.split("-")[0] in ("lion", "lamb", "muon", "adafactor"):  # kiln's; torch's are torch's business
                assert ops <= DTENSOR_RULES_SINCE_2_6, f"{case}: {sorted(ops - DTENSOR_RULES_SINCE_2_6)}"


def test_pending_steps_fetch_in_order_once():
    pending = PendingSteps()
    for i in range(3):
        pending.add(i + 1, torch.tensor(float(i)), torch.tensor(0.5), torch.tensor(i == 1), lr=0.1 * i,
                    data_wait_s=0.0, tokens=10 * (i + 1))
    got = pending.fetch()
    assert [(r.step, r.loss, r.skipped, r.tokens) for r in got] == [(1, 0.0, False, 10), (2, 1.0, True, 20),
                                                                      (3, 2.0, False, 30)]
    assert pending.fetch() == [] and len(pending) == 0


def _pending_rank(rank, world):
    pending = PendingSteps()
    for step in (1, 2):  # step 2: non-finite on rank 1 only (a DiLoCo replica of its own)
        pending.add(step, torch.tensor(float(rank)), torch.tensor(1.0 + rank), torch.tensor(step == 2 and rank == 1),
                    lr=0.1, data_wait_s=0.0, tokens=10, extras={"aux": torch.tensor(2.0 * rank)})
    return [(r.loss, r.grad_norm, r.skipped, r.extras) for r in pending.fetch()]


def test_pending_steps_agree_on_a_step_any_rank_skipped(tmp_path):
    """Every rank must count the same non-finite steps (train.max_nonfinite_steps stops all or none)."""
    got = run_ranks(_pending_rank, 2, tmp_path)
    for rank, rows in enumerate(got):
        assert [skipped for _, _, skipped, _ in rows] == [False, True]
        assert [(loss, norm, extras["aux"]) for loss, norm, _, extras in rows] == [(0.5, 1.0 + rank, 1.0)] * 2

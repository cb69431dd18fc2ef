"""kiln's Adafactor (kiln/train/optimizers/adafactor.py): torch's algorithm, and on sharded
parameters (every placement FSDP2, HSDP, tp, FSDP x tp and ep give) the steps and state of one
process, with each phase's sums in one all_reduce per mesh dimension."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import torch_compat
from kiln.train.optimizers.adafactor import Adafactor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)

SHAPES = [(8, 6), (6,), (3, 5, 4), (1, 7), (5, 1), (4, 3, 2, 2)]
SETTINGS = [{}, {"lr": 0.05, "weight_decay": 0.1}, {"maximize": True, "eps": (1e-30, 1e-3), "d": 1.5}]


def _steps(opt_cls, params, grads, **kwargs):
    opt = opt_cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch's Adafactor came in 2.5")
@pytest.mark.parametrize("scalars", ["host", "device"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "weight decay", "maximize eps d"])
def test_steps_and_state_are_torchs(settings, scalars, monkeypatch):
    """alpha and the denominator read on the host (the CPU's path) or kept as tensors (a GPU's)."""
    from kiln.train.optimizers import adafactor

    if scalars == "device":
        monkeypatch.setattr(adafactor, "HOST_SCALARS", ())
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(6)]
    ours = [nn.Parameter(w.clone()) for w in start]
    theirs = [nn.Parameter(w.clone()) for w in start]
    opt = _steps(Adafactor, ours, grads, **settings)
    ref = _steps(torch.optim.Adafactor, theirs, grads, foreach=False, **settings)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in want:
        assert set(got[i]) == set(want[i])
        for key in want[i]:
            assert got[i][key].shape == want[i][key].shape and got[i][key].device == want[i][key].device
            torch.testing.assert_close(got[i][key], want[i][key], rtol=1e-5, atol=1e-12)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch's Adafactor came in 2.5")
def test_a_torch_adafactor_checkpoint_resumes_here():
    """Runs that used torch's Adafactor (kiln before) saved its state and groups: they load."""
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(6)]
    theirs = [nn.Parameter(w.clone()) for w in start]
    ref = _steps(torch.optim.Adafactor, theirs, grads[:3], foreach=False, weight_decay=0.1)
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt = Adafactor(ours, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a file: torch's load shares `step`
    for step_grads in grads[3:]:
        for opt_, params in ((opt, ours), (ref, theirs)):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt_.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("bad, match", [({"lr": -1.0}, "lr"), ({"beta2_decay": 0.5}, "beta2_decay"),
                                        ({"eps": (-1.0, 1e-3)}, "eps"), ({"eps": (None, -1.0)}, "eps"),
                                        ({"d": 0.5}, "d="), ({"weight_decay": -0.1}, "weight_decay")])
def test_bad_settings_are_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        Adafactor([nn.Parameter(torch.zeros(2, 2))], **bad)


def test_sparse_gradients_are_refused():
    p = nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Adafactor([p]).step()


# name -> (full shape, mesh "1d" (4 ranks) or "2d" (2 x 2), placements)
CASES = {
    "rows (fsdp)": ((12, 8), "1d", ("S0",)),
    "uneven rows": ((5, 7), "1d", ("S0",)),
    "fewer rows than ranks": ((3, 9), "1d", ("S0",)),
    "columns (row-parallel tp)": ((6, 10), "1d", ("S1",)),
    "conv kernel": ((8, 4, 3, 3), "1d", ("S0",)),
    "conv kernel cut on the factored dim": ((4, 8, 3, 3), "1d", ("S3",)),
    "vector": ((10,), "1d", ("S0",)),
    "vector, fewer than ranks": ((3,), "1d", ("S0",)),
    "replicated": ((6, 6), "1d", ("R",)),
    "replicated, a partial gradient (a norm's under tp)": ((6,), "1d", ("R",)),
    "hsdp": ((10, 6), "2d", ("R", "S0")),
    "experts over ep": ((5, 4, 6), "1d", ("S0",)),
    "experts over ep, their rows over fsdp": ((2, 8, 6), "2d", ("S0", "S1")),
    "experts' hidden over tp": ((2, 4, 6), "2d", ("R", "S2")),
    "two mesh dims cut one dim": ((8, 6), "2d", ("S0", "S0")),
    "two mesh dims, two tensor dims": ((8, 6), "2d", ("S0", "S1")),
}
STEPS = 5
LABELS = {"defaults": {}, "weight decay, maximize": {"weight_decay": 0.1, "maximize": True, "lr": 0.05},
          "device scalars": {"weight_decay": 0.1}}  # alpha and the denominator kept as tensors (a GPU's path)


def _placed(placements):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in placements]


def sharded_rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from kiln.train.optimizers import adafactor

    meshes = {"1d": init_device_mesh("cpu", (world,)),
              "2d": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))}
    gen = torch.Generator().manual_seed(0)
    starts = {n: torch.randn(shape, generator=gen) for n, (shape, _, _) in CASES.items()}
    grads = [{n: torch.randn(shape, generator=gen) for n, (shape, _, _) in CASES.items()} for _ in range(STEPS)]

    def run(sharded, **settings):
        params = {n: nn.Parameter(distribute_tensor(starts[n].clone(), meshes[m], _placed(pl)) if sharded
                                  else starts[n].clone()) for n, (_, m, pl) in CASES.items()}
        values = list(params.values())  # two param groups: their sums still share each phase's all_reduce
        opt = Adafactor([{"params": values[::2]}, {"params": values[1::2], "weight_decay": 0.0}], **settings)
        for step_grads in grads:
            for n, p in params.items():
                g = step_grads[n].clone()
                if sharded and "partial" in n:  # each rank a quarter: summed when redistributed
                    p.grad = DTensor.from_local(g / world, p.device_mesh, [Partial()])
                else:
                    p.grad = distribute_tensor(g, p.device_mesh, p.placements) if sharded else g
            opt.step()
        return params, opt

    calls, real = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    out = {}
    for label, settings in LABELS.items():
        ref, ref_opt = run(False, **settings)
        adafactor.dist.all_reduce, calls[:] = counting, []
        adafactor.HOST_SCALARS = () if label == "device scalars" else ("cpu",)
        try:
            got, opt = run(True, **settings)
        finally:
            adafactor.dist.all_reduce, adafactor.HOST_SCALARS = real, ("cpu",)
        differences, placements = {}, {}
        for n in CASES:
            state, ref_state = opt.state[got[n]], ref_opt.state[ref[n]]
            differences[n] = max([(got[n].full_tensor() - ref[n]).abs().max().item()]
                                 + [(state[k].full_tensor() - ref_state[k]).abs().max().item() / ref_state[k].abs().max().item()
                                    for k in ("row_var", "col_var", "variance") if k in state])
            placements[n] = {k: [f"{type(p).__name__}{getattr(p, 'dim', '')}" for p in state[k].placements]
                             for k in ("row_var", "col_var") if k in state}
        out[label] = {"differences": differences, "placements": placements, "all_reduces": len(calls)}
    out["fsdp x tp"] = fsdp_over_tp(meshes["2d"]) if torch_compat.fsdp_runs_on_cpu() else None
    return out


def fsdp_over_tp(mesh):
    """FSDP2 over tensor parallel's column- and row-parallel weights and a bias (`_StridedShard` x
    `Shard`, `Shard` x `Shard` of another dim): the largest difference to one process."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8, bias=False))
    plain = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt, ref = Adafactor(list(model.parameters()), weight_decay=0.1), Adafactor(plain, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(model.parameters(), plain):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = torch_compat.distribute_tensor(q.grad.clone(), p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        ref.step()
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), plain))


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_parameters_step_as_one_process(tmp_path):
    results = run_ranks(sharded_rank, 4, tmp_path, timeout=200)
    for rank, r in enumerate(results):
        for label in LABELS:
            for name, diff in r[label]["differences"].items():
                assert diff < 2e-6, f"rank {rank}, {label}, {name}: differs from one process by {diff}"
            # three phases a step, each one all_reduce per mesh dim's group (1d, 2d's dp and tp),
            # over both param groups
            assert r[label]["all_reduces"] == 3 * 3 * STEPS, r[label]["all_reduces"]
        placements = r["defaults"]["placements"]
        # a statistic whose size-1 dim a mesh dim cut is whole on that dim's ranks
        assert placements["rows (fsdp)"] == {"row_var": ["Shard0"], "col_var": ["Replicate"]}
        assert placements["columns (row-parallel tp)"] == {"row_var": ["Replicate"], "col_var": ["Shard1"]}
        assert placements["experts over ep, their rows over fsdp"] == {
            "row_var": ["Shard0", "Shard1"], "col_var": ["Shard0", "Replicate"]}
        if r["fsdp x tp"] is not None:
            assert r["fsdp x tp"] < 2e-6, f"rank {rank}: FSDP x tp differs by {r['fsdp x tp']}"

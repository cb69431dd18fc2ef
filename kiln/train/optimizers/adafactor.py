"""Adafactor (Shazeer & Stern 2018) as torch.optim.Adafactor defines it, for sharded parameters too.

torch's Adafactor cannot step DTensor parameters (its in-place norms over a sharded dimension meet
DTensor's partial placements), so kiln refused it under FSDP2, HSDP, tensor and expert parallel.
This is torch's algorithm, term by term, for a parameter w with gradient g at step t:

    rho = min(lr, 1/sqrt(t))    beta = t ** beta2_decay    alpha = max(eps2, RMS(w)) * rho
    w *= 1 - lr * weight_decay
    matrices (factored over the last two dims):
        R = lerp(R, mean over columns of g^2, beta)    C = lerp(C, mean over rows of g^2, beta)
        V = R C / max(mean over rows of R, eps1)
    vectors: V = lerp(V, g^2, beta)
    u = g / sqrt(max(V, eps1^2))    w -= alpha / max(1, RMS(u) / d) * u

It runs on each rank's local shard (a plain tensor is its own only shard). Only sums read across a
cut: the squared norms of w and u, the row and column sums of g^2 and the sum of R over rows. A
`Shard` (or FSDP-over-tp's `_StridedShard`) gives a rank whole rows or columns, so a per-row
statistic is local to the rank holding the row; each sum is summed over the mesh dimensions that
cut what it sums. A step has three such phases (before the second-moment update, the mean of R,
the update's norm); each phase is one `all_reduce` per (mesh dimension's process group, dtype),
every parameter group's sums in one flat buffer (kiln's own: DTensor would reduce tensor by tensor
and read every norm on the host). The updates wait for their norms in the gradients' storage, so
holding them all costs no memory. Tensors nothing cuts step one at a time, as in torch. Measured faster than torch's (0.56x its step in one
process on a CPU, benchmarks/README.md "Optimizer step"): both sums of g^2 come from one g^2 (torch
takes two norms; one over dim -2 is ~10x slower on a CPU), R C is a broadcast product (the same
products as torch's k=1 matmul), and the update is formed in the gradient's storage.

State has torch's names and global shapes (`row_var` (..., rows, 1), `col_var` (..., 1, cols),
`variance`, a CPU float32 `step`), so a checkpoint of torch's Adafactor resumes here; for a DTensor
parameter it is a DTensor cut like the parameter, replicated over the mesh dimensions that cut the
statistic's size-1 dimension, so DCP saves and reshards it like any other state. alpha and the
denominator stay device tensors off the CPU (torch reads both on the host per tensor; on a CPU
reading costs nothing, and kiln does too); the step count is read on the host, where it lives.
Non-finite steps keep the host check (kiln/train/step.py), as torch's Adafactor does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

# Device types whose alpha and denominator are read on the host (free there; a few tensor ops per
# parameter cost ~10% of a CPU step); elsewhere they stay device tensors
HOST_SCALARS = ("cpu",)


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                 maximize: bool = False):
        if not lr >= 0:
            raise ValueError(f"Adafactor: lr={lr} must be >= 0")
        if not beta2_decay <= 0:
            raise ValueError(f"Adafactor: beta2_decay={beta2_decay} must be <= 0")
        if (eps[0] is not None and not eps[0] >= 0) or not eps[1] >= 0:
            raise ValueError(f"Adafactor: eps={eps} must be (None or >= 0, >= 0)")
        if not d >= 1:
            raise ValueError(f"Adafactor: d={d} must be >= 1")
        if not weight_decay >= 0:
            raise ValueError(f"Adafactor: weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                                      weight_decay=weight_decay, maximize=maximize))

    def updates_elementwise(self, group: dict) -> bool:
        """No: row and column factors per matrix (ZeRO-1 keeps its tensors whole, kiln/parallel/zero1.py)."""
        return False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every group's tensors together: one all_reduce per phase and mesh dim, not per group
        _step([self._tensor(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None])
        return loss

    def _tensor(self, p: torch.Tensor, group: dict) -> _Tensor:
        if p.grad.is_sparse or torch.is_complex(p):
            raise RuntimeError("Adafactor: sparse gradients and complex parameters are not supported")
        grad = p.grad
        if isinstance(p, DTensor) and tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)  # e.g. a Partial one under tp
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if p.dim() > 1:
                state["row_var"] = _zeros_stat(p, p.dim() - 1)
                state["col_var"] = _zeros_stat(p, p.dim() - 2)
            else:
                state["variance"] = torch.zeros_like(p)
        w, g = _local(p), _local(grad)
        return _Tensor(p, w, -g if group["maximize"] else g, state, _cuts(p), group)


class _Tensor:
    """One parameter's local pieces: its shard, gradient shard, state, cuts ({mesh dim: tensor
    dim}, empty for a plain tensor) and param group."""

    def __init__(self, p, w, g, state, cuts, group):
        self.p, self.w, self.g, self.state, self.cuts, self.group = p, w, g, state, cuts, group
        self.mesh = p.device_mesh if isinstance(p, DTensor) else None
        # set by the step: rho, beta and eps1 (numbers); alpha (a number on the CPU, where reading
        # a tensor costs nothing, else a device tensor); the weight's squared norm, the row and
        # column sums of g^2 and the row statistic's sum (local, summed over the cuts)
        self.rho = self.beta = self.eps1 = 0.0
        self.alpha: float | torch.Tensor = 0.0
        self.w_sq = self.rows = self.cols = self.row_sum = None

    def over(self, *dims: int) -> list[int]:
        """The mesh dims cutting any of tensor `dims` (all of them when none are named)."""
        return [m for m, d in self.cuts.items() if not dims or d in dims]


def _step(tensors: list[_Tensor]) -> None:
    """Tensors no mesh dim cuts step one at a time, as torch's do (their gradient still in cache
    for the update); cut ones in the three phases, each phase's sums reduced together."""
    for t in tensors:
        if not t.cuts:
            _sums(t, _NO_SUMS)
            _second_moment(t, _NO_SUMS)
            update = _update(t)
            _apply(t, update, torch.linalg.vector_norm(update))
    cut = [t for t in tensors if t.cuts]
    sums = _Sums()
    for t in cut:
        _sums(t, sums)
    sums.reduce()
    for t in cut:
        _second_moment(t, sums)
    sums.reduce()
    held = []
    for t in cut:
        update = _update(t)
        held.append((t, update, sums.add(torch.linalg.vector_norm(update).square(), t)))
    sums.reduce()
    for t, update, u_sq in held:
        _apply(t, update, u_sq.sqrt())


def _sums(t: _Tensor, sums: _Sums) -> None:
    """Phase 1: the step count and factors, and the sums read before the second-moment update."""
    group = t.group
    t.state["step"] += 1
    step = float(t.state["step"])  # a CPU tensor, as in torch: no device sync
    t.rho, t.beta = min(float(group["lr"]), 1 / step**0.5), step ** group["beta2_decay"]
    t.eps1 = torch.finfo(t.w.dtype).eps if group["eps"][0] is None else group["eps"][0]
    t.w_sq = sums.add(torch.linalg.vector_norm(t.w).square(), t)
    if t.w.dim() > 1:
        last = t.w.dim() - 1
        # both sums from one g^2 (torch takes norms: over dim -2 that is ~10x slower on a CPU)
        squares = t.g * t.g
        t.rows = sums.add(squares.sum(dim=-1, keepdim=True), t, last)
        t.cols = sums.add(squares.sum(dim=-2, keepdim=True), t, last - 1)


def _second_moment(t: _Tensor, sums: _Sums) -> None:
    """Phase 2: alpha, weight decay, the second-moment update, and the row statistic's sum."""
    lr, wd, eps2 = float(t.group["lr"]), t.group["weight_decay"], t.group["eps"][1]
    if t.w.device.type in HOST_SCALARS:
        t.alpha = max(eps2, float(t.w_sq) ** 0.5 / t.p.numel() ** 0.5) * t.rho
    else:
        t.alpha = (t.w_sq.sqrt() / t.p.numel() ** 0.5).clamp_min_(eps2).mul_(t.rho)
    if wd != 0:
        t.w.mul_(1 - lr * wd)
    if t.w.dim() > 1:
        row_var, col_var = _local(t.state["row_var"]), _local(t.state["col_var"])
        row_var.lerp_(t.rows.div_(t.p.shape[-1]), t.beta)
        col_var.lerp_(t.cols.div_(t.p.shape[-2]), t.beta)
        t.row_sum = sums.add(row_var.sum(dim=-2, keepdim=True), t, t.w.dim() - 2)
    else:
        _local(t.state["variance"]).lerp_(t.g * t.g, t.beta)


def _update(t: _Tensor) -> torch.Tensor:
    """u = g / sqrt(max(V, eps1^2)) on the local shard, formed in the gradient's storage (the
    gradient is spent then): held updates cost no memory, where new ones cost fresh pages every step."""
    if t.w.dim() > 1:
        row_mean = t.row_sum.div_(t.p.shape[-2]).clamp_min_(t.eps1)
        var = _local(t.state["row_var"]) * _local(t.state["col_var"])  # torch's R @ C: the same products, faster
        var.div_(row_mean)
    else:
        var = _local(t.state["variance"]).clone()
    return t.g.mul_(var.clamp_(min=t.eps1 * t.eps1).rsqrt_())


def _apply(t: _Tensor, update: torch.Tensor, norm: torch.Tensor) -> None:
    d = t.group["d"]
    if isinstance(t.alpha, float):
        t.w.add_(update, alpha=-t.alpha / max(1.0, float(norm) / (t.p.numel() ** 0.5 * d)))
        return
    denom = (norm / (t.p.numel() ** 0.5 * d)).clamp_min_(1.0)
    t.w.addcmul_(update, t.alpha.neg() / denom)  # one pass, as add_(update, alpha=...) is


class _Sums:
    """Partial sums to be summed over mesh dimensions, all of one (process group, dtype) in one
    all_reduce: keyed by the mesh dim's group, which every mesh sliced alike shares (FSDP2's
    modules can hold distinct sub-mesh objects). Keys are met in parameter order, the same on
    every rank, so every rank issues the same collectives in the same order; a sum over two mesh
    dims is reduced over one, then the other."""

    def __init__(self):
        self.pending: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}

    def add(self, x: torch.Tensor, t: _Tensor, *dims: int) -> torch.Tensor:
        """`x`, summed in place over the mesh dims cutting tensor `dims` (all cuts if none) at `reduce`."""
        for mesh_dim in t.over(*dims):
            group = t.mesh.get_group(mesh_dim)
            self.pending.setdefault((id(group), x.dtype), (group, []))[1].append(x)
        return x

    def reduce(self) -> None:
        for group, xs in self.pending.values():
            flat = torch.cat([x.reshape(-1) for x in xs])
            dist.all_reduce(flat, group=group)
            for x, piece in zip(xs, flat.split([x.numel() for x in xs])):
                x.copy_(piece.view_as(x))
        self.pending.clear()


_NO_SUMS = _Sums()  # for uncut tensors: `add` finds no mesh dim, so nothing is ever pending


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _cut_dim(placement, ndim: int) -> int | None:
    """The tensor dim a placement cuts (`Shard`, or `_StridedShard`, which is no `Shard` subclass
    since torch 2.13), None for `Replicate`; anything else (a `Partial` parameter) is refused."""
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, Shard) or hasattr(placement, "split_factor"):
        return placement.dim % ndim
    raise RuntimeError(f"Adafactor: a parameter placed {placement} (expected Shard or Replicate)")


def _cuts(p: torch.Tensor) -> dict[int, int]:
    if not isinstance(p, DTensor):
        return {}
    cuts = {m: _cut_dim(pl, p.dim()) for m, pl in enumerate(p.placements) if p.device_mesh.size(m) > 1}
    return {m: d for m, d in cuts.items() if d is not None}


def _zeros_stat(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Zeros shaped like `p` with `dim` of size 1; for a DTensor, cut like `p` except where a mesh
    dim cut `dim` (replicated there: every rank of it holds the whole statistic)."""
    if not isinstance(p, DTensor):
        shape = list(p.shape)
        shape[dim] = 1
        return p.new_zeros(shape)
    local = list(p.to_local().shape)
    local[dim] = 1
    shape = list(p.shape)
    shape[dim] = 1
    placements = [Replicate() if _cut_dim(pl, p.dim()) == dim else pl for pl in p.placements]
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(p.to_local().new_zeros(local), p.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))

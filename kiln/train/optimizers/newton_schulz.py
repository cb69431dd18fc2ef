"""Muon's quintic Newton-Schulz iteration: the nearest semi-orthogonal matrix to an update, on one
rank (kiln/train/optimizers/muon_split.py deals the matrices of a sharded model out to their ranks;
kiln/train/optimizers/muon.py is the optimizer). The coefficients and step count are the Muon
authors', as torch.optim.Muon's."""

from __future__ import annotations

import torch

# Quintic coefficients chosen (by the Muon authors) to push all singular values of a
# unit-spectral-norm matrix into roughly [0.7, 1.2] within five steps, as fast as possible.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of the SVD U S V^T of a 2-D (or batched, last two dims) matrix."""
    a, b, c = NS_COEFFICIENTS
    # bf16 matmuls are the point on GPUs; on CPUs without AMX, bf16 matmul is far slower than
    # fp32 (8x for a 384x1024 Gram matrix on our 2-core x86 test box), so keep fp32 there.
    work_dtype = torch.bfloat16 if update.device.type == "cuda" else torch.float32
    x = update.to(work_dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        x = x.mT
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1].
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def orthogonalize_matrix(update: torch.Tensor, stacked: bool = False) -> torch.Tensor:
    """`orthogonalize` of one local weight-shaped tensor: a stack per expert, or one matrix (conv
    kernels flattened to (out, in*k*k))."""
    if stacked:
        return orthogonalize(update)
    return orthogonalize(update.reshape(update.size(0), -1)).view_as(update)

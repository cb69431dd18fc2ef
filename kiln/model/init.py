"""Weight-initialization schemes, selected by `model.init`.

- `normal`: every matrix and embedding ~ N(0, init_std), biases 0, norm gains 1 (GPT-1/BERT).
- `gpt2`: `normal`, but the projections that write into the residual stream (attention.wo,
  feed_forward.w2) use init_std / sqrt(2 * n_layers), so the residual's variance does not grow
  with depth (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", sec. 2.3).
- `ds_init`: depth-scaled init: Xavier-uniform matrices in layer l (1-based) scaled by 1/sqrt(l)
  (Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with Depth-Scaled Initialization and
  Merged Attention", eq. 8 with alpha = 1).
- `t_fixup`: for training without norms and without warmup: Xavier-uniform matrices, embeddings
  ~ N(0, dim^-1/2); then the value/output projections, the MLP and the embeddings are scaled by
  (9 N)^-1/4 for N decoder layers (Huang et al. 2020, "Improving Transformer Optimization Through
  Better Initialization", sec. 3.3). Pair it with `model.norm = "none"`.

Mixture-of-experts layers (kiln/model/moe.py): the router like a block matrix (std or Xavier), and
each expert's w1/w3/w2 exactly as the dense FeedForward's in the same scheme, expert by expert.
All experts are drawn in order, then this rank's slice is kept, so expert parallelism starts from
the single-process weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln import torch_compat
from kiln.model.moe import MoE


def _fill(t: torch.Tensor, fill, gen: torch.Generator | None = None) -> None:
    """Apply `fill` to t; a sharded (DTensor) t is filled as the full tensor, then re-sharded.

    So every parallel layout starts from bit-identical weights to the single-device run, which is
    what makes parallel == single-process testable (one full parameter in memory at a time).
    """
    if t.is_meta:  # a module another pipeline rank owns: draw (and drop) its values, so the
        # generator advances as in one process (kiln/parallel/pipeline.py)
        fill(torch.empty(t.shape, dtype=t.dtype, device=gen.device if gen is not None else "cpu"))
    elif isinstance(t, DTensor):
        full = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        fill(full)
        t.copy_(torch_compat.distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None))
    else:
        fill(t)


def _normal(t: torch.Tensor, std: float, gen) -> None:
    _fill(t, lambda x: nn.init.normal_(x, mean=0.0, std=std, generator=gen), gen)


def _xavier(t: torch.Tensor, gain: float, gen) -> None:
    _fill(t, lambda x: nn.init.xavier_uniform_(x, gain=gain, generator=gen), gen)


def _reset_norms_and_biases(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.reset_parameters()
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def _experts(t: torch.Tensor | None, experts, fill) -> None:
    """Fill all `experts.n_experts` expert matrices in order (one fill per expert), keep the local slice."""
    if t is None:
        return
    device = t.to_local().device if isinstance(t, DTensor) else t.device
    full = torch.empty((experts.n_experts, *t.shape[1:]), dtype=t.dtype, device=device)
    for e in range(experts.n_experts):
        fill(full[e])
    if t.is_meta:  # another pipeline rank's layer: only its draws count
        return
    # A DTensor has the global shape (FSDP- or expert-sharded): filled whole, then resharded.
    mine = full if isinstance(t, DTensor) else full[experts.first:experts.first + experts.n_local]
    _fill(t, lambda x: x.copy_(mine))


def _init_moe(ffn, matrix_fill, residual_fill, shared=None) -> None:
    """The router and experts; the block's shared experts (if any) like a dense MLP, their gate
    like the router."""
    matrix_fill(ffn.router.weight)
    if ffn.expert_bias is not None and not ffn.expert_bias.is_meta:  # balancing starts from no bias
        _fill(ffn.expert_bias, torch.Tensor.zero_)
    ex = ffn.experts
    _experts(ex.w1, ex, matrix_fill)
    _experts(ex.w3, ex, matrix_fill)
    _experts(ex.w2, ex, residual_fill)
    if shared is not None:
        for lin in (shared.ffn.w1, shared.ffn.w3, shared.gate):
            if lin is not None:
                matrix_fill(lin.weight)
        residual_fill(shared.ffn.w2.weight)


def init_model(model: nn.Module, generator: torch.Generator | None = None) -> None:
    cfg = model.cfg
    scheme, std = cfg.init, cfg.init_std
    _reset_norms_and_biases(model)
    n_layers = cfg.n_layers
    head_tied = cfg.tie_embeddings

    if scheme in ("normal", "gpt2"):
        _normal(model.tok_embeddings.weight, std, generator)
        if model.pos_embeddings is not None:
            _normal(model.pos_embeddings.weight, std, generator)
        residual_std = std / math.sqrt(2 * n_layers) if scheme == "gpt2" else std
        for layer in model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            for lin in (attn.wq, attn.wk, attn.wv):
                _normal(lin.weight, std, generator)
            if isinstance(ffn, MoE):
                _init_moe(ffn, lambda t: _normal(t, std, generator), lambda t: _normal(t, residual_std, generator),
                          layer.shared_experts)
            else:
                for lin in (ffn.w1, ffn.w3):
                    if lin is not None:
                        _normal(lin.weight, std, generator)
            _normal(attn.wo.weight, residual_std, generator)
            if not isinstance(ffn, MoE):
                _normal(ffn.w2.weight, residual_std, generator)
        if not head_tied:
            _normal(model.output.weight, std, generator)
        return

    if scheme == "ds_init":
        _normal(model.tok_embeddings.weight, std, generator)
        if model.pos_embeddings is not None:
            _normal(model.pos_embeddings.weight, std, generator)
        for i, layer in enumerate(model.layers):
            gain = 1.0 / math.sqrt(i + 1)
            for lin in _block_linears(layer):
                _xavier(lin.weight, gain, generator)
            if isinstance(layer.feed_forward, MoE):
                xav = lambda t: _xavier(t, gain, generator)  # noqa: E731
                _init_moe(layer.feed_forward, xav, xav, layer.shared_experts)
        if not head_tied:
            _xavier(model.output.weight, 1.0, generator)
        return

    if scheme == "t_fixup":
        scale = (9 * n_layers) ** -0.25
        emb_std = cfg.dim ** -0.5
        _normal(model.tok_embeddings.weight, emb_std * scale, generator)
        if model.pos_embeddings is not None:
            _normal(model.pos_embeddings.weight, emb_std * scale, generator)
        for layer in model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            _xavier(attn.wq.weight, 1.0, generator)
            _xavier(attn.wk.weight, 1.0, generator)
            for lin in (attn.wv, attn.wo) if isinstance(ffn, MoE) else (attn.wv, attn.wo, ffn.w1, ffn.w2, ffn.w3):
                if lin is not None:
                    _xavier(lin.weight, scale, generator)
            if isinstance(ffn, MoE):
                xav = lambda t: _xavier(t, scale, generator)  # noqa: E731
                _init_moe(ffn, xav, xav, layer.shared_experts)
        if not head_tied:
            _xavier(model.output.weight, 1.0, generator)
        return

    raise ValueError(f"unknown init scheme {scheme!r}")


def _block_linears(layer: nn.Module) -> list[nn.Linear]:
    """The block's nn.Linear matrices (an MoE FFN's router and experts are initialized by _init_moe)."""
    attn, ffn = layer.attention, layer.feed_forward
    ffn_linears = () if isinstance(ffn, MoE) else (ffn.w1, ffn.w2, ffn.w3)
    return [lin for lin in (attn.wq, attn.wk, attn.wv, attn.wo, *ffn_linears) if lin is not None]

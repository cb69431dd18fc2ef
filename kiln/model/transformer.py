"""A decoder-only transformer whose options cover GPT-2 and Llama-style models.

Built on the meta device first (no memory), parallelized, then materialized with `init_weights`
(see kiln/model/init.py): the seam that lets TP/FSDP attach without rewriting the model and lets
a 7B config be counted on a laptop. Module names follow torchtitan's Llama (tok_embeddings,
layers.N.attention.wq, feed_forward.w1, norm, output) so parallel plans read the same.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config import ModelConfig
from kiln.model import loss as _loss
from kiln.model.loss import lm_loss  # noqa: F401  (re-exported: the reference loss)
from kiln.model.moe import MoE


def ffn_hidden_size(cfg: ModelConfig) -> int:
    if cfg.ffn_hidden:
        return cfg.ffn_hidden
    hidden = 4 * cfg.dim
    if cfg.activation in ("swiglu", "geglu"):  # keep parameters equal to the 4*dim GeLU MLP
        hidden = int(2 * hidden / 3)
        hidden = cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)
    return hidden


def expert_hidden_size(cfg: ModelConfig) -> int:
    """An MoE expert's hidden width: model.moe_hidden, or the dense FFN's when that is 0."""
    return cfg.moe_hidden or ffn_hidden_size(cfg)


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.Identity()


def rope_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies, (head_dim // 2,) in fp32 (Su et al. 2021, RoFormer), with
    `model.rope_scaling` applied for a context longer than the one pretrained at:
    - "linear" (position interpolation, Chen et al. 2023): every frequency / factor;
    - "llama3" (Llama 3.1): wavelengths longer than original_len / low_freq_factor / factor,
      shorter than original_len / high_freq_factor unchanged, a linear blend in between;
    - "yarn" (YaRN, Peng et al. 2023, "NTK-by-parts"): frequencies turning fewer than beta_slow
      times over original_len / factor, more than beta_fast times unchanged, a linear ramp over
      the (whole) dimensions in between; `rope_attention_scale` then scales cos and sin.
    The same arithmetic as transformers' rope init functions of those names, so imported Llama 3.x
    and YaRN-extended checkpoints give transformers' logits (tests/interop)."""
    head_dim = cfg.attention_head_dim()
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "llama3":
        low, high, original = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    if cfg.rope_scaling == "yarn":
        original, theta = cfg.rope_original_max_seq_len, cfg.rope_theta

        def dimension(turns: float) -> float:  # the dimension that turns `turns` times over original
            return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(dimension(cfg.rope_yarn_beta_fast)), 0)
        high = min(math.ceil(dimension(cfg.rope_yarn_beta_slow)), head_dim - 1)
        ramp = (torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / (high - low or 0.001)
        kept = 1 - ramp.clamp(0, 1)  # 1: the frequency as trained, 0: interpolated
        return inv_freq / factor * (1 - kept) + inv_freq * kept
    return inv_freq


def rope_attention_scale(cfg: ModelConfig) -> float:
    """YaRN's factor on cos and sin (so on q.k twice): rope_attention_factor, or 0.1 ln(factor) + 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_scaling_factor) + 1.0 if cfg.rope_scaling_factor > 1 else 1.0


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (model.max_seq_len, head_dim // 2), computed in fp32."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32),
                         rope_frequencies(cfg, device))
    scale = rope_attention_scale(cfg)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by position; halves layout (first D/2 paired with last D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def document_mask(doc_ids: torch.Tensor, window: int = 0):
    """Block-diagonal causal attention mask of packed windows: query i sees key j <= i of the same
    document (and, with `window`, i - j < window). `doc_ids` (B, T) numbers each token's document,
    non-decreasing along T.

    CUDA with FlexAttention (torch.nn.attention.flex_attention): a BlockMask, which skips the
    fully masked tiles; otherwise a dense boolean (B, 1, T, T) mask for SDPA's `attn_mask`.
    """
    bsz, seqlen = doc_ids.shape
    if doc_ids.is_cuda and _flex() is not None:
        create_block_mask = _flex()[1]

        def same_doc_causal(b, h, q_idx, kv_idx):
            allowed = (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
            return allowed & (q_idx - kv_idx < window) if window else allowed

        return create_block_mask(same_doc_causal, bsz, None, seqlen, seqlen, device=doc_ids.device)
    positions = torch.arange(seqlen, device=doc_ids.device)
    causal = window_mask(positions, seqlen, window or seqlen)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def layer_masks(windows: list[int], doc_ids: torch.Tensor | None, ring: bool) -> list:
    """The attention mask (Attention.forward's `mask`) of each layer, by its window
    (`attention_window`): None without packed documents; with them (`doc_ids` (B, T), data.windows
    = "packed_masked") `document_mask` for the layer's window, one per window in use; under context
    parallel (`ring`) the ids themselves, from which ring attention masks each pair of chunks
    (kiln/parallel/ring_attention.py)."""
    if doc_ids is None or ring:
        return [doc_ids] * len(windows)
    masks = {w: document_mask(doc_ids, w) for w in set(windows)}
    return [masks[w] for w in windows]


def attention_window(cfg: ModelConfig, layer_id: int) -> int:
    """The sliding window of layer `layer_id`'s attention, 0 where it attends to the whole past
    (model.sliding_window off, or a layer model.full_attention_every keeps global)."""
    every = cfg.full_attention_every
    return 0 if not cfg.sliding_window or (every and layer_id % every == every - 1) else cfg.sliding_window


def window_mask(q_positions: torch.Tensor, k_len: int, window: int) -> torch.Tensor:
    """Causal sliding-window mask (Tq, Tk), True where query position p may attend to key
    position j (keys are positions 0..k_len-1): j <= p and p - j < window."""
    keys = torch.arange(k_len, device=q_positions.device)
    behind = q_positions[:, None] - keys[None, :]
    return (behind >= 0) & (behind < window)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             dropout_p: float = 0.0, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over the `window` most recent of k/v (B, Hkv, T, D),
    in O(T x window) time and memory: the sequence in blocks of `window` queries, each against its
    own and the previous block's keys under one (window, 2 x window) mask; the first block is plain
    causal attention. Hand-written on SDPA: a dense (T, T) mask costs T^2 floats per layer saved
    for backward (SDPA keeps its mask) and T^2 work. benchmarks/sliding_window.py (CPU, fp32, 8
    heads of 64, forward + backward): T = 8192, window 1024: 72 / 320 MiB saved, 0.84 / 3.52 s
    against the dense mask; T = 1024, window 256, batch 2: 16 / 12 MiB, 0.028 / 0.052 s."""
    bsz, heads, seqlen, dim = q.shape
    w = window
    first = F.scaled_dot_product_attention(q[:, :, :w], k[:, :, :w], v[:, :, :w], is_causal=True,
                                           dropout_p=dropout_p, enable_gqa=enable_gqa)
    if seqlen <= w:
        return first
    n = -(-seqlen // w)
    pad = n * w - seqlen
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    # blocks 1..n-1 as a batch of (B x (n-1)) 4-D attentions (SDPA's fused kernels take 4-D only):
    # queries (w of them), keys and values of the previous and own block (2w)
    qb = q[:, :, w:].reshape(bsz, heads, n - 1, w, dim).transpose(1, 2).reshape(-1, heads, w, dim)
    kb, vb = (t.unfold(2, 2 * w, w).permute(0, 2, 1, 4, 3).reshape(-1, t.shape[1], 2 * w, dim) for t in (k, v))
    offsets = torch.arange(2 * w, device=q.device)
    behind = offsets[w:, None] - offsets[None, :]  # query i of the block (position w + i) to key j
    rest = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=(behind >= 0) & (behind < w),
                                          dropout_p=dropout_p, enable_gqa=enable_gqa)
    rest = rest.view(bsz, n - 1, heads, w, dim).transpose(1, 2).reshape(bsz, heads, (n - 1) * w, dim)
    return torch.cat([first, rest], dim=2)[:, :, :seqlen]


def _flex():
    """(flex_attention compiled, create_block_mask), or None where this torch lacks them."""
    global _FLEX
    if _FLEX is False:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            # uncompiled, flex_attention materializes the scores; compiled it is a fused kernel
            _FLEX = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except ImportError:
            _FLEX = None
    return _FLEX


_FLEX = False  # not looked up yet


def fusable(*linears: nn.Linear) -> bool:
    """Whether `fused_linear` may stand in for calling these modules one by one: each is exactly
    `nn.Linear` (a subclass such as torchao's Float8Linear has its own matmul, so the check is by
    type), carries no module hooks (tensor parallel's input/output layouts live there) and holds
    plain-tensor weights (tensor parallel keeps DTensor shards; FSDP2 swaps in plain unsharded
    tensors for the forward, so it fuses); biases all present or all absent."""
    for m in linears:
        if type(m) is not nn.Linear or isinstance(m.weight, DTensor):
            return False
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            return False
    return len({m.bias is None for m in linears}) == 1


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs of several Linears that read the same input, as ONE `F.linear` over their
    weights concatenated on the output dim (nanoGPT's c_attn, with separate parameters), split
    back. Autograd then runs one input-gradient and one weight-gradient GEMM instead of one each
    per module, and `torch.cat`'s backward hands every parameter its slice of the weight gradient.
    Without autocast the concatenated weight is a copy that backward keeps (autocast's low-precision
    cast of each weight is kept in the unfused path too); under FSDP2 it outlives the reshard
    after forward. All torch ops (cat, linear, split); only the choice of which Linears is ours."""
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return F.linear(x, weight, bias).split([m.weight.shape[0] for m in linears], dim=-1)


class KVCache:
    """Keys/values of every layer for incremental decoding, preallocated: max_len positions, or for
    a sliding-window layer (`windows[layer]` > 0: `attention_window`) only its window, a rolling
    buffer where position p lives in slot p % window (Mistral's rolling cache): a decoded token
    attends to every slot filled, which are exactly the positions its window reaches. Keys are
    cached after RoPE, so their order in the buffer does not matter."""

    def __init__(self, windows: list[int], batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device, dtype):
        lengths = [min(w, max_len) if w else max_len for w in windows]
        self.k = [torch.zeros((batch, n_kv_heads, n, head_dim), device=device, dtype=dtype) for n in lengths]
        self.v = [torch.zeros((batch, n_kv_heads, n, head_dim), device=device, dtype=dtype) for n in lengths]
        self.max_len = max_len

    def rolls(self, layer: int) -> bool:
        return self.k[layer].shape[2] < self.max_len

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store the keys/values of positions start.. and return those the new queries attend to:
        the whole prefix cached so far; for a rolling layer's prefill (start 0) the prefill's own
        (the buffer keeps its last window), and when decoding every filled slot."""
        end = start + k.shape[2]
        if not self.rolls(layer):
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        window = self.k[layer].shape[2]
        kept = min(k.shape[2], window)
        slots = torch.arange(end - kept, end, device=k.device) % window
        self.k[layer][:, :, slots] = k[:, :, -kept:]
        self.v[layer][:, :, slots] = v[:, :, -kept:]
        if start == 0:
            return k, v
        return self.k[layer][:, :, :min(end, window)], self.v[layer][:, :, :min(end, window)]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, window: int = 0,
                     mask=None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of whole sequences q (B, H, T, D) over k/v (B, Hkv, T, D): with `mask`
    (`document_mask` of packed windows, the layer's window in it) SDPA or FlexAttention under it;
    else over the `window` most recent keys where the window is shorter than T
    (`sliding_window_attention`), else SDPA's causal kernel. Attention.forward's path without a KV
    cache, and Ulysses context parallel's on each rank's heads (kiln/parallel/ulysses.py)."""
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa)
        return _flex()[0](q, k, v, block_mask=mask, enable_gqa=enable_gqa)  # a BlockMask (CUDA); no dropout
    if window and q.shape[2] > window:  # keys beyond the window exist
        return sliding_window_attention(q, k, v, window, dropout_p, enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.attention_head_dim()
        self.dropout = cfg.dropout
        self.use_rope = cfg.positions == "rope"
        self.window = attention_window(cfg, layer_id)  # 0: the whole causal past
        # Repeat K/V heads before attention instead of SDPA's enable_gqa, where that is what lets
        # the flash/cuDNN kernel run (decided at startup by kiln/train/attention.py).
        self.expand_kv = False
        # Replaces SDPA (causal, no cache) when set: context parallel's ring attention
        # (kiln/parallel/context_parallel.py), only for the duration of a training step.
        self.attention_fn = None
        # q, k, v in one GEMM where fusable(...); `auto` is resolved by the trainer's build_model and
        # means separate GEMMs elsewhere (evaluation, export: the same function either way)
        self.fused_projections = cfg.fused_projections is True
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, start_pos: int = 0, mask=None) -> torch.Tensor:
        """`mask`: None (causal), or `document_mask(...)` of packed windows (training only)."""
        bsz, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        if self.fused_projections and fusable(self.wq, self.wk, self.wv):
            q, k, v = fused_linear(x, (self.wq, self.wk, self.wv))
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # (B, H, T, D): under tensor parallel H is this rank's heads
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:
            k, v = cache.update(self.layer_id, start_pos, k, v)
            causal = seqlen > 1  # a single new token attends to everything cached
            if causal and start_pos:
                raise ValueError("prefill with a non-empty cache is not supported; decode one token at a time")
        # not before context parallel's exchanges: they move n_kv_heads K/V (and expand after them)
        if self.expand_kv and q.shape[1] != k.shape[1] and self.attention_fn is None:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # from the config, not the shapes: compiled with dynamic shapes those compare to a SymBool,
        # which torch 2.11's SDPA refuses for enable_gqa (tp divides both head counts alike)
        gqa = self.n_heads != self.n_kv_heads and not self.expand_kv
        dropout_p = self.dropout if self.training else 0.0
        if self.attention_fn is not None:  # context parallel's (`mask`: Transformer.forward's)
            out = self.attention_fn(q, k, v, dropout_p, self.window, mask)
        elif cache is None or start_pos == 0 and causal and mask is None:  # whole sequences from 0
            out = causal_attention(q, k, v, dropout_p, self.window, mask, gqa)
        elif mask is not None:
            raise ValueError("a document mask works without a KV cache")
        elif self.window and start_pos + seqlen > self.window:
            # decoding: the cache's rolling buffer holds this token's window exactly
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int = 0, bias: bool | None = None):
        super().__init__()
        hidden = hidden or ffn_hidden_size(cfg)
        bias = cfg.bias if bias is None else bias
        self.gated = cfg.activation in ("swiglu", "geglu")
        self.act = {"swiglu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}.get(cfg.activation, F.gelu)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=bias)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=bias) if self.gated else None
        self.fused_projections = cfg.fused_projections is True  # w1 and w3 in one GEMM, as in Attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(self.act(self.w1(x)))
        # GLU variants (Shazeer 2020): act(x W1) * (x W3)
        if self.fused_projections and fusable(self.w1, self.w3):
            gate, up = fused_linear(x, (self.w1, self.w3))
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.act(gate) * up)


class SharedExperts(nn.Module):
    """The always-active experts of an MoE block (model.moe_shared_experts): one bias-free MLP of
    moe_shared_experts x the expert width (DeepSeekMoE's shared experts, hidden units concatenated),
    optionally scaled per token by sigmoid(gate(x)) (Qwen2-MoE). A sibling of the block's MoE, so
    tensor parallelism shards it as a dense MLP (kiln/parallel/tensor_parallel.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ffn = FeedForward(cfg, cfg.moe_shared_experts * expert_hidden_size(cfg), bias=False)
        self.gate = nn.Linear(cfg.dim, 1, bias=False) if cfg.moe_shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ffn(x)
        return out if self.gate is None else out * torch.sigmoid(self.gate(x))


def uses_moe(cfg: ModelConfig, layer_id: int) -> bool:
    """Block `layer_id` has a mixture-of-experts FFN: model.moe_experts > 0, every moe_every-th block."""
    return cfg.moe_experts > 0 and layer_id % cfg.moe_every == cfg.moe_every - 1


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attention = Attention(cfg, layer_id)
        self.feed_forward = MoE(cfg, expert_hidden_size(cfg)) if uses_moe(cfg, layer_id) else FeedForward(cfg)
        self.shared_experts = SharedExperts(cfg) if uses_moe(cfg, layer_id) and cfg.moe_shared_experts else None
        self.attention_norm = build_norm(cfg)
        self.ffn_norm = build_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None, cache=None, start_pos=0, mask=None):
        # The mask by keyword: tensor parallel's PrepareModuleInput plans the attention's
        # positional inputs (x, rope, cache, start_pos) one by one and passes keywords through.
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.attention_norm(x), rope, cache, start_pos, mask=mask))
            return x + self.dropout(self._ffn(self.ffn_norm(x)))
        x = self.attention_norm(x + self.dropout(self.attention(x, rope, cache, start_pos, mask=mask)))
        return self.ffn_norm(x + self.dropout(self._ffn(x)))

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        out = self.feed_forward(h)
        return out if self.shared_experts is None else out + self.shared_experts(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer) before building")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        # Post-norm blocks end in a norm already; pre-norm needs a final one.
        self.norm = build_norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # forward(tokens, targets) returns the loss; "chunked" never forms full fp32 logits
        # (kiln/model/loss.py; vocab-parallel under tensor parallelism); "parallel" is the full loss
        # on vocab-sharded logits under tensor parallelism (kiln/parallel/tensor_parallel.py). Set by
        # the trainer from train.loss.
        self.loss_impl = "full"
        # Global positions of the tokens this rank holds, when they are not 0..seqlen-1 (context
        # parallel's zig-zag slices; set around a training step by kiln/parallel/context_parallel.py).
        self.seq_positions: torch.Tensor | None = None
        # Under context parallel, what packed documents' layers get as `mask`: the ids themselves
        # (ring attention masks each pair of chunks from them), or, set by Ulysses (which attends
        # to whole sequences), the whole sequences' `document_mask`s as without cp.
        self.cp_whole_masks = False
        # MoE: (load-balancing loss, z-loss) summed over MoE layers in the last forward with
        # targets, a detached device tensor read at metrics-fetch time (no host sync per step).
        self.moe_losses: torch.Tensor | None = None
        # MoE: (layers, E) assignments of the last forward with targets (train_step sums them over
        # the micro-batches for kiln/model/moe.py balance_experts), the ranks to sum them over (set
        # by the trainer: data parallel), and the step's largest relative load (what is logged).
        self.moe_loads: torch.Tensor | None = None
        self.moe_load_group = None
        self.moe_max_load: torch.Tensor | None = None
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        # to_empty allocates each module's parameters separately, which unties shared weights.
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return self

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Materialized weights -> the configured init scheme; also recomputes the RoPE tables."""
        from kiln.model.init import init_model

        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        init_model(self, generator)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0, doc_ids: torch.Tensor | None = None, aux_losses: bool = True) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the mean next-token loss when `targets` is given, so that
        a whole-model compile covers the LM head and the loss too (MoE's auxiliary losses added
        unless `aux_losses` is False: evaluation's loss is the language-modelling loss alone).

        `doc_ids` (batch, seq): packed windows (data.windows = "packed_masked"); attention stays
        within each document (under context parallel: the whole sequences' ids, the tokens
        sliced). Positions stay global within the window: with RoPE a document's outputs equal
        running it alone (scores depend on relative positions only); learned absolute positions
        see the offset of the document inside the window."""
        seqlen = tokens.shape[1]
        if start_pos + seqlen > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start_pos + seqlen} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        positions = self.seq_positions
        if self.pos_embeddings is not None:
            if positions is None:
                positions = torch.arange(start_pos, start_pos + seqlen, device=tokens.device)
            h = h + self.pos_embeddings(positions)
        h = self.dropout(h)
        if self.seq_positions is not None:
            rope = (self.rope_cos[self.seq_positions], self.rope_sin[self.seq_positions])
        else:
            rope = (self.rope_cos[start_pos:start_pos + seqlen], self.rope_sin[start_pos:start_pos + seqlen])
        windows = [attention_window(self.cfg, i) for i in range(len(self.layers))]
        masks = layer_masks(windows, doc_ids, ring=self.seq_positions is not None and not self.cp_whole_masks)
        for layer, mask in zip(self.layers, masks):
            h = layer(h, rope, cache, start_pos, mask)
        h = self.norm(h)
        if self.loss_impl == "chunked" and targets is not None:
            if isinstance(self.output.weight, DTensor):  # tensor parallel: the head sharded on the vocabulary
                from kiln.parallel.functional import parallel_chunked_lm_loss

                loss = parallel_chunked_lm_loss(h, self.output.weight, targets)
            else:
                loss = _loss.chunked_lm_loss(h, self.output.weight, targets)
        else:
            logits = self.output(h)
            if isinstance(logits, DTensor):  # tensor parallel: logits sharded on the vocabulary
                if targets is None:
                    return logits.full_tensor()
                from kiln.parallel.functional import parallel_lm_loss

                loss = parallel_lm_loss(logits, targets)
            elif targets is None:
                return logits
            else:
                loss = _loss.lm_loss(logits, targets)
        moes = [m for m in self.modules() if isinstance(m, MoE)] if aux_losses else []
        if moes:  # Switch/ST-MoE: the weighted auxiliary losses, summed over layers, join the loss
            aux = torch.stack([m.last_aux_loss for m in moes]).sum()
            z = torch.stack([m.last_z_loss for m in moes]).sum()
            self.moe_losses = torch.stack([aux, z]).detach()
            self.moe_loads = torch.stack([m.last_load for m in moes])  # assignments per layer and expert
            loss = loss + self.cfg.moe_aux_loss_weight * aux + self.cfg.moe_z_loss_weight * z
        return loss

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, rows: int,
                  doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Evaluation's mean next-token loss over the first `rows` rows (the rest pad a rank's
        share: kiln/data/loader.py rank_batches), through the training step's loss path
        (`loss_impl`: chunked, or vocab-parallel under tp), so evaluation never forms the full fp32
        logits where training does not (kiln.eval.scoring.score_batches calls it); no MoE
        auxiliary losses. `doc_ids`: packed documents, masked as in training."""
        if rows < targets.shape[0]:
            targets = targets.clone()
            targets[rows:] = _loss.IGNORE_INDEX
        return self(tokens, targets, doc_ids=doc_ids, aux_losses=False)

    def new_cache(self, batch: int, max_len: int | None = None, dtype=None) -> KVCache:
        cfg = self.cfg
        return KVCache([attention_window(cfg, i) for i in range(cfg.n_layers)], batch, cfg.n_kv_heads or cfg.n_heads,
                       max_len or cfg.max_seq_len, cfg.attention_head_dim(), self.tok_embeddings.weight.device,
                       dtype or self.tok_embeddings.weight.dtype)


def count_params(model: nn.Module) -> dict[str, int]:
    """Unique parameters (tied weights once); also works on the meta device."""
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen[id(p)] = p
    total = sum(p.numel() for p in seen.values())
    emb = model.tok_embeddings.weight.numel()
    if getattr(model, "pos_embeddings", None) is not None:
        emb += model.pos_embeddings.weight.numel()
    # Active: what one token uses; an MoE layer's token passes through top_k of its experts.
    # (Under expert parallelism the module holds only the local experts: counts are per rank.)
    idle = sum((m.experts.n_local - m.top_k) * m.experts.params_per_expert()
               for m in model.modules() if isinstance(m, MoE))
    return {"total": total, "non_embedding": total - emb, "embedding": emb, "active": total - max(idle, 0)}


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (parameters used in matmuls, LM head included) plus attention.

    Attention scores and the weighted sum cost 2 * 2 * seq_len * d_attn per layer per token forward,
    x3 for forward + backward: 12 * L * seq_len * d_attn (Chowdhery et al. 2022, PaLM, appendix B),
    d_attn = n_heads * head_dim (= dim unless model.head_dim sets it); a sliding-window layer
    counts min(window, seq_len) keys per token instead of seq_len.
    The embedding lookup is a gather, not a matmul, so it does not count.
    An MoE layer counts its router and the top_k experts a token is routed to (active parameters,
    Switch Transformer sec. 2); capacity drops and padding are not subtracted.
    """
    cfg = model.cfg
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    matmul_params += sum(m.top_k * m.experts.params_per_expert() for m in model.modules() if isinstance(m, MoE))
    keys = sum(min(attention_window(cfg, i) or seq_len, seq_len) for i in range(cfg.n_layers))
    return 6.0 * matmul_params + 12.0 * keys * cfg.n_heads * cfg.attention_head_dim()

"""The one training-memory model: bytes per rank for a kiln model x layout x precision x activation
checkpointing x micro-batch x sequence length. `kiln train`'s refusal (kiln/train/memory.py) and
`kiln plan` both call `rank_memory`.

Closed form (no module is built). Terms, per rank:
- parameters: fp32 master weights (kiln keeps fp32 params and autocasts), split by tp*pp and, for
  zero2/fsdp/hsdp (all FSDP2 in kiln), by dp_shard; under pp the first and the last stage's ranks
  are each counted (`rank_params`: embedding on the first, head on the last, for tied embeddings
  the last stage's own copy) and the fuller kept; MoE experts split over ep x tp (etp = tp) or
  over ep alone (etp = 1: ep borrows the tp ranks, experts whole), then FSDP over "edp";
- gradients: fp32, split like parameters;
- optimizer state: bytes per parameter by optimizer, split by dp for zero2/fsdp; zero1 the fullest
  rank's partition over dp x cp (`zero1_fullest_share`: even, or whole tensors largest first);
- activations kept for backward, per layer and token (counted tensor by tensor for kiln's
  pre-norm block: two fp32 norm inputs, normed inputs (under autocast one cast per linear that
  reads them: q, k, v, w1, w3), q/k/v, attention output and its contiguous (b, s, h*d) copy (the
  output projection's input), and the MLP's 2 (gelu) or 4 (gated) hidden-sized tensors; an MoE
  block's per top-k expert and shared expert, with its routing and dispatch,
  `mlp_bytes_per_token`; SDPA/flash keeps no s x s matrix), times the
  micro-batches a pipeline schedule keeps in flight (gpipe: all; 1f1b: pp; interleaved:
  pp*(1 + (pp-1)/(pp*v)), Korthikanti et al. 2022 sec. 4.2.3; the zero-bubble schedules, which hold
  activations until the weight pass: pp, `in_flight_microbatches`), split by tp (sequence
  parallel; but the two normed block inputs, all-gathered for the column-parallel linears, are
  saved whole: `gathered_bytes_per_token`) and cp (each rank keeps its 1/cp of the sequence); activation checkpointing keeps
  only block inputs for the recomputed blocks plus one block's activations during recompute;
  "op" checkpointing keeps each block's input and its matmul and attention outputs
  (`op_kept_bytes_per_token`, all split by tp, the gathered inputs included);
  Compiled (`Layout.compiled`, torch.compile of the whole model): what AOTAutograd's min-cut
  partitioner (inductor's decompositions) saves, measured on CPU by
  tests/plan/test_compiled_saved.py (the partition is made before any device code): per block
  and token the two fp32 norm inputs (layernorm: the fp32 normalized input instead, same size)
  and their low-precision normed copies, q/k (after RoPE) and v, SDPA's output (with RoPE
  also its contiguous (b, s, h*d) copy, the output projection's input: without RoPE the
  partitioner recomputes that copy), SDPA's fp32 logsumexp per head, and the MLP's matmul
  outputs plus the activation's product (gated: w1 and w3 outputs and act*w3; plain: w1 output and act);
  under checkpoint_wrapper only each block's fp32 input; float8 (torchao tensorwise on the blocks'
  linears) the partitioner recomputes the normed inputs, act*w3 and every weight cast from their
  fp32 sources and the saved scales, and keeps q/k/v, SDPA's output, the MLP matmul outputs and a
  float8 (1 byte) transposed copy of the output projection's input;
- temporary: the eager loss's fp32 logits-sized tensors at its backward (`eager_loss_logits`: 3,
  5 under loss parallel; 2 of one chunk for chunked);
  compiled: the loss is fused, the graph saves the low-precision logits (with per-token max and
  log-sum-exp) and backward writes their gradient into the same buffer (AOTAutograd's donated
  buffers), so one low-precision logits tensor;
  under autocast (bf16/fp16, not FSDP2, whose parameters are cast by its mixed precision) the
  low-precision weight copies of every matmul weight: eager keeps them (autocast caches the casts
  of leaf tensors until its region ends and the matmuls save them for backward), and so does the
  compiled graph (the partitioner saves the casts as backward inputs) except a checkpointed
  block's and, under float8, every block's (recomputed); the LM head's always;
  the gathered parameters of a block (x2: prefetch) and of the FSDP root (head, final norm; kept
  gathered from forward into backward: `fsdp_end_units`), or all gathered parameters but an
  untied embedding's (resharded after its forward) for zero2 (reshard_after_forward=False) and
  for fsdp under pp (torch's stage keeps a unit gathered from its backward until a forward
  reshards it, so the whole stage is gathered at the end of a backward), and all for fsdp under
  a zero-bubble pipeline (kept gathered until backward: `resharded_after_forward`);
- communication buffers: DDP's buckets in flight (2 x 25 MiB: the gradients themselves are views
  into its buckets, kiln's `gradient_as_bucket_view`; a bf16 reduce_dtype's cast copies), FSDP's
  reduce-scatter buffer.

Eager runs take the larger of two phases (`_eager_peak_phase`): the loss's backward (saved
activations and the loss's tensors, no gradients yet with grad_accum 1) and the blocks' backward
(all gradients, under checkpointing the block being recomputed; an upper bound there). Compiled
runs take the larger of two phases, the peak
torch.cuda.max_memory_allocated sees: the end of forward (saved activations and the logits; no
gradients yet with grad_accum 1, since kiln zeroes gradients to None) and the end of backward
(all gradients, one block's weight casts; under checkpointing the first block's input and its
recomputed activations), since backward frees each block's activations as its gradients appear.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from kiln.config import JobConfig, ModelConfig
from kiln.parallel.pipeline_layout import V_SHAPED, ZERO_BUBBLE, stage_layer_ranges, stages_of_rank
from kiln.parallel.zero1_partition import partition

# Optimizer state in bytes per fp32 parameter: two moments for adamw/lamb (muon: AdamW's two for
# its non-matrix part, one momentum for matrices: `muon_matrix_fraction`; two where only the name
# is known), one for lion and sgd. torch's Adafactor keeps factored row/column statistics,
# negligible next to the weights.
OPTIM_STATE_BYTES = {"adamw": 8, "lamb": 8, "muon": 8, "lion": 4, "sgd": 4, "adafactor": 0}
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "float8": 2}
DDP_BUCKET_BYTES = 25 * 2**20
LOSS_CHUNK_TOKENS = 1024  # kiln/model/loss.py chunked_lm_loss works on chunks of about this many tokens
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class Layout:
    """One parallel layout and step shape. dp_mode is ddp | zero1 | zero2 | fsdp (fsdp with
    dp_replicate > 1 is HSDP); ac is none | full | selective | op | every_k:K."""
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = -1  # expert tensor parallel degree: -1 = tp (experts sharded over tp too), 1 = whole experts
    ep_node_ranks: int = 0  # parallel.ep_node_ranks: ep ranks per node of a two-level exchange; 0: one level
    dp_mode: str = "ddp"
    micro_batch: int = 1
    grad_accum: int = 1
    ac: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    precision: str = "bf16"
    loss: str = "full"
    compiled: bool = False  # torch.compile of the whole model (activations saved, see the docstring)
    # q/k/v and w1/w3 as one GEMM each (model.fused_projections; `auto` on CUDA without FSDP sharding,
    # kiln/train/system.py): under autocast the normed input is cast once per GEMM, not per linear
    fused_projections: bool = False
    # Context parallel's ring blocks on torch's fused CPU flash kernel (kiln/parallel/ring_blocks.py
    # fused_kernel: CPU without attention dropout); else the matmul kernel's (chunk x chunk) fp32
    # score tensors per head while a block runs (`ring_block_bytes`)
    fused_ring_blocks: bool = False
    # parallel.cp_mode under cp > 1: "ring" (K/V round the ring) or "ulysses" (all-to-alls around a
    # local attention of whole sequences for n_heads / (tp x cp) heads, kiln/parallel/ulysses.py)
    cp_mode: str = "ring"
    # parallel.ulysses_degree under cp_mode ulysses: the cp ranks its all-to-alls span (0: all of
    # cp); fewer, and the ring runs across the cp / degree groups (`ulysses_ranks`, `ring_ranks`)
    ulysses_degree: int = 0
    # parallel.ulysses_rounds: Ulysses' heads in this many rounds, each round's all-to-all in flight
    # while the round before attends (forward); timing.py hides them behind attention
    ulysses_rounds: int = 1
    # DiLoCo (kiln/plan/diloco.py): inner steps H between outer syncs; the replicas are dp_replicate
    # (under ddp every data-parallel rank), which then never reduce gradients with each other.
    diloco_inner_steps: int = 0
    # Streaming DiLoCo (parallel.diloco_fragments, diloco_sync_delay, diloco_comm_dtype): P fragments,
    # one synced every H / P steps; each exchange under `diloco_sync_delay` inner steps; bytes per
    # element of the outer gradient on the wire (4 fp32, 2 bf16)
    diloco_fragments: int = 1
    diloco_sync_delay: int = 0
    diloco_wire_bytes: int = 4
    # parallel.reduce_dtype: bytes per element of the data-parallel gradient reductions (4 fp32, 2 bf16)
    grad_wire_bytes: int = 4
    # parallel.fsdp_reshard_to (fsdp): the shard ranks a block's parameters stay sharded over from
    # forward to backward (ZeRO++'s hpZ; backward gathers over those only); 0: all of them
    fsdp_reshard_to: int = 0

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def ulysses_ranks(self) -> int:
        """The cp ranks Ulysses exchanges heads over: 1 under the ring."""
        return 1 if self.cp_mode == "ring" else self.ulysses_degree or self.cp

    @property
    def ring_ranks(self) -> int:
        """The ranks ring attention runs over: cp, cp / ulysses_degree, or 1 (Ulysses alone)."""
        return self.cp // self.ulysses_ranks

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replica(self) -> "Layout":
        """One DiLoCo replica of this layout: the same split on dp_shard x tp x pp x cp (x ep), no
        replicas, no outer loop (itself without DiLoCo); kiln/plan/diloco.py costs it."""
        if not self.diloco_inner_steps:
            return self
        return dataclasses.replace(self, dp_replicate=1, diloco_inner_steps=0, diloco_fragments=1,
                                   diloco_sync_delay=0, diloco_wire_bytes=4)

    @property
    def ep_borrows_tp(self) -> bool:
        """parallel.etp=1 with ep > 1 and tp > 1 (kiln/parallel/dims.py `ParallelDims.ep_borrows_tp`):
        the ep group spans the tp ranks, each routes its own sequence shard to whole experts."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def expert_tp(self) -> int:
        """The degree each expert's hidden units are sharded over: tp, or 1 when ep borrows tp."""
        return 1 if self.ep_borrows_tp else self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts ("edp", kiln/parallel/dims.py _build_expert_mesh): the data
        parallel x cp ranks of a stage (x tp when ep borrows tp) over ep."""
        return max(1, self.dp * self.cp * (self.tp if self.ep_borrows_tp else 1) // self.ep)

    def describe(self) -> str:
        parts = [f"dp={self.dp_replicate}x{self.dp_shard}({self.dp_mode})"]
        if self.diloco_inner_steps:
            parts = [f"diloco={self.dp_replicate}x{self.dp_shard}({self.dp_mode}) H={self.diloco_inner_steps}"]
            parts += [f"{name}={value}" for name, value, default in (
                ("fragments", self.diloco_fragments, 1), ("sync_delay", self.diloco_sync_delay, 0),
                ("wire_bytes", self.diloco_wire_bytes, 4)) if value != default]
        parts += [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.cp > 1 and self.cp_mode != "ring":
            parts.append(f"cp_mode={self.cp_mode}")
            if 1 < self.ring_ranks:
                parts.append(f"ulysses_degree={self.ulysses_ranks}")
            if self.ulysses_rounds > 1:
                parts.append(f"ulysses_rounds={self.ulysses_rounds}")
        if self.ep_borrows_tp:
            parts.append("etp=1")
        if 1 < self.ep_node_ranks < self.ep:
            parts.append(f"ep_node_ranks={self.ep_node_ranks}")
        if self.fsdp_reshard_to:
            parts.append(f"reshard_to={self.fsdp_reshard_to}")
        if self.grad_wire_bytes != 4:
            parts.append(f"grad_wire_bytes={self.grad_wire_bytes}")
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts += [f"mb={self.micro_batch}", f"ga={self.grad_accum}", f"ac={self.ac}"]
        return " ".join(parts)


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    kv_dim: int
    ffn: int
    gated: bool
    vocab: int
    tied: bool
    learned_positions_len: int = 0
    moe_experts: int = 0  # MoE blocks (kiln/model/moe.py): E bias-free experts + a router per block
    moe_layers: int = 0
    moe_every: int = 1  # model.moe_every: block i is an MoE block when i % moe_every == moe_every - 1
    moe_top_k: int = 1  # experts each token is routed to
    expert_ffn: int = 0  # an expert's hidden width (model.moe_hidden); 0: ffn
    shared_ffn: int = 0  # an MoE block's shared experts' hidden width (a dense, bias-free MLP beside them)
    shared_gate: bool = False  # and their per-token gate (dim x 1, replicated over tp)
    moe_sigmoid: bool = False  # model.moe_router = "sigmoid"
    moe_groups: int = 1  # model.moe_groups (group-limited routing) and model.moe_topk_groups
    moe_topk_groups: int = 1
    rope: bool = True  # RoPE: the compiled graph saves SDPA's output and its contiguous copy (docstring)
    q_dim: int = 0  # n_heads * head_dim: q's and attention's output width; 0: dim
    norm_params: int = 1  # per norm: 1 x dim (RMSNorm, bias-free LayerNorm), 2 (LayerNorm + bias), 0 (none)
    bias: bool = False  # model.bias: every linear but the head has a bias
    qkv_bias: bool = False  # q, k and v have biases (model.qkv_bias, or model.bias)
    qk_norm: bool = False  # a head_dim gain each for q and k per block (model.qk_norm)
    window: int = 0  # model.sliding_window: keys a token of a local layer attends to at most
    local_layers: int = 0  # layers with that window (model.full_attention_every keeps the others global)

    def __post_init__(self):
        if not self.q_dim:
            object.__setattr__(self, "q_dim", self.dim)

    @classmethod
    def from_config(cls, m: ModelConfig, vocab: int) -> "ModelShape":
        from kiln.model.transformer import attention_window, ffn_hidden_size

        head = m.attention_head_dim()
        return cls(dim=m.dim, q_dim=m.n_heads * head, n_layers=m.n_layers, n_heads=m.n_heads, kv_dim=(m.n_kv_heads or m.n_heads) * head,
                   ffn=ffn_hidden_size(m), gated=m.activation in ("swiglu", "geglu"), vocab=vocab,
                   tied=m.tie_embeddings, learned_positions_len=m.max_seq_len if m.positions == "learned" else 0,
                   moe_experts=m.moe_experts, moe_layers=m.n_layers // m.moe_every if m.moe_experts else 0,
                   moe_every=m.moe_every,
                   moe_top_k=m.moe_top_k, expert_ffn=m.moe_hidden if m.moe_experts else 0,
                   shared_ffn=m.moe_shared_experts * (m.moe_hidden or ffn_hidden_size(m)) if m.moe_experts else 0,
                   shared_gate=bool(m.moe_experts and m.moe_shared_gate), moe_sigmoid=m.moe_router == "sigmoid",
                   moe_groups=m.moe_groups, moe_topk_groups=m.moe_topk_groups, rope=m.positions == "rope",
                   norm_params=0 if m.norm == "none" else 2 if m.norm == "layernorm" and m.bias else 1,
                   bias=m.bias, qkv_bias=m.bias or m.qkv_bias, qk_norm=m.qk_norm, window=m.sliding_window,
                   local_layers=sum(1 for i in range(m.n_layers) if attention_window(m, i)))

    def is_moe_block(self, i: int) -> bool:
        """Whether block i (from 0) is an MoE block (kiln/model/transformer.py)."""
        return self.moe_layers > 0 and i % self.moe_every == self.moe_every - 1

    def attention_keys(self, seq_len: int) -> int:
        """Keys a token attends to, summed over the layers (the attention FLOPs are 12 x q_dim x
        this per token, as kiln/model/transformer.py flops_per_token counts them): seq_len per
        global layer, min(window, seq_len) per sliding-window layer."""
        local = min(self.window, seq_len) if self.window else seq_len
        return (self.n_layers - self.local_layers) * seq_len + self.local_layers * local

    @property
    def layer_params(self) -> int:
        """One dense block's parameters."""
        attn = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim
        sharded_biases = (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + self.mlp_biases[0]
        return attn + self.ffn_params + sharded_biases + self.replicated_layer_params

    @property
    def replicated_layer_params(self) -> int:
        """What tensor parallel leaves whole in a dense block (kiln/parallel/tensor_parallel.py):
        the two norms, the QK-norm gains and the row-wise linears' (wo, w2) output biases."""
        qk = 2 * (self.q_dim // self.n_heads) if self.qk_norm else 0
        return 2 * self.dim * self.norm_params + qk + (2 * self.dim if self.bias else 0)

    @property
    def mlp_biases(self) -> tuple[int, int]:
        """A dense MLP's biases (sharded over tp, replicated): w1 (and w3)'s and w2's; MoE experts have none."""
        return ((2 if self.gated else 1) * self.ffn, self.dim) if self.bias else (0, 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim * (1 if self.tied else 2) + self.learned_positions_len * self.dim

    @property
    def params(self) -> int:
        """Parameters of kiln's Transformer (tied embeddings once) - equals count_params(model)."""
        # an MoE block's experts, router and shared experts instead of a dense MLP (and its biases)
        moe = self.moe_layers * (self.moe_experts * (self.expert_ffn_params + self.dim) - self.ffn_params
                                 - sum(self.mlp_biases) + self.shared_params)
        return self.embedding_params + self.n_layers * self.layer_params + self.dim * self.norm_params + moe

    @property
    def ffn_params(self) -> int:
        """One MLP's (one expert's) matrices."""
        return (3 if self.gated else 2) * self.dim * self.ffn

    @property
    def shared_params(self) -> int:
        """One MoE block's shared experts: their MLP's matrices and gate."""
        return (3 if self.gated else 2) * self.dim * self.shared_ffn + (self.dim if self.shared_gate else 0)

    @property
    def expert_ffn_params(self) -> int:
        """One expert's matrices (model.moe_hidden wide, or ffn)."""
        return (3 if self.gated else 2) * self.dim * (self.expert_ffn or self.ffn)

    @property
    def expert_params(self) -> int:
        """All experts of all MoE blocks (the rest of a MoE block, its router included, is dense)."""
        return self.moe_layers * self.moe_experts * self.expert_ffn_params

    @property
    def active_params(self) -> int:
        """Parameters a token's forward multiplies by: top-k of each MoE block's experts."""
        return self.params - self.moe_layers * (self.moe_experts - self.moe_top_k) * self.expert_ffn_params

    def param_tensors(self, pp: int = 1) -> int:
        """Parameter tensors of the fullest pipeline stage: q, k, v, o, the MLP's 2 or 3 matrices,
        their biases, 2 norms (and their biases) and the QK-norm gains per block, plus the
        embedding, the final norm and an untied head."""
        matrices = 3 if self.gated else 2
        block = 4 + matrices + 2 * self.norm_params + 2 * self.qk_norm
        block += 4 + matrices if self.bias else 3 * self.qkv_bias
        final_norm = self.norm_params
        return (-(-self.n_layers // pp) * block + 1 + final_norm + (0 if self.tied else 1)
                + (1 if self.learned_positions_len else 0))

    def gathered_bytes_per_token(self, act: int, compiled: bool = False, float8: bool = False) -> float:
        """Of `act_bytes_per_token`, what tensor parallelism does not divide: the normed inputs of
        attention and the MLP, which sequence parallelism all-gathers and DTensor's linears then
        save whole (Megatron keeps them sharded and gathers again in backward; kiln does under "op"
        checkpointing, `op_kept_bytes_per_token`).
        Measured by tests/plan/test_tp_activations.py. Compiled with float8 the normed inputs are
        recomputed (not saved), so nothing."""
        return 0.0 if compiled and float8 else 2 * act * self.dim

    def op_kept_bytes_per_token(self, act: int, compiled: bool = False) -> float:
        """What `train.activation_checkpointing = "op"` keeps of a block per token besides its fp32
        input (kiln/parallel/parallelize.py keep_compute_op_outputs): q/k/v, SDPA's output and
        fp32 logsumexp, the output projection's and the MLP's matmul outputs (under tp: the
        reduce-scatter outputs of the row-parallel ones), all divided by tp. Compiled, the
        partitioner drops the MLP's last matmul output (nothing in backward reads it). Measured
        exactly: eager at fp32 and bf16, tp 1, 2 and 4 (tests/plan/test_op_checkpoint_memory.py);
        compiled whole model, bf16 (tests/plan/test_compiled_saved.py). float8 keeps the same bf16
        matmul outputs (not measured)."""
        mlp = (2 if self.gated else 1) * self.ffn
        last = 0 if compiled else self.dim
        return act * ((self.q_dim + 2 * self.kv_dim) + self.q_dim + self.dim + mlp + last) + 4 * self.n_heads

    def window_bytes_per_token(self, act: int, seq_len: int) -> float:
        """What sliding-window layers (kiln/model/transformer.py sliding_window_attention) save
        beyond a plain block, per token averaged over all blocks: the query blocks after the first
        copied into a batch of 4-D attentions, each block's keys and values twice (its own and the
        next block's), that attention's fp32 logsumexp; (1 - window / seq_len) of the tokens are in
        those blocks. Measured on CPU (eager, fp32, GQA 4/2 heads of 16): 724, 736 and 640 bytes
        per token and local layer at (seq, window) = (256, 16), (1024, 64), (256, 64) against 735,
        735 and 588 here. None under cp (the ring) or with a window at least the sequence."""
        if not self.local_layers or self.window >= seq_len:
            return 0.0
        blocked = 1 - self.window / seq_len
        per_layer = (act * (self.q_dim + 4 * self.kv_dim) + 4 * self.n_heads) * blocked
        return per_layer * self.local_layers / self.n_layers

    def act_bytes_per_token(self, act: int, compiled: bool = False, float8: bool = False,
                            fused: bool = False) -> float:
        """Bytes one block keeps for backward per token, averaged over the blocks (see the module
        docstring; an MoE block's MLP: `mlp_bytes_per_token`; `fused`: Layout.fused_projections)."""
        kept = 2 * self.dim * 4  # the two norm inputs: the fp32 residual stream
        stats = 4 * self.n_heads + 2 * 8  # SDPA's fp32 logsumexp; each norm's fp32 mean/rstd
        if compiled and float8:  # normed inputs and act*w3 recomputed; a float8 copy of o-proj's input
            mlp = self.mlp_bytes_per_token(act, 2 if self.gated else 1)
            return kept + act * ((self.q_dim + 2 * self.kv_dim) + self.q_dim) + mlp + self.q_dim + stats
        if compiled:  # normed copies, q/k/v, SDPA out (+ contiguous copy), the MLP's saved tensors
            mlp = self.mlp_bytes_per_token(act, 3 if self.gated else 2)
            attn_out = (2 if self.rope else 1) * self.q_dim
            return kept + act * (2 * self.dim + (self.q_dim + 2 * self.kv_dim) + attn_out) + mlp + stats
        # normed (under autocast one cast per q, k and v projection: autocast caches only the
        # weights' casts, each linear casts its input itself), q/k/v, SDPA's output and its
        # contiguous (b, s, h*d) copy that the output projection saves; the MLP with its input
        kept += act * ((1 if act == 4 or fused else 3) * self.dim + (self.q_dim + 2 * self.kv_dim) + 2 * self.q_dim)
        if fused:  # v is a view of the one q/k/v GEMM output: its q and k parts stay alive with it
            kept += act * (self.q_dim + self.kv_dim)
        return kept + self.mlp_bytes_per_token(act, 4 if self.gated else 2, inputs=True, fused=fused)

    @property
    def moe_share(self) -> float:
        """The share of the blocks that are MoE blocks (model.moe_every)."""
        return self.moe_layers / self.n_layers if self.moe_experts else 0.0

    def mlp_bytes_per_token(self, act: int, per_unit: int, inputs: bool = False, fused: bool = False) -> float:
        """What the blocks' MLPs keep per token, averaged over the blocks: `per_unit` tensors per
        hidden unit a token passes through (a dense block's ffn; an MoE block's top-k experts'
        widths and its shared experts'), an MoE block's routing and dispatch
        (`moe_dispatch_bytes_per_token`), and with `inputs` (eager) the normed input as the MLP's
        matmuls save it: once in fp32; under autocast once per matmul that casts it (w1, w3; one
        GEMM with `fused` projections), and in an MoE block the router's fp32 copy (the experts
        take the dispatched rows) plus the shared experts' and their gate's casts. A top-2 MoE
        block of full-width experts keeps over twice a dense MLP's activations, which the planner
        took an MoE block's for before (measured eager, tests/plan/test_moe_activations.py;
        compiled, the same dispatch count is an upper bound within 15%:
        tests/plan/test_compiled_saved.py)."""
        low = act < 4  # autocast: each linear casts its input
        matmuls_in = (2 if self.gated and not fused else 1) if low else 1
        dense = act * per_unit * self.ffn + (act * self.dim * matmuls_in if inputs else 0)
        if not self.moe_experts:
            return dense
        moe = act * per_unit * (self.moe_top_k * (self.expert_ffn or self.ffn) + self.shared_ffn)
        moe += self.moe_dispatch_bytes_per_token(act)
        if inputs:
            moe += 4 * self.dim  # the router's fp32 input (in fp32 the normed input itself)
            if low:
                moe += act * self.dim * ((matmuls_in if self.shared_ffn else 0) + self.shared_gate)
        return (1 - self.moe_share) * dense + self.moe_share * moe

    def moe_dispatch_bytes_per_token(self, act: int) -> float:
        """Besides the experts' hidden units, what one MoE block (kiln/model/moe.py, eager) keeps per
        token it routes: 2 k rows (the experts' input, gathered and zeroed where dropped, and
        their outputs that the gates multiply; the gated sum is an accumulating index_put, which
        keeps only its indices), each assignment's sort position and token index (int64),
        kept flag, gate (fp32, and cast), top-k index (int64); the router's fp32 logits and scores
        (E each), the gates' and the balancing loss's per-token sums and the z-loss's logsumexp
        (fp32; a sigmoid router's score sum too); group-limited routing's top-2 per group, best
        groups (int64) and group mask; with a shared-experts gate their output and the gate.
        Counted tensor by tensor against what autograd saves (tests/plan/test_moe_activations.py).
        Under tp with the experts sharded over it (etp = tp) every tp rank routes the whole
        gathered sequence, so this is per token of the sequence, not of the rank's shard
        (`rank_memory`). Dropped assignments keep their rows (fixed shapes)."""
        k, e, g = self.moe_top_k, self.moe_experts, self.moe_groups
        out = act * 2 * k * self.dim + k * (2 * 8 + 1 + act + 4 + 8) + 2 * 4 * e + 2 * 4 + 4 * self.moe_sigmoid
        if g > 1:
            out += 8 * g * min(2, e // g) + 8 * self.moe_topk_groups + g
        if self.shared_gate:
            out += act * self.dim + 2 * act
        return out


def vocab_estimate(cfg: JobConfig) -> tuple[int, str]:
    """The vocabulary the model will get, and the key that sets it (model.vocab_size = 0 takes the
    tokenizer's; a tokenizer.json path is unknown before it is read, so it counts as 0)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    return {"bpe": cfg.data.vocab_size, "byte": 257}.get(cfg.data.tokenizer, 0), "data.vocab_size"


@dataclass
class MemoryBreakdown:
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    temporary: float = 0.0
    comm_buffers: float = 0.0
    outer_state: float = 0.0  # DiLoCo's anchor and outer momentum (kiln/plan/diloco.py)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.temporary
                + self.comm_buffers + self.outer_state)

    def as_dict(self) -> dict[str, float]:
        keys = ("parameters", "gradients", "optimizer", "activations", "temporary", "comm_buffers")
        return {k: getattr(self, k) for k in keys + (("outer_state",) if self.outer_state else ()) + ("total",)}


def in_flight_microbatches(layout: Layout) -> float:
    """Micro-batches whose activations the fullest pipeline rank holds at its peak, in whole-stage
    micro-batches (a chunk of a rank's v stages counts 1/v): gpipe m; 1f1b p; interleaved 1F1B
    p(1 + (p-1)/(p v)) (torch's warm-up of (v-1)p + 2(p-1-r) forwards on rank r). The zero-bubble
    schedules hold a micro-batch's activations until its weight pass, not its input pass (torch's
    split backward keeps the graph for the weight gradients), and still peak at p: torch's ZB1P
    warms up with one forward per hop, (v-1)p + (p-1-r), and delays rank r's weight passes by r;
    its ZBV runs 2p chunk forwards before the first weight pass on the last rank; DualPipeV holds
    one chunk more, 2p + 1 (DeepSeek-V3's "PP + 1"; counted from torch's action lists in
    tests/plan/test_pipeline_schedules.py). At most m."""
    if layout.pp == 1:
        return 1.0
    m, p = layout.grad_accum, layout.pp
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "dualpipev":
        return min(m, p + 0.5)
    if layout.schedule == "interleaved_1f1b" and layout.virtual_stages > 1:
        return min(m, p * (1 + (p - 1) / (p * layout.virtual_stages)))
    return float(min(m, p))


def resharded_after_forward(layout: Layout) -> bool:
    """Whether FSDP (dp_mode fsdp) frees its gathered parameters after forward: not under a
    zero-bubble pipeline, where kiln keeps them gathered until backward (kiln/parallel/pipeline.py
    keep_gathered_until_backward: torch's split weight pass needs the gathered parameters)."""
    return layout.dp_mode == "fsdp" and not (layout.pp > 1 and layout.schedule in ZERO_BUBBLE)


def recomputed_blocks(ac: str, n_layers: int) -> int:
    """How many of `n_layers` blocks activation checkpointing recomputes ("op": every block, its
    cheap ops only; `recomputed_matmul_blocks`)."""
    if ac == "none":
        return 0
    if ac in ("full", "op"):
        return n_layers
    if ac == "selective":
        return (n_layers + 1) // 2  # blocks 0, 2, 4, ... (parallelize.apply_activation_checkpointing)
    if ac.startswith("every_k:"):
        k = int(ac.split(":", 1)[1])
        return (n_layers + k - 1) // k
    raise ValueError(f"unknown activation checkpointing {ac!r}")


def recomputed_matmul_blocks(ac: str, n_layers: int) -> int:
    """How many blocks run their matmuls again in backward: none under "op", which keeps every
    matmul's output (kiln/parallel/parallelize.py keep_compute_op_outputs)."""
    return 0 if ac == "op" else recomputed_blocks(ac, n_layers)


def rank_chunks(shape: ModelShape, layout: Layout, last: bool = False) -> list[range]:
    """The blocks of each stage chunk on the pipeline's first (or, `last`, last) rank, in kiln's
    split (pipeline_layout.py stage_layer_ranges: earlier stages take the remainder; stages_of_rank:
    looped, or a V). pp = 1: one chunk, the whole model."""
    if layout.pp == 1:
        return [range(shape.n_layers)]
    virtual = 2 if layout.schedule in V_SHAPED else layout.virtual_stages
    ranges = stage_layer_ranges(shape.n_layers, layout.pp * virtual, [])
    return [ranges[s] for s in stages_of_rank(layout.schedule, layout.pp, virtual, layout.pp - 1 if last else 0)]


def stage_contents(shape: ModelShape, layout: Layout, last: bool = False) -> tuple[int, bool, bool, bool]:
    """(blocks, embedding, head, final norm) of one rank of the pipeline's first (or, `last`, last)
    stage; head is a tensor of its own (an untied head, or under pp a tied model's copy of the
    embedding). pp = 1: the whole model. pp > 1: the blocks of the rank's chunks (`rank_chunks`),
    the first rank the embedding, the last the final norm and the head, which for tied
    embeddings is the last stage's own copy of the embedding (kiln/parallel/pipeline_tied.py,
    Megatron-LM's): weight, gradient and optimizer state on both ends. A V (ZBV, DualPipeV) puts
    the first and the last stage on rank 0 (both ends there; `last` is then a middle rank)."""
    blocks = sum(len(chunk) for chunk in rank_chunks(shape, layout, last))
    zbv = layout.pp > 1 and layout.schedule in V_SHAPED
    if layout.pp == 1:
        return blocks, True, not shape.tied, True
    if not last:
        return blocks, True, zbv, zbv
    return blocks, False, not zbv, not zbv


def rank_params(shape: ModelShape, layout: Layout, last: bool = False) -> tuple[float, float, int]:
    """(dense, expert, blocks) of one rank of the pipeline's first (or, `last`, last) stage
    (`stage_contents`) before any data-parallel sharding: dense matrices and embeddings split over
    tp, the norms and MoE routers replicated (tensor_parallel.py), each MoE block's experts over ep x
    `expert_tp` (1 when ep borrows tp: whole experts)."""
    blocks, embedding, head, norm = stage_contents(shape, layout, last)
    ends = (shape.vocab * shape.dim + shape.learned_positions_len * shape.dim if embedding else 0) + \
        (shape.vocab * shape.dim if head else 0)
    moe_blocks = blocks * shape.moe_layers / shape.n_layers
    whole = shape.replicated_layer_params  # a block's norms, QK-norm gains and row-wise biases
    mlp_sharded_bias, mlp_whole_bias = shape.mlp_biases
    # a MoE block's MLP is its (bias-free) experts, plus a router of E x dim, plus shared experts (a
    # dense MLP sharded over tp; their gate replicated)
    gate = shape.dim if shape.shared_gate else 0
    sharded = (blocks * (shape.layer_params - whole) - moe_blocks * (shape.ffn_params + mlp_sharded_bias)
               + moe_blocks * (shape.shared_params - gate) + ends)
    replicated = (blocks * whole + moe_blocks * (shape.moe_experts * shape.dim - mlp_whole_bias + gate)
                  + (shape.dim * shape.norm_params if norm else 0))
    dense = sharded / layout.tp + replicated
    experts = moe_blocks * shape.moe_experts * shape.expert_ffn_params / (layout.ep * layout.expert_tp)
    return dense, experts, blocks


def fsdp_end_units(shape: ModelShape, layout: Layout, last: bool = False) -> tuple[float, float]:
    """(own embedding, root): the dense parameters (split over tp) of the two FSDP units outside the
    blocks on that rank (kiln/parallel/parallelize.py apply_fsdp), 0 where it has none. The token
    (and learned position) embeddings are a unit of their own, gathered for their forward only,
    unless the head shares their weight (tied, pp = 1); the root holds the final norm and the head
    (a tied embedding too) and stays gathered from forward through backward."""
    blocks, embedding, head, norm = stage_contents(shape, layout, last)
    embedding_params = (shape.vocab + shape.learned_positions_len) * shape.dim / layout.tp if embedding else 0.0
    own = not (shape.tied and layout.pp == 1)
    root = (shape.vocab * shape.dim / layout.tp if head else 0.0) + (shape.dim * shape.norm_params if norm else 0.0)
    return (embedding_params, root) if own else (0.0, root + embedding_params)


# What kiln's ZeRO-1 cuts into runs (kiln/parallel/zero1.py `cuts_elementwise`): every tensor where
# the update is elementwise, Muon's AdamW tensors (embeddings, head, norms), nothing for LAMB and
# Adafactor, whose updates read whole tensors.
ZERO1_CUTS = {"adamw": "all", "lion": "all", "sgd": "all", "muon": "adamw_groups"}


def zero1_fullest_share(shape: ModelShape, layout: Layout, last: bool = False, optimizer: str = "adamw") -> float:
    """The fullest rank's share of a stage rank's dense parameters under ZeRO-1 (its optimizer
    state, and the part of the step it runs), over the data-parallel x cp ranks (data_parallel.py
    grad_mesh), by kiln's partition (kiln/parallel/zero1_partition.py `partition`): the tensors whose update
    reads them whole (`ZERO1_CUTS`) go first, largest first, each to the rank holding the fewest
    elements so far; the rest are cut to fill the ranks to one level. So with AdamW, Lion or SGD
    each rank holds 1/n; with LAMB a large tensor can leave one rank above it (at 64 ranks
    configs/llama-7b.toml's 32000 x 4096 embedding alone is 1.24 x a rank's even share). Tensors
    are the local ones (tp's shards; norms and MoE routers replicated over tp). MoE experts are in
    the partition (each block's stacked w1/w2/w3) only without ep; parallel.ep's are stepped on
    every rank (data_parallel.py Zero1Optimizer). The share is of the dense parameters, plus the
    experts when ep = 1. benchmarks/zero1_partition.py and tests/plan/test_zero1_partition.py
    check it against the real partition."""
    ranks = layout.dp * layout.cp
    if ranks == 1:
        return 1.0
    return _zero1_share(shape, layout.tp, stage_contents(shape, layout, last), ranks, layout.ep == 1,
                        ZERO1_CUTS.get(optimizer, "none"))


@functools.lru_cache(maxsize=4096)
def _zero1_share(shape: ModelShape, tp: int, stage: tuple[int, bool, bool, bool], ranks: int,
                 with_experts: bool, cuts: str) -> float:
    hidden, other = _stage_tensors(shape, tp, stage, with_experts)
    cut_other = cuts in ("all", "adamw_groups")
    cuttable = [cuts == "all"] * len(hidden) + [cut_other] * len(other)
    held = [0] * ranks
    for runs in partition([round(size) for size in hidden + other], cuttable, ranks):
        for start, end, rank in runs:
            held[rank] += end - start
    return max(held) / sum(held)


def muon_matrix_fraction(shape: ModelShape, layout: Layout, last: bool = False) -> float:
    """The share of a stage rank's dense (non-expert) parameters that Muon orthogonalizes (one
    momentum, 4 bytes); the rest (embeddings, head, norms, biases) its AdamW steps (8 bytes)."""
    hidden, other = _stage_tensors(shape, layout.tp, stage_contents(shape, layout, last), False)
    total = sum(hidden) + sum(other)
    return sum(hidden) / total if total else 0.0


def _stage_tensors(shape: ModelShape, tp: int, stage: tuple[int, bool, bool, bool],
                   with_experts: bool) -> tuple[list[float], list[float]]:
    """A stage rank's local tensor sizes: (Muon's orthogonalized matrices, the rest)."""
    blocks, embedding, head, norm = stage
    d, q, kv, ffn = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn
    moe_blocks = round(blocks * shape.moe_layers / shape.n_layers)
    matrices = 3 if shape.gated else 2
    experts = [shape.moe_experts * d * (shape.expert_ffn or ffn) / tp] * matrices if with_experts else []
    # kiln's partition itself (kiln/parallel/zero1_partition.py) over the stage's local tensor sizes
    hidden = [q * d / tp, kv * d / tp, kv * d / tp, d * q / tp] * blocks  # Muon's orthogonalized tensors
    hidden += [d * ffn / tp] * matrices * (blocks - moe_blocks)  # dense MLPs
    hidden += ([shape.moe_experts * d] + experts) * moe_blocks  # MoE: router (replicated) and experts
    hidden += [d * shape.shared_ffn / tp] * matrices * moe_blocks if shape.shared_ffn else []  # shared experts
    hidden += [float(d)] * (moe_blocks if shape.shared_gate else 0)  # their gates: (1, dim) matrices (replicated)
    # norms (and their biases) and QK-norm gains (replicated over tp), then the biases
    other = [float(d)] * shape.norm_params * (2 * blocks + (1 if norm else 0))
    other += [float(q // shape.n_heads)] * (2 * blocks if shape.qk_norm else 0)
    if shape.qkv_bias:
        other += [q / tp, kv / tp, kv / tp] * blocks
    if shape.bias:  # wo's, then the dense MLPs' w1 (w3) and w2's
        other += [float(d)] * blocks + ([ffn / tp] * (matrices - 1) + [float(d)]) * (blocks - moe_blocks)
    if embedding:
        other.append(shape.vocab * d / tp)
        other += [shape.learned_positions_len * d / tp] if shape.learned_positions_len else []
    if head:
        other.append(shape.vocab * d / tp)
    return hidden, other


def holds_head(layout: Layout, last: bool) -> bool:
    """Whether that rank computes the LM head and the loss (the last stage; a V's rank 0)."""
    if layout.pp == 1:
        return True
    return (not last) if layout.schedule in V_SHAPED else last


def replicated_ranks(layout: Layout) -> int:
    """The ranks of one DiLoCo replica holding the very same parameters, which split the outer
    average and state (kiln/parallel/diloco.py `replicated_group`): dp x cp under ddp/zero1
    without ep, else 1."""
    replica = layout.replica
    return replica.dp * replica.cp if replica.dp_mode in ("ddp", "zero1") and replica.ep == 1 else 1


def rank_memory(shape: ModelShape, layout: Layout, seq_len: int, optimizer: str = "adamw") -> MemoryBreakdown:
    """Peak training bytes of the fullest rank for `layout`: under pp the larger of the first
    stage's rank (embedding, the most micro-batches in flight) and the last's (head, logits)."""
    if layout.diloco_inner_steps:  # a replica's peak, and DiLoCo's outer state (kiln/plan/diloco.py)
        mem = rank_memory(shape, layout.replica, seq_len, optimizer)
        mem.outer_state = 2 * mem.parameters / replicated_ranks(layout)
        if layout.diloco_sync_delay:  # a fragment's exchange buffer lives on through the next steps
            gathered = layout.dp_replicate if layout.diloco_wire_bytes == 1 else 1  # float8: every replica's
            mem.outer_state += (mem.parameters / layout.diloco_fragments / replicated_ranks(layout)
                                * layout.diloco_wire_bytes / 4 * gathered)
        return mem
    first = _end_rank_memory(shape, layout, seq_len, optimizer, last=False)
    if layout.pp == 1:
        return first
    last = _end_rank_memory(shape, layout, seq_len, optimizer, last=True)
    return first if first.total >= last.total else last


def _end_rank_memory(shape: ModelShape, layout: Layout, seq_len: int, optimizer: str, last: bool) -> MemoryBreakdown:
    out = MemoryBreakdown()
    dense, experts, layers = rank_params(shape, layout, last)
    stage_params = dense + experts
    full_mode = layout.dp_mode
    sharded = full_mode in ("fsdp", "zero2")  # both are FSDP2: sharded at rest
    shard = layout.dp_shard if sharded else 1
    expert_shard = layout.expert_dp if sharded else 1  # experts FSDP over "edp"; ddp/zero1 replicate them
    out.parameters = 4 * (dense / shard + experts / expert_shard)
    out.gradients = out.parameters
    # zero1: the fullest rank's partition, ep's experts outside it (zero1_fullest_share)
    if full_mode == "zero1":
        share = zero1_fullest_share(shape, layout, last, optimizer)
        stepped_dense, stepped_experts = dense * share, experts * (share if layout.ep == 1 else 1.0)
    else:
        stepped_dense, stepped_experts = dense / shard, experts / expert_shard
    if optimizer == "muon":  # one momentum for its matrices (the experts are all matrices), AdamW's two for the rest
        matrices = muon_matrix_fraction(shape, layout, last)
        out.optimizer = 4 * stepped_dense * (2 - matrices) + 4 * stepped_experts
    else:
        out.optimizer = OPTIM_STATE_BYTES.get(optimizer, 8) * (stepped_dense + stepped_experts)

    act = ACT_BYTES[layout.precision]
    tokens = layout.micro_batch * seq_len / layout.cp  # per rank per micro-batch
    float8 = layout.precision == "float8"
    per_block = shape.act_bytes_per_token(act, layout.compiled, float8, layout.fused_projections) * tokens / layout.tp
    if layout.ring_ranks == 1:  # sliding-window layers' blocked attention (the ring runs the window itself)
        per_block += shape.window_bytes_per_token(act, seq_len) * tokens / layout.tp
    if layout.ulysses_ranks > 1:  # K/V heads repeated to a multiple of its ranks, saved so for backward
        per_block += 2 * act * shape.kv_dim * (ulysses_kv_repeat(shape, layout) - 1) * tokens / layout.tp
    if layout.tp > 1:  # the all-gathered normed inputs of attention and MLP: whole, not 1/tp
        per_block += (1 - 1 / layout.tp) * shape.gathered_bytes_per_token(act, layout.compiled, float8) * tokens
    if layout.tp > 1 and layout.expert_tp > 1:  # experts sharded over tp: each tp rank routes the whole sequence
        per_block += (1 - 1 / layout.tp) * shape.moe_share * shape.moe_dispatch_bytes_per_token(act) * tokens
    n_ac = recomputed_blocks(layout.ac, layers)
    block_input = 4 * shape.dim * tokens / layout.tp
    recomputing = per_block  # held while a recomputed block's backward runs
    if layout.ac == "op":  # the selective checkpoint's kept outputs, all split by tp; the rest is recomputed
        kept = shape.op_kept_bytes_per_token(act, layout.compiled) * tokens / layout.tp
        block_input, recomputing = block_input + kept, max(0.0, per_block - kept)
    per_microbatch = (layers - n_ac) * per_block + n_ac * block_input
    in_flight = in_flight_microbatches(layout)
    if last and layout.pp > 1 and layout.schedule == "1f1b":
        in_flight = 1.0  # torch's 1F1B: the last rank runs each backward right after its forward
    out.activations = per_microbatch * in_flight

    param_bytes = 4 if layout.precision == "fp32" else 2
    head = holds_head(layout, last)
    loss_tokens = tokens if layout.loss == "full" else min(tokens, LOSS_CHUNK_TOKENS)
    logits = 0.0
    if head and layout.compiled:  # fused loss: the saved low-precision logits, their gradient written in place
        logits = act * loss_tokens * shape.vocab / layout.tp
    elif head:  # fp32 logits-sized tensors live at once in the loss's backward (eager_loss_logits)
        logits = eager_loss_logits(layout) * 4 * loss_tokens * shape.vocab / layout.tp
    own_embedding, root = fsdp_end_units(shape, layout, last)
    # Under pp torch's stage keeps each unit gathered from its backward until a forward reshards it
    # (`set_reshard_after_backward(False)` until the step's REDUCE_GRAD), so by the end of a
    # micro-batch's backward every block of the stage is gathered, as under zero2 (pinned:
    # tests/plan/test_collective_counts.py). Counted as zero2's peak: an upper bound, as the next
    # forward reshards the stage block by block while its activations grow
    if resharded_after_forward(layout) and layout.dp_shard > 1 and layout.pp == 1:
        # current + prefetched block, and the root (head, final norm), gathered from forward to backward
        out.temporary += param_bytes * (2 * shape.layer_params / layout.tp + root)
        # one unit's gradients before reduce-scatter, in parallel.reduce_dtype
        out.comm_buffers += layout.grad_wire_bytes * shape.layer_params / layout.tp
        if layout.fsdp_reshard_to:  # every block that ran forward keeps its 1/k until its backward
            # (not the last, kept whole: counted above)
            out.temporary += param_bytes * (dense - own_embedding - root) * (layers - 1) / layers / layout.fsdp_reshard_to
    elif sharded and layout.dp_shard > 1:
        # params stay gathered from forward to backward (zero2; fsdp under pp, above); an own embedding
        # unit is resharded after its forward and not gathered for backward, except under a zero-bubble
        # pipeline (kiln/parallel/pipeline.py keep_gathered_until_backward)
        kept_gathered = layout.pp > 1 and layout.schedule in ZERO_BUBBLE
        out.temporary += param_bytes * (stage_params - (0.0 if kept_gathered else own_embedding))
        out.comm_buffers += layout.grad_wire_bytes * shape.layer_params / layout.tp
    elif layout.dp > 1:
        out.comm_buffers += min(2 * DDP_BUCKET_BYTES, 4 * stage_params)
    casts_forward = casts_backward = 0.0
    if layout.precision != "fp32" and not sharded:  # autocast's low-precision weight copies
        head_w = shape.vocab * shape.dim if head else 0  # the LM head's weight (tied under pp: the copy)
        if layout.compiled:  # a checkpointed block's casts are recomputed, not saved; backward frees them
            blocks = 0 if float8 else layers - n_ac  # torchao's float8 weight casts are recomputed too
            casts_forward = param_bytes * (blocks * shape.layer_params + head_w) / layout.tp
            casts_backward = param_bytes * shape.layer_params / layout.tp
        else:
            out.temporary += param_bytes * (layers * shape.layer_params + head_w) / layout.tp
    if layout.pp > 1:
        out.comm_buffers += 2 * act * tokens * shape.dim / layout.tp  # send/recv of stage boundaries
    if layout.ring_ranks > 1 and not layout.fused_ring_blocks:
        out.temporary += ring_block_bytes(shape, layout, seq_len)
    if layout.compiled:
        recomputing = block_input + recomputing if n_ac else 0.0  # the first block's input and activations
        _compiled_peak_phase(out, layout, logits + casts_forward, casts_backward + recomputing)
    else:
        _eager_peak_phase(out, layout, logits, recomputing if n_ac else 0.0)
    return out


def _tp_kv_heads(shape: ModelShape, layout: Layout) -> int:
    return shape.kv_dim * shape.n_heads // (shape.q_dim or shape.dim) // layout.tp


def ulysses_kv_repeat(shape: ModelShape, layout: Layout) -> int:
    """How often Ulysses repeats each K/V head (kiln/parallel/ulysses.py): to the least multiple of
    its ranks (`Layout.ulysses_ranks`) among a tp rank's K/V heads; 1 under the ring."""
    return layout.ulysses_ranks // math.gcd(_tp_kv_heads(shape, layout), layout.ulysses_ranks)


def _ulysses_rank_heads(shape: ModelShape, layout: Layout) -> tuple[int, int]:
    """(query heads, K/V heads) a rank attends after Ulysses' exchange (K/V repeated as it does)."""
    ranks = layout.ulysses_ranks
    return (shape.n_heads // layout.tp // ranks,
            _tp_kv_heads(shape, layout) * ulysses_kv_repeat(shape, layout) // ranks)


def ulysses_first_round_share(shape: ModelShape, layout: Layout) -> float:
    """The share of Ulysses' input exchange (q, k and v) that goes in its first round: 1 / rounds
    where a rank's K/V heads split in the rounds, else the first round's queries and every K/V head
    (kiln/parallel/ulysses.py `Ulysses.attention`)."""
    rounds = layout.ulysses_rounds
    if _ulysses_rank_heads(shape, layout)[1] % rounds == 0:
        return 1 / rounds
    kv = 2 * shape.kv_dim * ulysses_kv_repeat(shape, layout)
    return (shape.q_dim / rounds + kv) / (shape.q_dim + kv)


def ulysses_round_kv_share(shape: ModelShape, layout: Layout) -> float:
    """The K/V heads one of Ulysses' rounds attends with, as a share of those a rank holds after
    the exchange (what each round's ring passes round under the hybrid): 1 in one round; 1 / rounds
    where they split in the rounds; else the one K/V head of the round's queries, or one per query
    head (kiln/parallel/ulysses.py `_kv_for_query_heads`)."""
    rounds = layout.ulysses_rounds
    q_heads, kv_heads = _ulysses_rank_heads(shape, layout)
    if kv_heads % rounds == 0:
        return 1 / rounds
    q_round, group = q_heads // rounds, q_heads // kv_heads
    return (1 if group % q_round == 0 else q_round) / kv_heads


RING_MATMUL_BLOCKS = 5  # (chunk x chunk) fp32 tensors per head at a matmul block's peak


def ring_block_bytes(shape: ModelShape, layout: Layout, seq_len: int) -> float:
    """What the ring's matmul block kernel (GPUs, and attention dropout) holds while one block of
    (chunk x chunk) query-key pairs runs, chunk = seq_len / (2 cp): its scores, probabilities and
    their gradients in fp32 per head of this rank (n_heads / tp): RING_MATMUL_BLOCKS of them, as
    benchmarks/ring_attention.py measured it (the profiled peak of one layer's forward + backward,
    matmul kernel minus the fused kernel's: 1342 MB = 5.0 x the 268 MB of one such tensor at cp 2,
    16384 tokens, 4 heads; 4.5 x at 512-token chunks). 8.6 GB per tensor at 32 heads and
    8192-token chunks: what a long context with cp costs until GPUs get a fused block kernel."""
    chunk = seq_len // (2 * layout.ring_ranks)  # under Ulysses x ring, for n_heads / ulysses_degree heads
    return RING_MATMUL_BLOCKS * 4 * layout.micro_batch * shape.n_heads / (layout.tp * layout.ulysses_ranks) * chunk * chunk


def eager_loss_logits(layout: Layout) -> int:
    """fp32 logits-sized tensors (per chunk for the chunked loss) live at once in an eager full
    loss's backward, its peak: log_softmax's saved output, the nll gradient and log_softmax's
    gradient (3); under tp, loss parallel (torch's DTensor log_softmax/nll_loss) also keeps the
    logits themselves and its backward allocates exp(output) (5). Counted by allocation at that
    moment (benchmarks/activation_checkpointing.py's peaks, torch's MemTracker); the chunked loss
    (kiln/model/loss.py) holds one chunk's logits and their gradient (2)."""
    if layout.loss != "full":
        return 2
    return 5 if layout.tp > 1 else 3


def _eager_peak_phase(out: MemoryBreakdown, layout: Layout, loss_temp: float, recomputing: float) -> None:
    """Keep the larger phase of an eager step: the loss's backward (every saved activation, the
    loss's logits-sized tensors, eager_loss_logits; gradients only when earlier micro-batches left
    them) or the blocks' backward (all gradients and, under checkpointing, the block being
    recomputed; the loss's tensors are freed by then). Gradients appear as backward frees the
    blocks' activations, so counting all of both at once is an upper bound there."""
    grads_at_loss = out.gradients if layout.grad_accum > 1 or layout.pp > 1 else 0.0
    at_loss = grads_at_loss + loss_temp
    in_blocks = out.gradients + recomputing
    if at_loss >= in_blocks:
        out.gradients, out.temporary = grads_at_loss, out.temporary + loss_temp
        out.notes.append("eager peak in the loss's backward")
    else:
        out.activations += recomputing  # the one block being recomputed
        out.notes.append("eager peak in the blocks' backward")


def _compiled_peak_phase(out: MemoryBreakdown, layout: Layout, forward_temp: float, backward_temp: float) -> None:
    """Keep the larger phase of a compiled step (module docstring): the end of forward (saved
    activations, logits and weight casts; gradients only when earlier micro-batches left them) or
    the end of backward (all gradients, the first block's weight casts and, under checkpointing,
    its input and recomputed activations: backward frees the later blocks' as it goes)."""
    grads_in_forward = out.gradients if layout.grad_accum > 1 or layout.pp > 1 else 0.0
    forward_end = grads_in_forward + out.activations + forward_temp
    backward_end = out.gradients + backward_temp
    if forward_end >= backward_end:
        out.gradients, out.temporary = grads_in_forward, out.temporary + forward_temp
        out.notes.append("compiled peak at the end of forward")
    else:
        out.activations, out.temporary = 0.0, out.temporary + backward_temp
        out.notes.append("compiled peak at the end of backward")

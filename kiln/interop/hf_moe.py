"""Mixture-of-experts models <-> Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE (kiln/interop/hf.py
does the rest of each model: attention, norms, embeddings, windows, RoPE).

Mixtral: Mistral's attention with an MoE in every block: softmax router, top-k gates
renormalized, every token computed (dropless). Qwen3-MoE: Qwen3's attention (QK-norm) with an MoE
in every `decoder_sparse_step`-th block, gates renormalized only with `norm_topk_prob`. Qwen2-MoE
(Qwen1.5-MoE): Qwen2's attention (q/k/v biases, `qkv_bias`), Qwen3-MoE's routing, and a shared
expert scaled by a per-token sigmoid gate (kiln's `moe_shared_experts` x the expert width,
`moe_shared_gate`). kiln's MoE
computes the same with `moe_capacity_factor = 0` (import sets it; an exported model trained with
a capacity factor runs dropless there, as HF runs it).

All store experts as the hub does (transformers 4 and 5 alike write it so): one (hidden, dim) /
(dim, hidden) matrix per expert and projection, which kiln stacks into its (E, dim, hidden) /
(E, hidden, dim) grouped weights (transposed: kiln multiplies x @ w). What no family has (sigmoid
routing, ungated shared experts, the auxiliary-loss-free bias, top-1 with renormalized gates,
which HF computes as a gate of 1) is refused with one line naming the key.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.model.transformer import expert_hidden_size

MIXTRAL, QWEN3_MOE, QWEN2_MOE = "mixtral", "qwen3_moe", "qwen2_moe"
CLASSES = {MIXTRAL: "MixtralForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM"}
# kiln GroupedExperts weight -> each family's per-expert projection (gate, down, up)
EXPERT_NAMES = {MIXTRAL: {"w1": "w1", "w2": "w2", "w3": "w3"},
                QWEN3_MOE: {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}}
EXPERT_NAMES[QWEN2_MOE] = EXPERT_NAMES[QWEN3_MOE]
BLOCK = {MIXTRAL: "block_sparse_moe", QWEN3_MOE: "mlp", QWEN2_MOE: "mlp"}


def family_of(cfg: ModelConfig) -> str:
    """The HF MoE family a kiln MoE model exports as (check_export says whether it can)."""
    return QWEN2_MOE if cfg.moe_shared_experts else QWEN3_MOE if cfg.qk_norm else MIXTRAL


def check_export(cfg: ModelConfig, family: str) -> None:
    """Refuse MoE settings the HF family cannot express, naming the kiln key."""
    theirs = CLASSES[family]
    if family == QWEN2_MOE and not cfg.moe_shared_gate:
        raise KilnError("model.moe_shared_gate=false: ungated shared experts (DeepSeek, Llama 4) have no HF "
                        "family kiln exports; Qwen2-MoE gates its shared expert (model.moe_shared_gate=true)")
    if family == QWEN2_MOE and cfg.attention_head_dim() * cfg.n_heads != cfg.dim:
        raise KilnError(f"model.head_dim={cfg.head_dim} has no equivalent in HF {theirs} (its heads split "
                        f"hidden_size)")
    if family == QWEN2_MOE and cfg.qk_norm:
        raise KilnError(f"model.qk_norm=true with model.moe_shared_experts={cfg.moe_shared_experts}: HF {theirs} "
                        f"(the family with shared experts) has no QK-norm")
    if cfg.moe_router != "softmax":
        raise KilnError(f"model.moe_router={cfg.moe_router!r} has no equivalent in HF {theirs} (softmax routers only)")
    for key, plain in (("moe_gate_scale", 1.0), ("moe_groups", 1)):
        if getattr(cfg, key) != plain:
            raise KilnError(f"model.{key}={getattr(cfg, key)!r} has no equivalent in HF {theirs} (DeepSeek-V3 "
                            f"routing); expected {plain!r}")
    if cfg.moe_bias_update_rate:
        raise KilnError(f"model.moe_bias_update_rate={cfg.moe_bias_update_rate:g}: the expert bias that picks "
                        f"experts has no place in HF {theirs}")
    if family == MIXTRAL and not cfg.moe_norm_gates:
        raise KilnError(f"model.moe_norm_gates=false has no equivalent in HF {theirs} (it always renormalizes); "
                        f"QK-norm models export as Qwen3-MoE, which has norm_topk_prob")
    if cfg.moe_top_k == 1 and (family == MIXTRAL or cfg.moe_norm_gates):
        raise KilnError(f"model.moe_top_k=1 has no equivalent in HF {theirs} with renormalized gates (its one "
                        f"gate is 1, kiln's the router probability)"
                        + ("; set model.moe_norm_gates=false" if family == QWEN3_MOE else ""))
    if family == MIXTRAL and cfg.moe_every != 1:
        raise KilnError(f"model.moe_every={cfg.moe_every} has no equivalent in HF {theirs} (an MoE in every "
                        f"block); QK-norm models export as Qwen3-MoE, which has decoder_sparse_step")
    if family == MIXTRAL and cfg.full_attention_every:
        raise KilnError(f"model.full_attention_every={cfg.full_attention_every} has no equivalent in HF {theirs} "
                        f"(its sliding window covers every layer)")
    if family != MIXTRAL and cfg.sliding_window:
        raise KilnError(f"model.sliding_window={cfg.sliding_window} on an MoE model: kiln exports no "
                        f"sliding window to HF {theirs}")
    if cfg.qkv_bias and family != QWEN2_MOE:
        raise KilnError(f"model.qkv_bias=true has no equivalent in HF {theirs}")


def config_kwargs(cfg: ModelConfig, family: str) -> dict:
    """The transformers config arguments of the MoE part (Qwen3-MoE's expert count under both
    names: transformers 4 reads num_experts, 5 num_local_experts)."""
    if family == MIXTRAL:
        return dict(num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                    output_router_logits=False, router_jitter_noise=0.0)
    out = dict(num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
               moe_intermediate_size=expert_hidden_size(cfg), decoder_sparse_step=cfg.moe_every,
               mlp_only_layers=[], norm_topk_prob=cfg.moe_norm_gates, output_router_logits=False)
    if family == QWEN2_MOE:
        out.update(shared_expert_intermediate_size=cfg.moe_shared_experts * expert_hidden_size(cfg),
                   qkv_bias=cfg.qkv_bias, use_sliding_window=False)
    return out


def config_from_hf(hf: dict, source: str, model_type: str, get: Callable, n_layers: int) -> dict:
    """kiln ModelConfig fields (moe_*, ffn_hidden) from a Mixtral / Qwen3-MoE / Qwen2-MoE config.json."""
    experts = get("num_local_experts" if model_type == MIXTRAL or "num_experts" not in hf else "num_experts", int)
    top_k = get("num_experts_per_tok", int)
    if top_k > experts:
        raise KilnError(f"{source}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    if model_type == MIXTRAL:
        if get("router_jitter_noise", float, 0.0):
            raise KilnError(f"{source}: router_jitter_noise={hf['router_jitter_noise']!r} is not supported by "
                            f"kiln's router; expected 0")
        every, norm, ffn, expert = 1, True, get("intermediate_size", int), 0
    else:
        every, norm = get("decoder_sparse_step", int, 1), get("norm_topk_prob", bool, False)
        expert = get("moe_intermediate_size", int)
        only = hf.get("mlp_only_layers") or []
        if only:
            raise KilnError(f"{source}: mlp_only_layers={only!r} is not supported; kiln puts its MoE in every "
                            f"k-th block (decoder_sparse_step) and no other pattern")
        # dense blocks between (decoder_sparse_step > 1) are intermediate_size wide, experts
        # moe_intermediate_size (model.moe_hidden); with none, intermediate_size is unused
        ffn = get("intermediate_size", int) if every > 1 else expert
        expert = 0 if expert == ffn else expert
        if every > n_layers:
            raise KilnError(f"{source}: decoder_sparse_step={every} leaves no MoE block in {n_layers} layers; "
                            f"expected at most num_hidden_layers")
    shared = {}
    if model_type == QWEN2_MOE:  # one gated shared expert, as wide as some whole number of experts
        width, unit = get("shared_expert_intermediate_size", int), expert or ffn
        if width % unit:
            raise KilnError(f"{source}: shared_expert_intermediate_size={width} is not a multiple of the expert "
                            f"width {unit}; kiln's shared experts are moe_shared_experts x the expert width")
        shared = dict(moe_shared_experts=width // unit, moe_shared_gate=True)
    if top_k == 1 and norm:
        raise KilnError(f"{source}: num_experts_per_tok=1 with renormalized gates (every gate 1) has no kiln "
                        f"equivalent (kiln's top-1 gate is the router probability)")
    # HF trains with the balancing loss only under output_router_logits (its loss averages the
    # layers; kiln's sums them, hence the division); no z-loss.
    aux = get("router_aux_loss_coef", float, 0.0) if get("output_router_logits", bool, False) else 0.0
    moe_layers = n_layers // every
    return dict(moe_experts=experts, moe_top_k=top_k, moe_capacity_factor=0.0, moe_every=every,
                moe_norm_gates=norm, moe_aux_loss_weight=aux / max(moe_layers, 1), moe_z_loss_weight=0.0,
                ffn_hidden=ffn, moe_hidden=expert, **shared)


def moe_layer_names(cfg: ModelConfig, family: str, i: int) -> dict[str, str]:
    """kiln name -> HF name of block i's router and shared expert (the experts: `expert_names`)."""
    names = {f"layers.{i}.feed_forward.router.weight": f"model.layers.{i}.{BLOCK[family]}.gate.weight"}
    if cfg.moe_shared_experts:  # Qwen2-MoE's: nn.Linear weights both sides, no transpose
        for ours, theirs in (("ffn.w1", "shared_expert.gate_proj"), ("ffn.w3", "shared_expert.up_proj"),
                             ("ffn.w2", "shared_expert.down_proj"), ("gate", "shared_expert_gate")):
            names[f"layers.{i}.shared_experts.{ours}.weight"] = f"model.layers.{i}.mlp.{theirs}.weight"
    return names


def expert_names(family: str, i: int, e: int) -> dict[str, str]:
    """kiln GroupedExperts weight -> the HF tensor of expert e in block i."""
    return {ours: f"model.layers.{i}.{BLOCK[family]}.experts.{e}.{theirs}.weight"
            for ours, theirs in EXPERT_NAMES[family].items()}


def experts_to_hf(sd: dict[str, torch.Tensor], family: str, i: int, n_experts: int) -> dict[str, torch.Tensor]:
    out = {}
    for e in range(n_experts):
        for ours, theirs in expert_names(family, i, e).items():
            out[theirs] = sd[f"layers.{i}.feed_forward.experts.{ours}"][e].t()
    return out


def experts_from_hf(take: Callable, family: str, i: int, expected: dict[str, torch.Size]) -> dict[str, Callable]:
    """Loaders of block i's stacked expert weights, each from its E per-expert HF tensors (shapes
    checked from the headers now, data read one tensor at a time on load)."""
    out = {}
    for ours in EXPERT_NAMES[family]:
        name = f"layers.{i}.feed_forward.experts.{ours}"
        n_experts, rows, cols = expected[name]
        parts = [take(expert_names(family, i, e)[ours], (cols, rows), torch.t) for e in range(n_experts)]
        out[name] = lambda parts=parts: torch.stack([load() for load in parts])
    return out

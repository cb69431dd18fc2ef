"""kiln runs <-> Hugging Face `transformers` checkpoints (Llama and GPT-2 layouts).

Export (kiln/interop/hf_export.py): a run's checkpoint -> `config.json` (written by transformers' own
`LlamaConfig`/`GPT2Config.to_json_file`), `model.safetensors` (`safetensors.torch.save_file`) and
the tokenizer, loadable as `LlamaForCausalLM` / `GPT2LMHeadModel`. A kiln option with no HF
equivalent stops the export with one line naming it.

Import (kiln/interop/hf_import.py): a local HF directory -> a kiln run (config.toml, tokenizer.json and a
weights-only checkpoint step-0). Only JSON and safetensors files are read (never pickle), shard
names from an index must stay inside the directory, and every tensor's shape and dtype is
checked from the file headers before any data is read.

Hand-written here: the name/layout mapping between the two module trees (GPT-2's Conv1D stores
weights transposed and fuses q, k, v into one `c_attn`). kiln's RoPE uses the "halves" pairing,
the same as transformers' `rotate_half`, so Llama q/k weights need no permutation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.interop import hf_moe
from kiln.interop.hf_moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from kiln.model.transformer import expert_hidden_size, ffn_hidden_size, uses_moe

# Mistral: Llama's layout with a sliding window on every layer; Ministral: with windowed and global
# layers (layer_types); Qwen2: Llama's with biases on q, k and v only; Qwen3: Llama's with QK-norm.
LLAMA, GPT2, MISTRAL, MINISTRAL, QWEN2, QWEN3 = "llama", "gpt2", "mistral", "ministral", "qwen2", "qwen3"
SLIDING, FULL = "sliding_attention", "full_attention"  # HF layer_types' kinds
# HF GPT-2 activation_function -> kiln model.activation (the tanh forms are the same function).
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
HF_CLASS = {LLAMA: "LlamaForCausalLM", GPT2: "GPT2LMHeadModel", QWEN2: "Qwen2ForCausalLM",
            QWEN3: "Qwen3ForCausalLM", MISTRAL: "MistralForCausalLM", MINISTRAL: "MinistralForCausalLM",
            **hf_moe.CLASSES}
# What each HF family fixes; a kiln option outside it has no equivalent there.
FAMILY_OPTIONS = {
    LLAMA: {"norm": "rmsnorm", "norm_placement": "pre", "activation": "swiglu", "positions": "rope"},
    GPT2: {"norm": "layernorm", "norm_placement": "pre", "activation": ("gelu", "gelu_tanh"),
           "positions": "learned", "bias": True},
}
FAMILY_OPTIONS[QWEN2] = FAMILY_OPTIONS[LLAMA]
FAMILY_OPTIONS[QWEN3] = {**FAMILY_OPTIONS[LLAMA], "bias": False, "qkv_bias": False}
FAMILY_OPTIONS[MISTRAL] = FAMILY_OPTIONS[MINISTRAL] = {**FAMILY_OPTIONS[LLAMA], "bias": False}
# Mixture-of-experts families (kiln/interop/hf_moe.py): Mixtral = Mistral's attention, Qwen3-MoE = Qwen3's.
FAMILY_OPTIONS[MIXTRAL], FAMILY_OPTIONS[QWEN3_MOE] = FAMILY_OPTIONS[MISTRAL], FAMILY_OPTIONS[QWEN3]
FAMILY_OPTIONS[QWEN2_MOE] = FAMILY_OPTIONS[MISTRAL]  # Qwen2's q/k/v biases (model.qkv_bias) or none
# whose attention (and window keys) each MoE family has
ATTENTION_OF = {MIXTRAL: MISTRAL, QWEN3_MOE: QWEN3, QWEN2_MOE: QWEN2}


# ---------------------------------------------------------------------------- kiln -> HF


def export_family(cfg: ModelConfig) -> str:
    """Which HF family holds this model (llama for RoPE, qwen2 for RoPE with biases on q/k/v only,
    qwen3 for RoPE with QK-norm, gpt2 for learned positions), or refuse."""
    if cfg.positions == "learned":
        family = GPT2
        if cfg.sliding_window:
            raise KilnError(f"model.sliding_window={cfg.sliding_window} has no equivalent in HF GPT2LMHeadModel; "
                            f"use positions='rope' (Mistral) for sliding-window models")
    else:
        family = QWEN3 if cfg.qk_norm else QWEN2 if cfg.qkv_bias and not cfg.bias else LLAMA
        if family == LLAMA and cfg.sliding_window:  # Qwen2/3 name their windowed layers themselves
            family = MINISTRAL if cfg.full_attention_every else MISTRAL
    if cfg.moe_experts:  # Qwen2-MoE with shared experts, Qwen3-MoE for QK-norm models, else Mixtral
        if family == GPT2:
            raise KilnError(f"model.moe_experts={cfg.moe_experts} with positions='learned': HF's GPT2LMHeadModel "
                            f"has no mixture of experts; use positions='rope' (Mixtral, Qwen3-MoE)")
        family = hf_moe.family_of(cfg)
        hf_moe.check_export(cfg, family)
    for key, wanted in FAMILY_OPTIONS[family].items():
        value = getattr(cfg, key)
        allowed = wanted if isinstance(wanted, tuple) else (wanted,)
        if value not in allowed:
            need = " or ".join(repr(w) for w in allowed)
            raise KilnError(f"model.{key}={value!r} has no equivalent in HF {HF_CLASS[family]} "
                            f"(a {cfg.positions}-position model exports there and needs model.{key}={need})")
    if family == GPT2 and cfg.attention_head_dim() * cfg.n_heads != cfg.dim:
        raise KilnError(f"model.head_dim={cfg.head_dim} with model.n_heads={cfg.n_heads} and model.dim={cfg.dim} has "
                        f"no equivalent in HF GPT2LMHeadModel (its heads split n_embd); use positions='rope'")
    if family == GPT2 and cfg.qk_norm:
        raise KilnError("model.qk_norm=true has no equivalent in HF GPT2LMHeadModel; use positions='rope' "
                        "(Qwen3) for QK-norm models")
    if family == GPT2 and cfg.n_kv_heads not in (0, cfg.n_heads):
        raise KilnError(f"model.n_kv_heads={cfg.n_kv_heads} (grouped-query attention) has no equivalent in "
                        f"HF GPT2LMHeadModel; use positions='rope' (Llama) for GQA models")
    return family


def hf_config(cfg: ModelConfig, eos_id: int):
    """The transformers config object for a kiln ModelConfig (vocab_size already resolved)."""
    family = export_family(cfg)
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=eos_id,
                  eos_token_id=eos_id, architectures=[HF_CLASS[family]])
    if family != GPT2:
        from transformers import LlamaConfig, Qwen2Config

        common.update(hidden_size=cfg.dim, intermediate_size=ffn_hidden_size(cfg), num_hidden_layers=cfg.n_layers,
                      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
                      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                      rope_theta=cfg.rope_theta, hidden_act="silu", attention_dropout=cfg.dropout)
        windows = _windows_to_hf(cfg)
        if family == LLAMA:
            config = LlamaConfig(head_dim=cfg.attention_head_dim(), attention_bias=cfg.bias, mlp_bias=cfg.bias,
                                 **common)
        elif family == MISTRAL:
            from transformers import MistralConfig

            config = MistralConfig(head_dim=cfg.attention_head_dim(), sliding_window=cfg.sliding_window, **common)
        elif family == MINISTRAL:
            from transformers import MinistralConfig

            config = MinistralConfig(head_dim=cfg.attention_head_dim(), **windows, **common)
        elif family == QWEN2:  # reads head_dim when set, else hidden_size / heads
            config = Qwen2Config(head_dim=cfg.attention_head_dim(), **windows, **common)
        elif family == MIXTRAL:  # MoE in every block: its intermediate_size is the experts' width
            from transformers import MixtralConfig

            common["intermediate_size"] = expert_hidden_size(cfg)
            config = MixtralConfig(head_dim=cfg.attention_head_dim(), sliding_window=cfg.sliding_window or None,
                                   **hf_moe.config_kwargs(cfg, family), **common)
        elif family == QWEN3_MOE:
            try:
                from transformers import Qwen3MoeConfig
            except ImportError:
                raise KilnError("an MoE model with model.qk_norm=true exports as Qwen3-MoE, which needs "
                                "transformers >= 4.51") from None
            config = Qwen3MoeConfig(head_dim=cfg.attention_head_dim(), attention_bias=False, use_sliding_window=False,
                                    **hf_moe.config_kwargs(cfg, family), **common)
        elif family == QWEN2_MOE:  # head_dim is hidden_size / heads there (refused otherwise above)
            from transformers import Qwen2MoeConfig

            config = Qwen2MoeConfig(**hf_moe.config_kwargs(cfg, family), **common)
        else:
            try:
                from transformers import Qwen3Config
            except ImportError:
                raise KilnError("model.qk_norm=true exports as Qwen3, which needs transformers >= 4.51") from None
            config = Qwen3Config(head_dim=cfg.attention_head_dim(), attention_bias=False, **windows, **common)
        scaling = _rope_to_hf(cfg)
        if scaling and getattr(config, "rope_parameters", None) is not None:  # transformers >= 5
            config.rope_parameters = {**config.rope_parameters, **scaling}
        elif scaling:
            config.rope_scaling = scaling
        return config
    from transformers import GPT2Config

    # kiln "gelu" is the exact erf GELU (HF "gelu"); "gelu_tanh" is GPT-2's own tanh form (HF "gelu_new").
    act = "gelu_new" if cfg.activation == "gelu_tanh" else "gelu"
    return GPT2Config(n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=ffn_hidden_size(cfg),
                      n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps, activation_function=act,
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, **common)


def hf_config_json(cfg: ModelConfig, eos_id: int) -> str:
    """config.json's text: transformers' own serialization, plus, for a RoPE model, the top-level
    `rope_theta` and `rope_scaling` that transformers < 5 reads (>= 5 keeps both in
    `rope_parameters`), so either major version loads the same model."""
    config = json.loads(hf_config(cfg, eos_id).to_json_string())
    family = export_family(cfg)
    if family != GPT2:
        config["rope_theta"] = cfg.rope_theta
        config["rope_scaling"] = _rope_to_hf(cfg)
    if family == QWEN3_MOE:  # the expert count under both names (transformers 4: num_experts, 5: num_local_experts)
        config["num_experts"] = config["num_local_experts"] = cfg.moe_experts
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _windows_to_hf(cfg: ModelConfig) -> dict:
    """Qwen2/Qwen3/Ministral config keys for model.sliding_window: the window, and each layer's kind
    named in layer_types (max_window_layers 0: no leading full-attention layers beyond those)."""
    from kiln.model.transformer import attention_window

    if not cfg.sliding_window:
        return {"use_sliding_window": False} if cfg.qk_norm or cfg.qkv_bias else {}
    kinds = [SLIDING if attention_window(cfg, i) else FULL for i in range(cfg.n_layers)]
    out = {"sliding_window": cfg.sliding_window, "layer_types": kinds}
    return out if not (cfg.qk_norm or cfg.qkv_bias) else {**out, "use_sliding_window": True, "max_window_layers": 0}


def _rope_to_hf(cfg: ModelConfig) -> dict | None:
    """model.rope_scaling as HF's rope dict (the inverse of ROPE_TYPES); None without scaling."""
    if cfg.rope_scaling == "none":
        return None
    rope_type, = [t for t, (ours, _) in ROPE_TYPES.items() if ours == cfg.rope_scaling]
    fields = ROPE_TYPES[rope_type][1].items()
    # a value equal to an optional key's default is left out (attention_factor 0 means "derive it")
    return {"rope_type": rope_type, **{theirs: getattr(cfg, ours) for theirs, (ours, default) in fields
                                       if default in (REQUIRED, CONTEXT) or getattr(cfg, ours) != default}}


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """kiln name -> HF name for every Llama/Mistral/Qwen2/Qwen3 tensor (biases and QK-norm gains
    where the model has them)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    parts = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj"}
    moe_family = hf_moe.family_of(cfg)
    for i in range(cfg.n_layers):
        moe = uses_moe(cfg, i)
        if moe:  # the router here; the experts, stacked in kiln, go tensor by tensor (hf_moe)
            names.update(hf_moe.moe_layer_names(cfg, moe_family, i))
        for ours, theirs in parts.items():
            if moe and ours.startswith("feed_forward."):
                continue
            biased = cfg.bias or (cfg.qkv_bias and ours in ("attention.wq", "attention.wk", "attention.wv"))
            for kind in ("weight", "bias") if biased else ("weight",):
                names[f"layers.{i}.{ours}.{kind}"] = f"model.layers.{i}.{theirs}.{kind}"
        if cfg.qk_norm:
            for w in "qk":
                names[f"layers.{i}.attention.{w}_norm.weight"] = f"model.layers.{i}.self_attn.{w}_norm.weight"
        names[f"layers.{i}.attention_norm.weight"] = f"model.layers.{i}.input_layernorm.weight"
        names[f"layers.{i}.ffn_norm.weight"] = f"model.layers.{i}.post_attention_layernorm.weight"
    return names


def to_hf_state(model_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """kiln state dict -> HF tensors, contiguous, each stored once (tied head left to HF)."""
    sd = {k: v.detach().float().cpu() for k, v in model_state.items()}
    family = export_family(cfg)
    if family != GPT2:
        out = {hf: sd[ours] for ours, hf in _llama_names(cfg).items()}
        for i in range(cfg.n_layers) if cfg.moe_experts else ():
            if uses_moe(cfg, i):
                out.update(hf_moe.experts_to_hf(sd, family, i, cfg.moe_experts))
    else:
        out = {"transformer.wte.weight": sd["tok_embeddings.weight"],
               "transformer.wpe.weight": sd["pos_embeddings.weight"],
               "transformer.ln_f.weight": sd["norm.weight"], "transformer.ln_f.bias": sd["norm.bias"]}
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["output.weight"]
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
                out[h + theirs + ".weight"] = sd[p + ours + ".weight"]
                out[h + theirs + ".bias"] = sd[p + ours + ".bias"]
            # Conv1D keeps weights as (in, out): the transpose of nn.Linear's (out, in).
            qkv = [p + f"attention.{w}" for w in ("wq", "wk", "wv")]
            out[h + "attn.c_attn.weight"] = torch.cat([sd[n + ".weight"] for n in qkv]).t()
            out[h + "attn.c_attn.bias"] = torch.cat([sd[n + ".bias"] for n in qkv])
            for ours, theirs in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                                 ("feed_forward.w2", "mlp.c_proj")):
                out[h + theirs + ".weight"] = sd[p + ours + ".weight"].t()
                out[h + theirs + ".bias"] = sd[p + ours + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------- HF -> kiln


def model_config_from_hf(hf: dict, source: str) -> ModelConfig:
    """An HF config.json (as a dict) -> kiln ModelConfig; unsupported features name their key."""
    model_type = hf.get("model_type")
    get = _getter(hf, source)
    attention = ATTENTION_OF.get(model_type, model_type)  # an MoE family: whose attention it has
    if attention in (LLAMA, MISTRAL, MINISTRAL, QWEN2, QWEN3):
        rope = _rope_from_hf(hf, source)
        _require(hf, source, "hidden_act", "silu", "kiln's swiglu uses SiLU")
        moe = {}
        if model_type in (MIXTRAL, QWEN3_MOE, QWEN2_MOE):
            moe = hf_moe.config_from_hf(hf, source, model_type, get, get("num_hidden_layers", int))
            if model_type != MIXTRAL and hf.get("use_sliding_window"):
                raise KilnError(f"{source}: use_sliding_window=true is not supported by kiln for {model_type}; "
                                f"expected false")
        if attention == QWEN2:  # q/k/v biased, o and the MLP not, whatever else the file says
            bias, qkv_bias = False, True if model_type == QWEN2 else get("qkv_bias", bool, True)
        elif attention == QWEN3:  # its attention_bias covers q, k, v and o but not the MLP
            _require(hf, source, "attention_bias", False, "biases on the attention alone have no kiln equivalent")
            bias = qkv_bias = False
        else:
            bias, qkv_bias = get("attention_bias", bool, False), False
            if get("mlp_bias", bool, False) != bias:
                raise KilnError(f"{source}: attention_bias={bias} with mlp_bias={not bias}: kiln's model.bias "
                                f"sets both together")
        window, every = _sliding_windows(hf, source, attention, get("num_hidden_layers", int),
                                         get("max_position_embeddings", int))
        dim, heads = get("hidden_size", int), get("num_attention_heads", int)
        head_dim = get("head_dim", int, dim // heads or 1)
        cfg = ModelConfig(dim=dim, n_layers=get("num_hidden_layers", int), n_heads=heads,
                          head_dim=0 if head_dim * heads == dim else head_dim,
                          n_kv_heads=get("num_key_value_heads", int, heads),
                          max_seq_len=get("max_position_embeddings", int),
                          norm="rmsnorm", norm_eps=get("rms_norm_eps", float, 1e-6), activation="swiglu",
                          positions="rope", bias=bias, qkv_bias=qkv_bias, qk_norm=attention == QWEN3,
                          sliding_window=window, full_attention_every=every,
                          dropout=get("attention_dropout", float, 0.0),
                          **{"ffn_hidden": get("intermediate_size", int), **moe}, **rope)
    elif model_type == GPT2:
        hf_act = hf.get("activation_function", "gelu_new")  # absent means GPT-2's default, gelu_new
        activation = GPT2_ACTIVATIONS.get(hf_act) if isinstance(hf_act, str) else None
        if activation is None:
            raise KilnError(f"{source}: activation_function={hf_act!r} is not supported; expected one of "
                            f"{sorted(GPT2_ACTIVATIONS)}")
        for key, fine in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if get(key, bool, fine) != fine:
                raise KilnError(f"{source}: {key}={hf[key]!r} is not supported by kiln (expected {fine})")
        dim = get("n_embd", int)
        cfg = ModelConfig(dim=dim, n_layers=get("n_layer", int), n_heads=get("n_head", int),
                          ffn_hidden=get("n_inner", int, 4 * dim), max_seq_len=get("n_positions", int),
                          norm="layernorm", norm_eps=get("layer_norm_epsilon", float, 1e-5),
                          activation=activation, positions="learned", bias=True,
                          dropout=get("resid_pdrop", float, 0.1))
    else:
        raise KilnError(f"{source}: model_type={model_type!r} is not supported; kiln imports 'llama', "
                        f"'mistral', 'ministral', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe', 'qwen2_moe' and 'gpt2'")
    cfg.vocab_size = get("vocab_size", int)
    # An absent key means the transformers class default: untied for Llama, tied for GPT-2.
    cfg.tie_embeddings = get("tie_word_embeddings", bool, model_type == GPT2)
    return cfg


def _sliding_windows(hf: dict, source: str, model_type: str, n_layers: int, context: int) -> tuple[int, int]:
    """(model.sliding_window, model.full_attention_every) of an HF config, as transformers reads it:
    Mistral windows every layer whenever `sliding_window` is set (its layer_types are ignored);
    Ministral names each layer's kind in `layer_types` (default: all windowed); Qwen2/Qwen3 window
    only with `use_sliding_window`, the layers in `layer_types` or else those from
    `max_window_layers` on. A window at least the context is full attention. Patterns kiln has no
    key for (global layers other than every k-th one) are refused, naming the key."""
    if model_type == LLAMA:
        return 0, 0
    window = hf.get("sliding_window")
    if model_type in (QWEN2, QWEN3) and not hf.get("use_sliding_window"):
        window = None
    if window is not None and (type(window) is not int or window < 1):
        raise KilnError(f"{source}: sliding_window={window!r}; expected a positive integer or null")
    layer_types = hf.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != n_layers
                                    or any(kind not in (SLIDING, FULL) for kind in layer_types)):
        raise KilnError(f"{source}: layer_types={layer_types!r}; expected a list of {n_layers} layer kinds, "
                        f"each {SLIDING!r} or {FULL!r}")
    if window is None or window >= context:
        return 0, 0
    key = "layer_types"
    if model_type == MISTRAL or (layer_types is None and model_type == MINISTRAL):
        local = [True] * n_layers
    elif layer_types is None:  # Qwen2/Qwen3: the first max_window_layers layers stay global
        key, first = "max_window_layers", hf.get("max_window_layers", 28)
        if type(first) is not int or first < 0:
            raise KilnError(f"{source}: max_window_layers={first!r}; expected an integer >= 0")
        local = [i >= first for i in range(n_layers)]
    else:
        local = [kind == SLIDING for kind in layer_types]
    if not any(local):
        return 0, 0
    every = 0 if all(local) else local.index(False) + 1
    if local != [not every or i % every != every - 1 for i in range(n_layers)]:
        full = [i for i, lo in enumerate(local) if not lo]
        raise KilnError(f"{source}: {key}={hf.get(key)!r} makes layers {full} global among sliding-window ones; "
                        f"kiln keeps every k-th layer global (model.full_attention_every) and no other pattern")
    return window, every


# HF rope_type -> kiln model.rope_scaling, and the HF keys each reads: (kiln field, default when
# absent: REQUIRED, CONTEXT (a top-level original_max_position_embeddings, else
# max_position_embeddings, as transformers falls back), or a value, which export then leaves out).
REQUIRED, CONTEXT = object(), object()
_ORIGINAL = {"original_max_position_embeddings": ("rope_original_max_seq_len", CONTEXT)}
ROPE_TYPES = {
    "default": ("none", {}),
    "linear": ("linear", {"factor": ("rope_scaling_factor", REQUIRED)}),
    "llama3": ("llama3", {"factor": ("rope_scaling_factor", REQUIRED),
                          "low_freq_factor": ("rope_low_freq_factor", REQUIRED),
                          "high_freq_factor": ("rope_high_freq_factor", REQUIRED), **_ORIGINAL}),
    "yarn": ("yarn", {"factor": ("rope_scaling_factor", REQUIRED), **_ORIGINAL,
                      "beta_fast": ("rope_yarn_beta_fast", 32.0), "beta_slow": ("rope_yarn_beta_slow", 1.0),
                      "attention_factor": ("rope_attention_factor", 0.0)}),
}
# transformers keys kiln's RoPE does not implement, and the value that means "not used" (absent
# or null means that too). mscale / mscale_all_dim change YaRN's attention factor only together.
ROPE_UNSUPPORTED = {"partial_rotary_factor": 1.0, "truncate": True}


def _rope_from_hf(hf: dict, source: str) -> dict:
    """kiln's rope_* ModelConfig fields from an HF config: transformers >= 5 writes
    `rope_parameters` (theta inside), older versions `rope_scaling` and a top-level `rope_theta`."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None:
            if not isinstance(hf[key], dict):
                raise KilnError(f"{source}: {key} must be an object")
            rope = {k: v for k, v in hf[key].items() if k not in ("type", "rope_theta")}
            found[key] = {**rope, "rope_type": hf[key].get("rope_type", hf[key].get("type", "default"))}
    if len(found) == 2 and found["rope_parameters"] != found["rope_scaling"]:
        raise KilnError(f"{source}: rope_parameters and rope_scaling disagree ({found['rope_parameters']} vs "
                        f"{found['rope_scaling']}); keep one")
    key = next(iter(found), "rope_parameters")
    rope = hf.get(key) or {}
    rope_type = found.get(key, {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise KilnError(f"{source}: {key}.rope_type={rope_type!r} (RoPE scaling) is not supported by kiln; "
                        f"expected one of {sorted(ROPE_TYPES)}")
    for where, values in ((f"{key}.", rope), ("", hf)):
        for name, unused in ROPE_UNSUPPORTED.items():
            if values.get(name) is not None and values[name] != unused:
                raise KilnError(f"{source}: {where}{name}={values[name]!r} is not supported by kiln's RoPE; "
                                f"expected {unused!r} or none")
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        raise KilnError(f"{source}: {key}.mscale={rope['mscale']!r} with mscale_all_dim={rope['mscale_all_dim']!r} "
                        f"(DeepSeek's YaRN attention factor) is not supported by kiln; set attention_factor instead")
    get, get_rope = _getter(hf, source), _getter(rope, f"{source}: {key}")
    scaling, fields = ROPE_TYPES[rope_type]
    out = {"rope_scaling": scaling,
           "rope_theta": get_rope("rope_theta", float, get("rope_theta", float, 10000.0))}
    for theirs, (ours, default) in fields.items():
        kind = int if ours == "rope_original_max_seq_len" else float
        if default is REQUIRED:
            default = _MISSING
        elif default is CONTEXT:
            default = get(theirs, kind, get("max_position_embeddings", kind))
        out[ours] = get_rope(theirs, kind, default)
    return out


_MISSING = object()


def _getter(hf: dict, source: str) -> Callable:
    """get(key, kind, default): a typed config.json value (ints positive, floats >= 0) or one clear error."""
    def get(key: str, kind: type, default=_MISSING):
        value = hf.get(key, default)
        if value is _MISSING:
            raise KilnError(f"{source}: {key} is missing; expected a positive {kind.__name__}")
        if value is None and default is not _MISSING:
            value = default  # HF writes null for "use the default"
        if kind is float and type(value) is int:
            value = float(value)
        ok = type(value) is kind and (kind is bool or (value > 0 if kind is int else value >= 0))
        if not ok:
            wanted = ("true or false" if kind is bool
                      else f"a {'positive' if kind is int else 'non-negative'} {kind.__name__}")
            raise KilnError(f"{source}: {key}={value!r}; expected {wanted}")
        return value
    return get


def _require(hf: dict, source: str, key: str, wanted: object, why: str) -> None:
    if hf.get(key, wanted) != wanted:
        raise KilnError(f"{source}: {key}={hf[key]!r} is not supported ({why}); expected {wanted!r}")


# Non-parameter tensors some older checkpoints carry (causal masks, RoPE frequencies).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


@dataclass
class HFTensor:
    """One tensor of an HF checkpoint: shape and dtype from the file header, data read by `load`."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype name (F32, BF16, ...)
    load: Callable[[], torch.Tensor]


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
Loader = Callable[[], torch.Tensor]


def from_hf_state(hf_tensors: dict[str, HFTensor], cfg: ModelConfig, expected: dict[str, torch.Size],
                  source: str) -> dict[str, Loader]:
    """HF tensors -> kiln state-dict name -> loader of the fp32 tensor in kiln's layout.

    Every tensor's presence, shape and dtype is checked from the headers before any data is read;
    `expected` is kiln's state-dict shapes for `cfg` (from a model on the meta device). A tied
    output head is left out (the model ties it to the embedding).
    """
    gpt2 = cfg.positions == "learned"
    if gpt2:
        # GPT-2 checkpoints come with and without the "transformer." prefix.
        hf_tensors = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
                      for k, v in hf_tensors.items()}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], change: Callable = lambda t: t) -> Loader:
        ref = hf_tensors.get(name)
        if ref is None:
            raise KilnError(f"{source}: tensor {name} is missing")
        if tuple(ref.shape) != tuple(shape):
            raise KilnError(f"{source}: tensor {name} has shape {list(ref.shape)}; expected {list(shape)}")
        if ref.dtype not in FLOAT_DTYPES:
            raise KilnError(f"{source}: tensor {name} has dtype {ref.dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
        used.add(name)
        return lambda: change(ref.load().float()).contiguous()

    out: dict[str, Loader] = {}
    if not gpt2:
        for ours, hf in _llama_names(cfg).items():
            out[ours] = take(hf, expected[ours])
        for i in range(cfg.n_layers) if cfg.moe_experts else ():
            if uses_moe(cfg, i):
                out.update(hf_moe.experts_from_hf(take, hf_moe.family_of(cfg), i, expected))
    else:
        # Inverse of to_hf_state's GPT-2 branch.
        for ours, hf in (("tok_embeddings.weight", "wte.weight"), ("pos_embeddings.weight", "wpe.weight"),
                         ("norm.weight", "ln_f.weight"), ("norm.bias", "ln_f.bias")):
            out[ours] = take("transformer." + hf, expected[ours])
        if not cfg.tie_embeddings:
            out["output.weight"] = take("lm_head.weight", expected["output.weight"])
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
                for kind in ("weight", "bias"):
                    out[f"{p}{ours}.{kind}"] = take(f"{h}{theirs}.{kind}", expected[f"{p}{ours}.{kind}"])
            sizes = [expected[p + f"attention.{w}.weight"][0] for w in ("wq", "wk", "wv")]
            starts = [0, sizes[0], sizes[0] + sizes[1]]
            for w, start, size in zip(("wq", "wk", "wv"), starts, sizes):
                # c_attn is (dim, q|k|v) in Conv1D layout: take the columns, then transpose.
                out[p + f"attention.{w}.weight"] = take(h + "attn.c_attn.weight", (cfg.dim, sum(sizes)),
                                                        lambda t, a=start, n=size: t[:, a:a + n].t())
                out[p + f"attention.{w}.bias"] = take(h + "attn.c_attn.bias", (sum(sizes),),
                                                      lambda t, a=start, n=size: t[a:a + n])
            for ours, theirs in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                                 ("feed_forward.w2", "mlp.c_proj")):
                shape = expected[p + ours + ".weight"]
                out[p + ours + ".weight"] = take(h + theirs + ".weight", (shape[1], shape[0]), torch.t)
                out[p + ours + ".bias"] = take(h + theirs + ".bias", expected[p + ours + ".bias"])
    if cfg.tie_embeddings:
        used.update(k for k in hf_tensors if k == "lm_head.weight")  # a tied head stored anyway
    extra = sorted(k for k in hf_tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise KilnError(f"{source}: tensor {extra[0]} has no place in a kiln {cfg.positions}-position model"
                        f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
    return out

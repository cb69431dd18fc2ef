"""Build the optimizer named by `OptimConfig`: param groups with weight decay on matrices only,
torch's AdamW / SGD, or kiln's Adafactor / LAMB / Lion / Muon (kiln/train/optimizers/).

Every group carries `name` (for logs and tests) and `initial_lr`, its peak lr (optim.lr, or
optim.muon_adam_lr for muon's AdamW part): torch's convention, the key torch's own LRScheduler
keeps. `LRSchedule` is the only writer of `group["lr"]`, computed from `initial_lr`. The config
is validated once, by `OptimConfig.validate` at load time; nothing here re-checks its ranges.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln import torch_compat
from kiln.config import OptimConfig
from kiln.errors import ConfigError, KilnError
from kiln.train.optimizers import Adafactor, Lamb, Lion, Muon
from kiln.train.optimizers.adam_state import fused_adam_supported

__all__ = ["build_optimizer", "param_groups", "adamw_implementation"]

# Whether torch's fused AdamW beats its foreach AdamW per device type, for `implementation=auto`.
# cpu: measured by benchmarks/optimizer_step.py (results/optimizer_step.json) on a ~17M-parameter
# transformer; cuda: fused is torch's own recommendation and torchtitan's default.
FUSED_ADAMW_FASTER = {"cpu": True, "cuda": True}


def _embedding_param_ids(model: nn.Module) -> set[int]:
    ids = {
        id(p)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        for p in module.parameters(recurse=False)
    }
    # Under pp a tied model's last stage holds its own copy of the embedding as its head
    # (kiln/parallel/pipeline_tied.py): grouped as the embedding it copies, as in one process.
    copies = getattr(model, "tied_embedding_copies", None)
    return ids | {id(p) for p in copies()} if copies is not None else ids


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    # named_parameters() drops repeats of the same Parameter, so tied weights appear once
    # (under the first name that reaches them).
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise KilnError(f"{type(model).__name__} has no trainable parameters to optimize")
    return named


def _decays(p: nn.Parameter, embedding_ids: set[int], cfg: OptimConfig) -> bool:
    if id(p) in embedding_ids:
        return cfg.decay_embeddings
    if p.ndim < 2:
        return cfg.decay_norms_and_biases
    return True


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Split trainable params into a "decay" group (matrices, plus embeddings / norms and biases
    when the config asks) and a "no_decay" group; empty groups are left out."""
    embedding_ids = _embedding_param_ids(model)
    decay, no_decay = [], []
    for _, p in _trainable(model):
        (decay if _decays(p, embedding_ids, cfg) else no_decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": cfg.weight_decay, "initial_lr": cfg.lr},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, "initial_lr": cfg.lr},
    ]
    return [g for g in groups if g["params"]]


def _muon_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Hidden matrices -> "muon"; MoE experts' weight stacks (E, in, out) -> "muon_experts"
    (`stacked`: each expert's matrix orthogonalized on its own); embeddings, the LM head
    (`output`), norms, biases -> AdamW at optim.muon_adam_lr, split into "adamw_decay" /
    "adamw_no_decay"."""
    from kiln.model.moe import GroupedExperts

    embedding_ids = _embedding_param_ids(model)
    head_ids = {
        id(p)
        for name, module in model.named_modules()
        if name.split(".")[-1] == "output"
        for p in module.parameters(recurse=False)
    }
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
                  for p in m.parameters(recurse=False)}
    muon, experts, adam_decay, adam_no_decay = [], [], [], []
    for _, p in _trainable(model):
        if id(p) in expert_ids:
            experts.append(p)
        elif p.ndim >= 2 and id(p) not in embedding_ids and id(p) not in head_ids:
            muon.append(p)
        elif _decays(p, embedding_ids, cfg):
            adam_decay.append(p)
        else:
            adam_no_decay.append(p)
    groups = [
        {"name": "muon", "params": muon, "use_muon": True, "weight_decay": cfg.weight_decay,
         "initial_lr": cfg.lr},
        {"name": "muon_experts", "params": experts, "use_muon": True, "stacked": True,
         "weight_decay": cfg.weight_decay, "initial_lr": cfg.lr},
        {"name": "adamw_decay", "params": adam_decay, "use_muon": False,
         "weight_decay": cfg.weight_decay, "initial_lr": cfg.muon_adam_lr},
        {"name": "adamw_no_decay", "params": adam_no_decay, "use_muon": False, "weight_decay": 0.0,
         "initial_lr": cfg.muon_adam_lr},
    ]
    return [g for g in groups if g["params"]]


def adamw_implementation(cfg: OptimConfig, params: list[torch.Tensor], device_type: str) -> str:
    """Resolve optim.implementation to "fused", "foreach" or "single" for these params."""
    if len({isinstance(p, DTensor) for p in params}) > 1:
        # torch's fused and foreach kernels take one list of all-DTensor or all-plain tensors; DDP
        # with expert parallelism (experts DTensors, the rest plain) has both: one kernel per tensor.
        if cfg.implementation in ("fused", "foreach"):
            raise ConfigError(f"optim.implementation={cfg.implementation!r} cannot step DTensor and plain "
                              f"parameters together (parallel.ep with dp_mode='ddp'); use 'single' or 'auto'")
        return "single"
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if len(meshes) > 1 and not torch_compat.fused_adam_across_meshes():
        # one group over two meshes (ep's experts, tp's shards): torch before 2.9 cannot step them in
        # one kernel ("DTensor does not support cross-mesh operation yet"); one kernel per tensor
        if cfg.implementation in ("fused", "foreach"):
            raise ConfigError(f"optim.implementation={cfg.implementation!r} cannot step parameters on "
                              f"{len(meshes)} device meshes together with torch {torch.__version__} (it "
                              f"needs >= 2.9); use 'single' or 'auto'")
        return "single"
    if cfg.implementation == "fused":
        if not fused_adam_supported(params, device_type):
            dtypes = sorted({str(p.dtype) for p in params})
            raise ConfigError(
                f"optim.implementation='fused' is not supported by this torch for device "
                f"{device_type!r} with dtypes {dtypes}; use 'foreach' or 'auto'"
            )
        return "fused"
    if cfg.implementation in ("foreach", "single"):
        return cfg.implementation
    if fused_adam_supported(params, device_type) and FUSED_ADAMW_FASTER.get(device_type, True):
        return "fused"
    return "foreach"


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str = "cpu") -> torch.optim.Optimizer:
    """The optimizer for `model` (already materialized on its device) as `cfg` (validated)
    describes. The constructors' `lr` is only torch's placeholder until `LRSchedule` sets each
    group's lr from its `initial_lr`."""
    groups = _muon_param_groups(model, cfg) if cfg.name == "muon" else param_groups(model, cfg)
    betas = tuple(cfg.betas)

    if cfg.name == "adamw":
        params = [p for g in groups for p in g["params"]]
        impl = adamw_implementation(cfg, params, device_type)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                 fused=impl == "fused", foreach=impl == "foreach")
    if cfg.name == "adafactor":
        # torch's algorithm, also on sharded (DTensor) parameters. It has no first moment and sets
        # its own second-moment decay and epsilons; lr is its maximum relative step size and
        # weight decay is decoupled (lr * wd).
        return Adafactor(groups, lr=cfg.lr)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "lion":
        return Lion(groups, lr=cfg.lr, betas=betas)
    if cfg.name == "muon":
        return Muon(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True, betas=betas, eps=cfg.eps)
    if cfg.name == "sgd":
        # Note torch's SGD weight decay is L2 added to the gradient, not decoupled.
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    raise ValueError(f"optim.name={cfg.name!r}: validate the config first (OptimConfig.validate)")

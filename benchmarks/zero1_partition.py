"""ZeRO-1's fullest rank at scale: torch's ZeroRedundancyOptimizer partition (whole tensors, largest
first, group by group) against kiln's (kiln/parallel/zero1_partition.py `partition`: elementwise updates cut
to an even share per rank; whole tensors, largest first across every group, where the update reads
them whole), for AdamW (every tensor cut), Muon (its orthogonalized matrices whole, the rest cut)
and LAMB (nothing cut), on real kiln models of the configs' shapes, with kiln plan's prediction
(kiln/plan/memory.py zero1_fullest_share).

The models are built on the meta device (no memory) with kiln's param groups (`build_optimizer`),
and each ZeRO-1 is constructed once per rank of a process group faked in this process (torch's
testing "fake" backend: collectives are no-ops), so each rank's ZeRO holds exactly its partition;
a rank's share of the optimizer state is its share of the elements. Prints the fullest rank's
state as a multiple of the even share (1 / ranks) and writes results/zero1_partition.json. The
prediction lists every tensor kiln's model has (biases, norms and QK-norm gains included, since
28 Nov; before, it left GPT-2's biases out).

    python benchmarks/zero1_partition.py [--configs configs/llama-1b.toml,configs/llama-7b.toml]
        [--ranks 8,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR, machine_info  # noqa: E402

from kiln.config import load_config  # noqa: E402
from kiln.model.transformer import Transformer  # noqa: E402
from kiln.parallel.zero1 import Zero1Optimizer  # noqa: E402
from kiln.plan.memory import Layout, ModelShape, zero1_fullest_share  # noqa: E402
from kiln.train.optim import build_optimizer  # noqa: E402

KILN_OPTIMIZERS = ("adamw", "muon", "lamb")


def _optimizer(model: torch.nn.Module, cfg, name: str) -> torch.optim.Optimizer:
    opt_cfg = dataclasses.replace(cfg.optim, name=name, implementation="foreach")  # fused takes no meta tensors
    return build_optimizer(model, opt_cfg, "cpu")


def fullest_share(model: torch.nn.Module, cfg, ranks: int, partition: str = "adamw") -> float:
    """The fullest rank's elements / all elements of `model`'s ZeRO-1 over `ranks`: kiln's
    (`Zero1Optimizer`) of kiln's `partition` optimizer (adamw, muon, lamb, ...), or "torch":
    torch's ZeroRedundancyOptimizer of kiln's param groups (tests/plan/test_zero1_partition.py
    checks kiln plan's rule with it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    held = []
    for rank in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            if partition == "torch":
                groups = _optimizer(model, cfg, "sgd").param_groups
                local = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.SGD, lr=1e-3).optim
            else:
                local = Zero1Optimizer(_optimizer(model, cfg, partition), dist.group.WORLD).dense.optim
            held.append(sum(p.numel() for g in local.param_groups for p in g["params"]))
        finally:
            dist.destroy_process_group()
    assert sum(held) == sum(p.numel() for p in model.parameters())  # every element on exactly one rank
    return max(held) / sum(held)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="configs/llama-1b.toml,configs/llama-7b.toml")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--out", default=str(RESULTS_DIR / "zero1_partition.json"))
    args = ap.parse_args(argv)
    rows = []
    print("| config | params | ranks | torch's partition | kiln's, AdamW | Muon | LAMB | kiln plan predicts "
          "(AdamW / Muon / LAMB) | largest tensor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.configs.split(","):
        cfg = load_config(path, [])
        if not cfg.model.vocab_size:
            sys.exit(f"zero1_partition: error: {path}: model.vocab_size is not set (a run takes it from "
                     "the tokenizer); give a config that sets it")
        with torch.device("meta"):
            model = Transformer(cfg.model)
        n = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters()) / n
        shape = ModelShape.from_config(cfg.model, cfg.model.vocab_size)
        for ranks in (int(r) for r in args.ranks.split(",")):
            layout = Layout(dp_replicate=ranks, dp_mode="zero1")
            row = dict(config=path, params=n, ranks=ranks, torch=fullest_share(model, cfg, ranks, "torch") * ranks,
                       largest_tensor=largest * ranks)
            for name in KILN_OPTIMIZERS:
                row[name] = fullest_share(model, cfg, ranks, name) * ranks
                row[f"predicted_{name}"] = zero1_fullest_share(shape, layout, optimizer=name) * ranks
            rows.append(row)
            predicted = " / ".join(f"{row[f'predicted_{name}']:.2f}" for name in KILN_OPTIMIZERS)
            print(f"| {path} | {n / 1e9:.2f}B | {ranks} | {row['torch']:.2f} x | "
                  + " | ".join(f"{row[name]:.2f} x" for name in KILN_OPTIMIZERS)
                  + f" | {predicted} | {row['largest_tensor']:.2f} x |")
    Path(args.out).write_text(json.dumps({"rows": rows, "unit": "fullest rank's optimizer state / the even share",
                               "command": "python " + " ".join(sys.argv), "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

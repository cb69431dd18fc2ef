"""Expert parallelism's token exchange, one MoE layer, on `--ep` gloo ranks of this machine: kiln's
dispatch (kiln/parallel/functional.py `dispatch_and_combine`: a token goes once to each rank
holding one of its experts, that rank returns the token's gated sum over them) against sending one
row per (token, expert) assignment and weighting the returned rows at home (what kiln ran before;
the baseline is kept here, in `per_assignment`).

Per case (top-k of E experts, optionally group-limited: G groups, M chosen per token; dropless, --tokens tokens per rank of width --dim, the layer's
weights and inputs drawn alike on every rank, router random: choices close to uniform), forward +
backward of kiln's MoE layer, both exchanges taking turns going first:
- rows and bytes one rank sends to the other ranks in the forward exchange (counted at the
  all-to-all calls, its own share left out; the backward sends the same again),
- the slowest rank's wall time, median over --rounds after a warm-up round,
- the largest difference of the outputs and input / router / expert gradients, relative to their
  largest value (the benchmark fails above 1e-5: the same sums in another order).
With `--node-ranks L` the ranks form nodes of L, kiln's two-level exchange (parallel.ep_node_ranks:
once per node across, fanned out inside) runs as a third variant, and the rows that leave a node
are counted too.

    python benchmarks/ep_dispatch.py [--ep 4] [--cases k2e8,k4e16,k8e64,k8e64g4m2] [--rounds 5] [--node-ranks 2]

Writes benchmarks/results/ep_dispatch.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import join_gloo, print_table, run_ranks, write_results  # noqa: E402

VARIANTS = ("kiln", "per_assignment")


def parse(case: str) -> tuple[int, int, int, int]:
    """"k8e64" (top-8 of 64 experts) or "k8e64g4m2" (group-limited: 4 groups, 2 per token)."""
    head, _, tail = case.partition("g")
    k, experts = head[1:].split("e")
    groups, topk_groups = tail.split("m") if tail else (1, 1)
    return int(k), int(experts), int(groups), int(topk_groups)


def per_assignment(x, token, gate, counts, experts, group, node_groups=None):
    """The baseline: every kept assignment's row goes to its expert's rank and comes back as it
    is; the gates weight them at home."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from kiln.parallel.functional import _expert_outputs

    ep, n_local = dist.get_world_size(group), experts.n_local
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    recv_matrix = counts_in.view(ep, n_local)
    send, recv = torch.stack([counts.view(ep, n_local).sum(1), recv_matrix.sum(1)]).tolist()
    sent = sum(send)
    received = funcol.all_to_all_single_autograd(x[token[:sent]], recv, send, group)
    out = _expert_outputs(received, counts_in, recv_matrix.sum(0), experts)
    back = funcol.all_to_all_single_autograd(out, send, recv, group)
    weighted = back * gate[:sent, None].to(back.dtype)
    return back.new_zeros(x.shape[0], back.shape[1]).index_add(0, token[:sent], weighted)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from kiln.config import ModelConfig
    from kiln.model.moe import MoE
    from kiln.parallel import functional
    from kiln.parallel.expert_parallel import apply_expert_parallel

    join_gloo(rank, world, port)
    node_groups, variants = None, VARIANTS
    if args.node_ranks > 1:  # kiln's groups for a two-level dispatch (ranks // node_ranks = "node")
        from kiln.config import ParallelConfig
        from kiln.parallel.dims import ParallelDims

        dims = ParallelDims.from_config(ParallelConfig(ep=world, ep_node_ranks=args.node_ranks), world_size=world,
                                        rank=rank, local_rank=rank, local_world_size=world)
        dims.build_mesh("cpu")
        node_groups, variants = dims.expert_node_groups, VARIANTS + ("two_level",)
    sent = {"rows": 0, "bytes": 0, "node_rows": 0}
    real_autograd, real_plain = funcol.all_to_all_single_autograd, dist.all_to_all_single

    def others(t, splits, group):  # what leaves this rank: its own share stays
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = t.shape[0] - (splits[me] if splits is not None else t.shape[0] // size)
        return rows, rows * t[:1].numel() * t.element_size()

    def counted_autograd(t, output_split_sizes, input_split_sizes, group, *a, **k):
        rows, size = others(t, input_split_sizes, group)
        if t.dim() == 2 and t.shape[1] == args.dim:  # token rows; index / gate: bytes only
            sent["rows"] += rows
            if args.node_ranks > 1:  # the rows that leave this rank's node
                members = dist.get_process_group_ranks(group)
                sent["node_rows"] += sum(n for n, g in zip(input_split_sizes, members)
                                         if g // args.node_ranks != rank // args.node_ranks)
        sent["bytes"] += size
        return real_autograd(t, output_split_sizes, input_split_sizes, group, *a, **k)

    def counted_plain(output, t, output_split_sizes=None, input_split_sizes=None, group=None, *a, **k):
        sent["bytes"] += others(t, input_split_sizes, group)[1]
        return real_plain(output, t, output_split_sizes, input_split_sizes, group, *a, **k)

    funcol.all_to_all_single_autograd, dist.all_to_all_single = counted_autograd, counted_plain
    kiln_dispatch = functional.dispatch_and_combine
    rows = []
    for case in args.cases.split(","):
        k, n_experts, groups, topk_groups = parse(case)
        cfg = ModelConfig(vocab_size=256, dim=args.dim, n_layers=1, n_heads=4, max_seq_len=args.tokens,
                          moe_experts=n_experts, moe_top_k=k, moe_capacity_factor=0.0, moe_groups=groups,
                          moe_topk_groups=topk_groups)
        layer = MoE(cfg, args.hidden)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        apply_expert_parallel(layer, dist.group.WORLD)
        x = torch.randn(world, 1, args.tokens, args.dim, generator=gen)[rank]

        def call():
            inputs = x.clone().requires_grad_()
            output = layer(inputs)
            output.square().mean().backward()
            grads = [inputs.grad, layer.router.weight.grad.clone(), layer.experts.w1.grad.clone()]
            layer.zero_grad()
            return [output.detach(), *grads]

        times = {name: [] for name in variants}
        results, counts = {}, {}
        for round_ in range(args.rounds + 1):  # the first round warms up
            turn = round_ % len(variants)
            for name in variants[turn:] + variants[:turn]:
                functional.dispatch_and_combine = per_assignment if name == "per_assignment" else kiln_dispatch
                layer.ep_node_groups = node_groups if name == "two_level" else None
                sent.update(rows=0, bytes=0, node_rows=0)
                dist.barrier()
                start = time.perf_counter()
                results[name] = call()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
                counts[name] = dict(sent)
        functional.dispatch_and_combine = kiln_dispatch
        difference = max(((a - b).abs().max() / b.abs().max()).item() for name in variants[1:]
                         for a, b in zip(results[name], results["kiln"]))
        rows.append({"case": case, "top_k": k, "experts": n_experts, "experts_per_rank": n_experts // world,
                     "groups": groups, "topk_groups": topk_groups,
                     **{f"{name}_{key}": value for name in variants for key, value in counts[name].items()},
                     **{f"{name}_s": statistics.median(times[name][1:]) for name in variants},
                     "max_difference": difference})
    dist.destroy_process_group()
    out.put((rank, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--cases", default="k2e8,k4e16,k8e64,k8e64g4m2")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--node-ranks", type=int, default=0,
                        help="ranks per simulated node: adds kiln's two-level exchange and counts rows leaving a node")
    parser.add_argument("--out", default="ep_dispatch")
    args = parser.parse_args(argv)
    if args.node_ranks > 1 and (args.ep % args.node_ranks or args.node_ranks == args.ep):
        raise SystemExit(f"--node-ranks {args.node_ranks} must divide --ep {args.ep} into 2 or more nodes")
    for case in args.cases.split(","):
        k, n_experts, groups, topk_groups = parse(case)
        if n_experts % args.ep or n_experts % groups or not 0 < k <= topk_groups * n_experts // groups:
            raise SystemExit(f"--cases {case}: --ep {args.ep} and the groups must divide the {n_experts} experts, "
                             f"top-k at most the chosen groups' experts")
    target = importlib.import_module(Path(__file__).stem)._rank  # by module name: spawned ranks import it
    by_rank = dict(run_ranks(target, args.ep, (args,), "ep_dispatch"))
    variants = VARIANTS + (("two_level",) if args.node_ranks > 1 else ())
    rows = by_rank[0]  # times: the slowest rank's; rows and bytes: rank 0's, and summed over ranks
    for i, row in enumerate(rows):
        for name in variants:
            for key in ("rows", "bytes", "node_rows"):
                row[f"{name}_{key}_all_ranks"] = sum(by_rank[r][i][f"{name}_{key}"] for r in by_rank)
        worst = max(by_rank[r][i]["max_difference"] for r in by_rank)
        if worst > 1e-5:
            raise SystemExit(f"{row['case']}: an exchange differs from kiln's by {worst:.2e} (relative)")
    names = " / ".join(v.replace("_", "-") for v in variants)
    headers = ["case", "experts / rank", f"rows sent (all ranks) {names}", f"MB sent {names}", f"s {names}"]
    if args.node_ranks > 1:
        headers.insert(3, f"rows leaving a node {names}")
    table = []
    for r in rows:
        cells = [r["case"], r["experts_per_rank"], " / ".join(str(r[f"{v}_rows_all_ranks"]) for v in variants),
                 " / ".join(f"{r[f'{v}_bytes_all_ranks'] / 1e6:.2f}" for v in variants),
                 " / ".join(f"{r[f'{v}_s']:.3f}" for v in variants)]
        if args.node_ranks > 1:
            cells.insert(3, " / ".join(str(r[f"{v}_node_rows_all_ranks"]) for v in variants))
        table.append(cells)
    print_table(headers, table)
    command = "python benchmarks/ep_dispatch.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, **vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

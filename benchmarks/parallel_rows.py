"""The layouts benchmarks/parallel_memory.py measures: one `Row` per (strategy, process count),
each a set of kiln config overrides on top of the benchmark's model, and `--only` selection.

Kinds: "dp" rows run the data-parallel step the script writes out (forward, backward, optimizer
step; memory split by part), "mp" rows (tp / cp / pp) run the trainer's own step on the whole batch
(no data parallelism: time and traffic; the `ddp_pp2_*` rows: each of 2 ddp replicas of a pp=2
pipeline on its half), "diloco" rows the dp step with no gradient reduction and
DiLoCo's outer sync every `diloco_inner_steps` steps (kiln/parallel/diloco.py).
Families: "dense" (the benchmark model; reference row `single`), "muon", "lamb" and "adafactor"
(the benchmark model with that optimizer, reference row `<name>_single`: ddp and zero1 x tp 2
at 4), "moe" (the same model with
every FFN a mixture of experts of the same total FFN parameters; reference row `moe_single`) and
"deep" (the same model with `DEEP_LAYERS` layers and untied embeddings, for the pipelines with 2
stages per rank at 4 processes that need more layers than the benchmark model has; reference row
`deep_single`, 1 process). Only those pipeline rows use the deep model: the other pipeline rows
stay on the benchmark model, comparable with its earlier measurements and with kiln plan's
validation (benchmarks/plan_validation.py validates the dense family only).
"""

from __future__ import annotations

from dataclasses import dataclass

MOE_EXPERTS, MOE_TOP_K, EP = 4, 2, 2
MOE_DESC = f"every FFN {MOE_EXPERTS} experts of 1/{MOE_EXPERTS} the hidden units, top-{MOE_TOP_K}"
PP_MAX, VIRTUAL = 4, 2  # the largest pipeline measured; stages per rank of the multi-stage schedules
DEEP_LAYERS = PP_MAX * VIRTUAL  # one layer per stage at the largest pipeline
# Optimizers whose update reads a whole tensor: ZeRO-1 x tp steps their tp shards as DTensors
# (kiln/parallel/zero1.py); each its own family (its 1-process row the reference).
WHOLE_TENSOR = ("muon", "lamb", "adafactor")
# Schedules with VIRTUAL stages per rank (ZBV places its 2 as a V); gpipe and 1f1b hold one.
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


@dataclass(frozen=True)
class Row:
    mode: str  # the name in the results file's "runs" ("single" is its own entry)
    world: int
    kind: str  # dp | mp | diloco
    overrides: tuple[str, ...]  # kiln config overrides for this layout
    family: str = "dense"  # dense | moe
    shard: int = 1  # ranks the sharded parts are split over (ideal bytes = single's / shard)
    sharded: tuple[str, ...] = ()  # which of params, grads, optimizer this layout shards

    @property
    def name(self) -> str:
        return f"{self.mode}@{self.world}"

    @property
    def reference(self) -> str:
        """The single-process row of this row's model, timed in the same run for the ratio."""
        return "single@1" if self.family == "dense" else f"{self.family}_single@1"


ALL = ("params", "grads", "optimizer")


def pipeline(schedule: str, n: int, virtual: int = 1) -> tuple[str, ...]:
    # Untied embeddings: kiln refuses to split tied ones over stages. 2 micro-batches per stage.
    return (f"parallel.pp={n}", f"parallel.pp_schedule='{schedule}'", f"parallel.pp_virtual_stages={virtual}",
            f"parallel.pp_microbatches={2 * n}", "model.tie_embeddings=false", "parallel.dp_mode='ddp'")


def rows(dim: int, heads: int, layers: int, seq: int, moe_hidden: int, diloco_steps: int) -> list[Row]:
    """Every layout, in measuring order; those the model cannot take (tp not dividing the heads,
    cp not dividing the sequence into 2 cp chunks) are left out here and named by `unsupported`.
    Pipelines of VIRTUAL stages per rank with more stages than layers run on the deep model."""
    moe = (f"model.moe_experts={MOE_EXPERTS}", f"model.moe_top_k={MOE_TOP_K}", f"model.ffn_hidden={moe_hidden}")
    deep = (f"model.n_layers={max(layers, DEEP_LAYERS)}",)
    out = [Row("single", 1, "dp", ("parallel.dp_mode='ddp'",)),
           Row("moe_single", 1, "dp", ("parallel.dp_mode='ddp'",) + moe, "moe")]
    for n in (2, 4):
        out += [Row("ddp", n, "dp", ("parallel.dp_mode='ddp'",)),
                Row("zero1", n, "dp", ("parallel.dp_mode='zero1'",), shard=n, sharded=("optimizer",)),
                Row("zero2", n, "dp", ("parallel.dp_mode='zero2'",), shard=n, sharded=ALL),
                Row("fsdp", n, "dp", ("parallel.dp_mode='fsdp'",), shard=n, sharded=ALL)]
        if n == 4:  # FSDP resharded to 2 of the 4 ranks after forward (ZeRO++'s hpZ): backward gathers over 2
            out.append(Row("fsdp_reshard2", n, "dp", ("parallel.dp_mode='fsdp'", "parallel.fsdp_reshard_to=2"),
                           shard=n, sharded=ALL))
        if n == 4:  # HSDP: 2 replicas of a model sharded over 2 ranks each
            out.append(Row("hsdp", n, "dp", ("parallel.dp_mode='fsdp'", "parallel.dp_replicate=2",
                                             "parallel.dp_shard=2"), shard=2, sharded=ALL))
        out += [Row("moe_fsdp", n, "dp", ("parallel.dp_mode='fsdp'",) + moe, "moe", n, ALL),
                Row("moe_ep", n, "dp", ("parallel.dp_mode='fsdp'", f"parallel.ep={EP}") + moe, "moe", n, ALL)]
        if n == 4:  # ep2 x tp2 (dp_shard 2): experts sharded over tp (etp = tp) vs whole, ep borrowing tp (etp = 1)
            ep_tp = ("parallel.dp_mode='fsdp'", f"parallel.ep={EP}", "parallel.tp=2") + moe
            out += [Row("moe_ep_tp", n, "dp", ep_tp, "moe", n, ALL),
                    Row("moe_ep_tp_etp1", n, "dp", ep_tp + ("parallel.etp=1",), "moe", n, ALL)]
        if n == 2:
            out.append(Row("diloco", n, "diloco", ("parallel.dp_mode='ddp'",
                                                   f"parallel.diloco_inner_steps={diloco_steps}")))
        if n == 4:  # 2 replicas of DDP over 2 ranks: each rank sends half its parameters across
            out.append(Row("diloco_ddp", n, "diloco", ("parallel.dp_mode='ddp'", "parallel.dp_replicate=2",
                                                       f"parallel.diloco_inner_steps={diloco_steps}")))
        # tp must divide the heads: the 6-head benchmark model runs tp=4 with 8 heads (the same
        # parameters and FLOPs: attention's weights and work depend on dim, not on the head count).
        tp_heads = n * -(-heads // n)
        if dim % tp_heads == 0 and (dim // tp_heads) % 2 == 0:  # RoPE needs an even head size
            out.append(Row("tp", n, "mp", (f"parallel.tp={n}", "parallel.dp_mode='ddp'")
                           + ((f"model.n_heads={tp_heads}",) if tp_heads != heads else ())))
        if n == 4 and heads % 2 == 0:  # 2 replicas (ddp or zero1) of a tp=2 model, each on its half
            out += [Row(f"{m}_tp", n, "mp", ("parallel.tp=2", f"parallel.dp_mode='{m}'")) for m in ("ddp", "zero1")]
            out += [Row(f"{m}_tp_{o}", n, "mp", ("parallel.tp=2", f"parallel.dp_mode='{m}'", f"optim.name='{o}'"), o)
                    for o in WHOLE_TENSOR for m in ("ddp", "zero1")]
        if seq % (2 * n) == 0:
            out.append(Row("cp", n, "mp", (f"parallel.cp={n}", "parallel.dp_mode='ddp'")))
        out += [Row(f"pp_{s}", n, "mp", pipeline(s, n)) for s in ("gpipe", "1f1b") if n <= layers]
        for s in MULTI_STAGE:  # on the deep model where the benchmark model has too few layers
            if VIRTUAL * n <= layers:
                out.append(Row(f"pp_{s}", n, "mp", pipeline(s, n, VIRTUAL)))
            else:
                out.append(Row(f"pp_{s}", n, "mp", pipeline(s, n, VIRTUAL) + deep, "deep"))
        if n == 4 and VIRTUAL * 2 <= layers:  # 2 ddp replicas of a pp=2 pipeline, 2 stages per rank
            out += [Row(f"ddp_pp2_{s}", n, "mp", pipeline(s, 2, VIRTUAL)) for s in MULTI_STAGE]
    for o in WHOLE_TENSOR:
        if any(r.family == o for r in out):
            out.insert(2, Row(f"{o}_single", 1, "dp", ("parallel.dp_mode='ddp'", f"optim.name='{o}'"), o))
    if any(r.family == "deep" for r in out):  # 1 process, untied like the pipelines
        out.insert(2, Row("deep_single", 1, "dp", ("parallel.dp_mode='ddp'", "model.tie_embeddings=false") + deep,
                          "deep"))
    return out


def unsupported(dim: int, heads: int, layers: int, seq: int) -> list[str]:
    """Layouts of the issue that `rows` leaves out for this model, and why."""
    all_rows = {r.name for r in rows(dim, heads, layers, seq, 1, 1)}
    wanted = {"tp@4": "no head count divisible by 4 with an even head size divides dim",
              "cp@4": "cp=4 needs seq divisible by 8"}
    return [f"{name}: {why}" for name, why in wanted.items() if name not in all_rows]


def select(all_rows: list[Row], only: str, worlds: list[int]) -> list[Row]:
    """Rows named by `only` (comma list of MODE or MODE@N; empty: every row) within `worlds`,
    plus the single-process reference row of each selected family. ValueError names an unknown one."""
    chosen = [r for r in all_rows if r.world in worlds or r.world == 1]
    if worlds != [1]:  # a model's 1-process row without any of its multi-process rows: nothing to compare
        families = {r.family for r in chosen if r.world > 1} | {"dense"}
        chosen = [r for r in chosen if r.family in families]
    if only:
        names = [s.strip() for s in only.split(",") if s.strip()]
        known = {r.mode for r in all_rows} | {r.name for r in all_rows}
        bad = [s for s in names if s not in known]
        if bad:
            raise ValueError(f"--only {','.join(bad)}: not a layout; choose from "
                             f"{', '.join(sorted(known))}")
        picked = [r for r in chosen if r.mode in names or r.name in names]
        refs = {r.reference for r in picked}
        chosen = [r for r in chosen if r in picked or r.name in refs]
    return chosen

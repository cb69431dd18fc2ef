"""Random [parallel] layouts against one process: a developer's fuzzer, not part of the test suite.

Each case draws a model and an optimizer, then two layouts of `--world` ranks that kiln accepts
for them (its own checks, run here first: `ParallelDims`, `check_model`, `check_pipeline_config`;
refused draws are drawn again and counted). It trains steps 1..3 in the first layout
(`torchrun -m kiln.cli train --stop-at 3`), continues steps 4..6 from that checkpoint in the
second (`kiln train --resume`), and holds every step's loss and grad norm to one process trained
6 steps on the same global batch: `train.global_batch_size` fixes it and each layout derives its
grad_accum. A quarter of the cases (with --world > 2) train DiLoCo (H = 2 or 3, or 4 streamed
in 2 fragments with or without a sync delay): both layouts
hold 2 replicas, and the reference is DiLoCo's own definition, 2 processes each one whole replica.
The corpus is kiln's sources cut into documents of 1-4 lines, some cases windowing them at
document starts or keeping attention inside each (data.windows). One line per case (OK; DIFF with the worst relative error; DRIFT where steps 1..3
agree and one process continuing the first layout's checkpoint lands where the second layout did,
so the checkpoint's last bits were amplified, not mis-laid-out; FAIL with the last error line;
REFUSED where a launch stopped on a one-line `kiln train: error`); exit status 1 if any case
differed or failed. Each case's run directories stay under --out.

    .venv/bin/python scripts/layout_fuzz.py --seed 1 --cases 20

Tolerance: fp32, relative 1e-4 per value (layouts reorder sums; Lion's sign and Muon's
orthogonalization amplify the last bits most: up to 9e-5 seen).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_AT, GLOBAL_BATCH, REL, N_LAYERS, DILOCO_REPLICAS = 6, 3, 8, 1e-4, 4, 2
BASE = {"model.dim": 32, "model.n_layers": N_LAYERS, "model.n_heads": 4, "data.tokenizer": "'byte'", "data.seq_len": 16,
        "model.max_seq_len": 64, "model.dropout": 0.0, "train.steps": STEPS, "train.eval_every": 0,
        "checkpoint.every": SAVE_AT, "checkpoint.async_save": "false", "train.dtype": "'fp32'",
        "train.device": "'cpu'", "metrics.progress": "'plain'", "metrics.peak_flops": 1e11,
        "schedule.warmup_steps": 0, "train.clip_grad_norm": 1.0, "train.global_batch_size": GLOBAL_BATCH}
ARCHS = {"llama": {}, "gqa": {"model.n_kv_heads": 2}, "qk_norm": {"model.qk_norm": "true", "model.qkv_bias": "true"},
         "window": {"model.sliding_window": 8, "model.full_attention_every": 2},
         "gpt2": {"model.positions": "'learned'", "model.norm": "'layernorm'", "model.bias": "true",
                  "model.activation": "'gelu'"}}
LR = {"sgd": 0.1, "lion": 0.001}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def draw_model(rng: random.Random) -> dict:
    m = {**ARCHS[rng.choice(sorted(ARCHS))], "model.tie_embeddings": rng.choice(["true", "false"])}
    if rng.random() < 0.3:  # dropless: capacity would depend on the tokens a rank routes
        m.update({"model.moe_experts": 4, "model.moe_top_k": rng.choice([1, 2]), "model.moe_capacity_factor": 0.0,
                  "model.moe_every": rng.choice([1, 2])})
    name = rng.choice(["adamw", "adamw", "sgd", "lion", "muon", "lamb", "adafactor"])
    m.update({"optim.name": f"'{name}'", "optim.lr": LR.get(name, 0.01), "train.batch_size": rng.choice([1, 2]),
              "train.activation_checkpointing": f"'{rng.choice(['none', 'full', 'selective'])}'",
              "train.loss": f"'{rng.choice(['full', 'chunked'])}'"})
    if rng.random() < 0.1:
        m["train.compile"] = "true"
    if rng.random() < 0.4:  # windows cut at document starts, or attention kept inside each document
        m["data.windows"] = f"'{rng.choice(['doc_start', 'packed_masked'])}'"
    return m


DEFAULTS = {"parallel.ep": 1, "parallel.etp": -1, "parallel.cp_mode": "'ring'", "parallel.ulysses_degree": 0,
            "parallel.ulysses_rounds": 1, "parallel.pp_schedule": "'1f1b'", "parallel.pp_virtual_stages": 1,
            "parallel.pp_microbatches": 0, "parallel.pp_split_points": "[]", "parallel.fsdp_reshard_to": 0,
            "parallel.dp_mode": "'auto'"}


def draw_layout(rng: random.Random, world: int, moe: bool) -> dict:
    degrees = [1, 1, 1, 1, 1]  # dp_replicate, dp_shard, tp, pp, cp: world's factors dealt at random
    left = world
    while left > 1:
        f = 2 if left % 2 == 0 else left
        degrees[rng.randrange(5)] *= f
        left //= f
    rep, shard, tp, pp, cp = degrees
    p = {"parallel.dp_replicate": rep, "parallel.dp_shard": shard, "parallel.tp": tp, "parallel.pp": pp,
         "parallel.cp": cp, **DEFAULTS}  # every key set: a resumed run names its layout whole
    if rep * shard > 1:
        p["parallel.dp_mode"] = f"'{rng.choice(['auto', 'ddp', 'zero1', 'zero2', 'fsdp'])}'"
    if pp > 1:
        schedule = rng.choice(SCHEDULES)  # (kiln refuses some with compile or some micro-batch counts)
        p["parallel.pp_schedule"] = f"'{schedule}'"
        if schedule not in ("gpipe", "1f1b"):
            p["parallel.pp_virtual_stages"] = 2
        stages = pp * p["parallel.pp_virtual_stages"]
        if stages < N_LAYERS and rng.random() < 0.4:  # uneven stages: explicit first layers
            p["parallel.pp_split_points"] = str(sorted(rng.sample(range(1, N_LAYERS), stages - 1)))
        if rng.random() < 0.3:  # more micro-batches than stages (kiln refuses a count not dividing the batch)
            p["parallel.pp_microbatches"] = rng.choice([2, 4, 8])
    if cp > 1 and rng.random() < 0.5:
        p["parallel.cp_mode"] = "'ulysses'"
        if cp == 4 and rng.random() < 0.5:
            p["parallel.ulysses_degree"] = 2
        if rng.random() < 0.5:
            p["parallel.ulysses_rounds"] = 2
    if moe and rng.random() < 0.6:
        p["parallel.ep"] = rng.choice([2, 4])
        if tp > 1 and rng.random() < 0.5:
            p["parallel.etp"] = 1
    if shard * cp == 4 and tp == pp == 1 and p["parallel.dp_mode"] in ("'fsdp'", "'auto'") and rng.random() < 0.3:
        p["parallel.fsdp_reshard_to"] = 2
    return p


def refusal(sets: dict, world: int) -> str | None:
    """kiln's own line for a layout it will not run, or None (the checks `kiln train` starts with).
    Under DiLoCo also a layout of other than DILOCO_REPLICAS replicas, the reference's count, and
    one whose data-parallel ranks do not divide the global batch (see `run_case`)."""
    from kiln.config import load_config
    from kiln.errors import KilnError
    from kiln.parallel.dims import ParallelDims

    def check():
        return ParallelDims.for_job(load_config(None, [f"{k}={v}" for k, v in sets.items()]), world_size=world,
                                    rank=0, local_rank=0, local_world_size=world)[0]

    try:
        dims = check()
        if dims.diloco and dims.dp_replicate != DILOCO_REPLICAS:
            return f"DiLoCo with {dims.dp_replicate} replicas, not {DILOCO_REPLICAS}"
        if dims.diloco:
            sets["train.batch_size"] = GLOBAL_BATCH // dims.dp_size
            check()  # (pp's micro-batches against that batch)
    except KilnError as e:
        return str(e)
    return None


def kiln_train(sets: dict, run_dir: Path, world: int, *extra: str) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    cmd = [sys.executable, *launch, "-m", "kiln.cli", "train", "--run-dir", str(run_dir), *extra,
           *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def rows(run_dir: Path) -> dict[int, tuple[float, float]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in lines if r["kind"] == "train"}


def describe(layout: dict) -> str:
    """The layout's degrees as rep x shard x tp x pp x cp, then its settings that are not the defaults."""
    degrees = "x".join(str(layout[f"parallel.{k}"]) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))
    rest = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in layout.items()
                    if k in DEFAULTS and v != DEFAULTS[k] and not (k == "parallel.pp_schedule" and layout["parallel.pp"] == 1))
    return f"[{degrees}{' ' + rest if rest else ''}]"


def run_case(rng: random.Random, world: int, out: Path, corpus: Path, refused: list,
             dry: bool = False) -> tuple[str, str]:
    model = draw_model(rng)
    moe = "model.moe_experts" in model
    alone, alone_world = {**DEFAULTS, "parallel.dp_replicate": 1, "parallel.dp_shard": -1, "parallel.tp": 1,
                          "parallel.pp": 1, "parallel.cp": 1}, 1
    if world > DILOCO_REPLICAS and rng.random() < 0.25:
        # DiLoCo against its own definition: the same replicas, each one whole process; H = 2 puts
        # the layout change between two outer syncs, H = 3 right after one, H = 4 (2 fragments)
        # between the two fragments' syncs. A replica's samples are
        # its data-parallel ranks' slices of each micro-batch, so every layout takes the global
        # batch in one micro-batch (train.batch_size = global / data-parallel ranks): each replica
        # then trains on the same samples in every layout.
        model["parallel.diloco_inner_steps"] = h = rng.choice([2, 3, 4])
        if h == 4:  # Streaming DiLoCo: 2 fragments in turn, the exchange maybe under the next step
            model.update({"parallel.diloco_fragments": 2, "parallel.diloco_sync_delay": rng.choice([0, 1])})
        alone_world = DILOCO_REPLICAS
        alone["train.batch_size"] = GLOBAL_BATCH // DILOCO_REPLICAS
    layouts = []
    while len(layouts) < 2:
        layout = draw_layout(rng, world, moe)
        sets = {**BASE, "data.source": repr(str(corpus)), **model, **layout}
        why = refusal(sets, world)
        if why:
            refused.append(why)
        else:
            layout["train.batch_size"] = sets["train.batch_size"]  # (DiLoCo's per layout)
            layouts.append(layout)
    first, second = layouts
    if dry:
        return "", ""
    common = {**BASE, "data.source": repr(str(corpus)), **model}
    label = (f"{describe(first)} -> {describe(second)} | "
             + " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in model.items()))
    reference = kiln_train({**common, **alone}, out / "reference", alone_world)
    if reference.returncode:
        return "FAIL", f"{label} | reference: {reference.stderr.strip().splitlines()[-1][:300]}"
    for run, layout, extra in (("first", first, ("--stop-at", str(SAVE_AT))), ("second", second, ())):
        if run == "second":
            shutil.copytree(out / "first", out / "second")
            extra = ("--resume", str(out / "second"))
        got = kiln_train({**common, **layout}, out / run, world, *extra)
        if got.returncode:
            lines = got.stderr.strip().splitlines() or ["(no output)"]
            refusals = [x for x in lines if "kiln train: error" in x]
            if refusals:
                return "REFUSED", f"{label} | {run}: {refusals[0][:300]}"
            errors = [x for x in lines if "Error" in x] or lines
            return "FAIL", f"{label} | {run}: {errors[-1][:300]}"
    want, got = rows(out / "reference"), rows(out / "second")
    if sorted(got) != sorted(want):
        return "DIFF", f"{label} | steps {sorted(got)} != {sorted(want)}"
    worst = worst_rel(want, got, want)
    if worst <= REL:
        return "OK", f"rel {worst:.1e} | {label}"
    # Steps 1..3 right and a later one off: one process continuing the first layout's checkpoint
    # tells the second layout's error from the checkpoint's last bits amplified (a top-1 routing
    # tie flipped, a grad-norm spike): DRIFT where it lands where the second layout did.
    first = worst_rel(want, rows(out / "first"), range(1, SAVE_AT + 1))
    if first <= REL:
        shutil.copytree(out / "first", out / "alone")
        again = kiln_train({**common, **alone}, out / "alone", alone_world, "--resume", str(out / "alone"))
        if again.returncode == 0 and worst_rel(got, rows(out / "alone"), range(SAVE_AT + 1, STEPS + 1)) <= REL:
            return "DRIFT", f"rel {worst:.1e}, the reference from the same checkpoint agrees | {label}"
    return "DIFF", f"rel {worst:.1e} (steps 1..{SAVE_AT}: {first:.1e}) | {label}"


def worst_rel(want: dict, got: dict, steps) -> float:
    """The largest relative difference of loss and grad norm over `steps` (inf where one is missing)."""
    if any(s not in got for s in steps):
        return float("inf")
    return max(abs(g - w) / max(abs(w), 1e-6) for s in steps for g, w in zip(got[s], want[s]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--start", type=int, default=0, help="draw but skip the cases before this one (rerun case K of a seed)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs") / "layout-fuzz")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    if not corpus.exists():  # real text without ../shared: kiln's own sources, 1-4 lines a document
        lines = "\n".join(f.read_text() for f in sorted((ROOT / "kiln").rglob("*.py")))[:300_000].splitlines()
        cut, docs, at = random.Random(0), [], 0
        while at < len(lines):
            n = cut.randint(1, 4)
            docs.append(json.dumps({"text": "\n".join(lines[at:at + n])}))
            at += n
        corpus.write_text("\n".join(docs) + "\n")
    rng = random.Random(args.seed)
    refused: list[str] = []
    counts: dict[str, int] = {}
    for i in range(args.cases):
        case = out / f"seed{args.seed}-{i}"
        if i < args.start:  # the same draws, not run
            run_case(rng, args.world, case, corpus, [], dry=True)
            continue
        shutil.rmtree(case, ignore_errors=True)
        start = time.monotonic()
        verdict, line = run_case(rng, args.world, case, corpus, refused)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{case.name} {verdict} {time.monotonic() - start:.0f}s {line}", flush=True)
    print(f"{counts}; {len(refused)} draws refused by kiln's checks before launch", flush=True)
    return 1 if counts.get("DIFF") or counts.get("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())

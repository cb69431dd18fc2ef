"""Runs a prep pipeline over input shards, stage by stage, on a runner (local processes or Ray).

Stages, for a pipeline `seg0, G0, seg1, G1, ..., segM` (G = global steps, seg = streaming steps):

    stage-k  (k < M, per shard)  source -> seg_k -> store docs in .work/stage-k/  and  G_k.index
    prepare-k (once)             G_k.prepare
    final    (per shard)         source -> seg_M -> OUTPUT/documents/part-*.{fmt}
    tokenizer (once, driver)     train BPE on a sample of kept docs / load / byte
    tokenize (per shard)         kept docs -> .work/tokens/part-*/ (ShardWriter)
    merge    (once)              -> OUTPUT/tokens/ (meta.json, tokenizer.json, train/val shards)

where `source` is the reader for the first stage and `G_{k-1}.run(stored stage-(k-1) docs)`
after it. Every per-shard task writes its files under temporary names, renames them, then records
`.work/done/<stage>/<part>.json` (its counters); a rerun with the same config skips recorded
tasks, so a killed run resumes where it stopped. The output directory must be on a filesystem
every worker sees (Ray clusters: a shared mount). Where tasks run is the runner's business
(`kiln/prep/runners.py`, chosen by `run.executor`); every file is written through `kiln.io`.

A run that keeps no document fails (DataError, naming the main drop reasons) after writing its
report and rejects, and skips tokenization; a run whose reader rejects more than
`run.max_reject_share` of the input records gets a warning in the report naming the top reasons.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from kiln.errors import DataError
from kiln.io import AtomicFile, atomic_file, atomic_write_json, atomic_write_text
from kiln.prep.composition import CompositionCounter
from kiln.prep.base import Doc, GlobalStep, Step, StepContext, merge_stats, text_bytes
from kiln.prep.pipeline import PrepConfig
from kiln.prep.readers import READ_STEP, InputShard, list_shards, read_shard
from kiln.prep.runners import make_runner
from kiln.prep.writers import DocWriter, doc_suffix, merge_token_parts, read_docs, tokenize_docs

N_BINS = 41  # length histogram: bin i holds documents of bit_length(bytes) == i


# ---------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Everything a worker needs, picklable: the config and where things go."""

    cfg: PrepConfig
    out: Path
    work: Path
    shards: list[InputShard]  # empty in the copy sent with each task (see `light`)
    n_shards: int = 0

    def light(self) -> "Plan":
        """The plan without the shard list: what each task carries (one shard is passed alone)."""
        return dataclasses.replace(self, shards=[])

    @property
    def globals(self) -> list[GlobalStep]:
        return [s for s in self.cfg.steps if isinstance(s, GlobalStep)]

    def segments(self) -> list[list[Step]]:
        """Streaming steps between global steps: len(globals) + 1 lists."""
        segs: list[list[Step]] = [[]]
        for step in self.cfg.steps:
            if isinstance(step, GlobalStep):
                segs.append([])
            else:
                segs[-1].append(step)
        return segs

    def stage_file(self, k: int, shard: InputShard) -> Path:
        return self.work / f"stage-{k}" / f"{shard.name}.jsonl.zst"

    def step_dir(self, step: Step) -> Path:
        return self.work / "steps" / step.name

    def docs_file(self, shard: InputShard) -> Path:
        return self.out / "documents" / f"{shard.name}{doc_suffix(self.cfg.output.docs_format)}"

    def done_file(self, stage: str, shard: InputShard | None = None) -> Path:
        return self.work / "done" / stage / f"{shard.name if shard else 'all'}.json"

    def log_file(self, stage: str, shard: InputShard, kind: str) -> Path:
        return self.work / "logs" / stage / f"{shard.name}.{kind}.jsonl"


# ---------------------------------------------------------------------------- per-shard tasks


class _Log:
    """A JSONL log written to a temporary file and moved into place when the task succeeds."""

    def __init__(self, path: Path, enabled: bool = True):
        self.file = AtomicFile(path, "w") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def commit(self) -> None:
        if self.file is not None:
            self.file.commit()

    def abort(self) -> None:
        if self.file is not None:
            self.file.abort()


def _counted(docs: Iterable[Doc], stats: dict[str, Any], key: str) -> Iterator[Doc]:
    docs_key, bytes_key = f"docs_{key}", f"bytes_{key}"
    composition = CompositionCounter(stats, key)
    for doc in docs:
        n_bytes = text_bytes(doc.text)
        stats[docs_key] += 1
        stats[bytes_key] += n_bytes
        composition.add(doc.meta, n_bytes)
        yield doc


def _histogram(docs: Iterable[Doc], hist: list[int]) -> Iterator[Doc]:
    for doc in docs:
        hist[min(text_bytes(doc.text).bit_length(), N_BINS - 1)] += 1
        yield doc


def _chain(docs: Iterator[Doc], steps: list[Step], ctx: StepContext, plan: Plan) -> Iterator[Doc]:
    """Wrap each step so the executor, not the step, counts what goes in and comes out."""
    for step in steps:
        step_ctx = dataclasses.replace(ctx, work_dir=plan.step_dir(step)) if isinstance(step, GlobalStep) else ctx
        step.setup(step_ctx)
        stats = ctx.step_stats(step.name)
        docs = _counted(step.run(_counted(docs, stats, "in"), step_ctx), stats, "kept")
    return docs


def _check_accounting(stats: dict[str, dict[str, Any]], where: str) -> None:
    for name, s in stats.items():
        added = s.get("info", {}).get("docs_added", 0)  # steps that insert documents (canaries) say so
        if "docs_in" in s and s["docs_in"] + added != s["docs_kept"] + sum(s["dropped"].values()):
            raise RuntimeError(f"{where}: step {name!r} took {s['docs_in']} documents, kept {s['docs_kept']} "
                               f"and accounted for {sum(s['dropped'].values())} drops; a step lost documents")


def run_shard_task(plan: Plan, stage: str, shard: InputShard) -> dict[str, Any]:
    """One stage ('stage-K', 'final' or 'tokenize') over one shard; idempotent and resumable."""
    done = plan.done_file(stage, shard)
    if done.exists() and plan.cfg.run.resume:
        return json.loads(done.read_text(encoding="utf-8"))
    if stage == "tokenize":
        result = _tokenize_task(plan, shard)
    else:
        result = _filter_task(plan, stage, shard)
    atomic_write_json(done, result)
    return result


def _filter_task(plan: Plan, stage: str, shard: InputShard) -> dict[str, Any]:
    rejects = _Log(plan.log_file(stage, shard, "rejects"))
    removed = _Log(plan.log_file(stage, shard, "removed"), plan.cfg.output.write_removed)
    try:
        result = _filter_shard(plan, stage, shard, rejects, removed)
    except BaseException:
        rejects.abort()
        removed.abort()
        raise
    rejects.commit()
    removed.commit()
    return result


def _filter_shard(plan: Plan, stage: str, shard: InputShard, rejects: _Log, removed: _Log) -> dict[str, Any]:
    cfg = plan.cfg
    k = len(plan.globals) if stage == "final" else int(stage.split("-")[1])
    ctx = StepContext(shard_index=shard.index, n_shards=plan.n_shards, shard_name=shard.name,
                      max_examples=cfg.output.max_examples, example_chars=cfg.output.example_chars,
                      on_drop=lambda step, doc, reason: removed.write({"id": doc.id, "step": step, "reason": reason}))
    hist_in, hist_out = [0] * N_BINS, [0] * N_BINS
    if k == 0:
        def reject(file: str, line: int | None, reason: str, detail: str) -> None:
            rejects.write({"file": file, "line": line, "reason": reason, "detail": detail})

        source: Iterator[Doc] = _histogram(read_shard(shard, cfg.input, ctx, reject), hist_in)
        steps = plan.segments()[0]
    else:
        source = read_docs(plan.stage_file(k - 1, shard))
        steps = [plan.globals[k - 1], *plan.segments()[k]]
    docs = _chain(source, steps, ctx, plan)
    result: dict[str, Any] = {"stage": stage, "shard": shard.name}
    if stage == "final":
        writer = DocWriter(plan.docs_file(shard), cfg.output.docs_format)
        try:
            for doc in _histogram(docs, hist_out):
                writer.write(doc)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        result["docs_out"] = writer.count
    else:
        g = plan.globals[k]
        store = DocWriter(plan.stage_file(k, shard), "jsonl.zst")
        g_dir = plan.step_dir(g)
        g_dir.mkdir(parents=True, exist_ok=True)

        def tee(it: Iterator[Doc]) -> Iterator[Doc]:
            for doc in it:
                store.write(doc)
                yield doc

        try:
            stream = tee(docs)
            g.index(stream, dataclasses.replace(ctx, work_dir=g_dir))
            for _ in stream:  # a step that stopped early still gets every document stored
                pass
        except BaseException:
            store.abort()
            raise
        store.close()
        result["docs_out"] = store.count
    _check_accounting(ctx.stats, f"{stage} {shard.name}")
    result.update(stats=ctx.stats, hist_in=hist_in, hist_out=hist_out)
    return result


def _tokenize_task(plan: Plan, shard: InputShard) -> dict[str, Any]:
    from kiln.data.tokenizer import load_tokenizer

    tcfg = plan.cfg.tokenize
    tokenizer = load_tokenizer(plan.work / "tokenizer.json")
    out = plan.work / "tokens" / shard.name
    if out.exists():
        shutil.rmtree(out)  # a half-written part from a killed run
    result = tokenize_docs(read_docs(plan.docs_file(shard)), tokenizer, out, tcfg.val_fraction,
                           tcfg.batch_bytes, tcfg.shard_tokens)
    return {"stage": "tokenize", "shard": shard.name, **result}


def _global_context(plan: Plan, k: int) -> tuple[GlobalStep, StepContext]:
    g = plan.globals[k]
    return g, StepContext(n_shards=plan.n_shards, work_dir=plan.step_dir(g),
                          max_examples=plan.cfg.output.max_examples)


def run_prepare_part(plan: Plan, k: int, part: int, n_parts: int) -> dict[str, Any]:
    done = plan.done_file(f"prepare-{k}-part-{part}-of-{n_parts}")
    if done.exists() and plan.cfg.run.resume:
        return json.loads(done.read_text(encoding="utf-8"))
    g, ctx = _global_context(plan, k)
    g.prepare_part(ctx, plan.n_shards, part, n_parts)
    result = {"stage": f"prepare-{k}-part-{part}"}
    atomic_write_json(done, result)
    return result


def run_prepare(plan: Plan, k: int) -> dict[str, Any]:
    done = plan.done_file(f"prepare-{k}")
    if done.exists() and plan.cfg.run.resume:
        return json.loads(done.read_text(encoding="utf-8"))
    g, ctx = _global_context(plan, k)
    g.prepare(ctx, plan.n_shards)
    result = {"stage": f"prepare-{k}", "stats": ctx.stats}
    atomic_write_json(done, result)
    return result


# ---------------------------------------------------------------------------- driver


class _Progress:
    def __init__(self, mode: str):
        enabled = mode == "rich" or (mode == "auto" and sys.stderr.isatty())
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("shards"), TimeElapsedColumn(), TextColumn("{task.fields[docs]}"))
            self.progress.start()

    def task(self, name: str, total: int) -> Callable[[dict[str, Any]], None]:
        if self.progress is None:
            return lambda result: None
        tid = self.progress.add_task(name, total=total, docs="")
        kept = [0]

        def advance(result: dict[str, Any]) -> None:
            kept[0] += int(result.get("docs_out", sum(result.get("docs", {}).values())))
            self.progress.update(tid, advance=1, docs=f"{kept[0]:,} docs")

        return advance

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _prepare_dirs(plan: Plan) -> bool:
    """Set up the work dir; returns True when resuming a previous run of the same config."""
    # The config and the input files as they are now: new or edited inputs start over.
    inputs = []
    for shard in plan.shards:
        for f in shard.files:
            st = os.stat(f)
            inputs.append([f, st.st_size, st.st_mtime_ns])
    fingerprint = json.dumps({"config": plan.cfg.describe(), "inputs": inputs}, sort_keys=True, default=str)
    fp_file = plan.work / "fingerprint.json"
    same = fp_file.is_file() and fp_file.read_text(encoding="utf-8") == fingerprint
    ours = fp_file.is_file()
    if not ours and any((plan.out / name).exists() for name in ("documents", "tokens")):
        raise DataError(f"output.dir {plan.out} already has documents/ or tokens/ that kiln prep did not write "
                        f"(no .work/fingerprint.json); choose a new or empty directory")
    if not (same and plan.cfg.run.resume):
        # A different config (or resume off): earlier results are stale.
        for name in (".work", "documents", "tokens"):
            shutil.rmtree(plan.out / name, ignore_errors=True)
    atomic_write_text(fp_file, fingerprint)
    return same and plan.cfg.run.resume


def _train_or_load_tokenizer(plan: Plan) -> Any:
    from kiln.data.tokenizer import build_tokenizer, load_tokenizer

    path = plan.work / "tokenizer.json"
    if path.is_file():
        return load_tokenizer(path)
    spec = plan.cfg.tokenize

    def sample() -> Iterator[str]:  # read only for bpe
        budget = spec.sample_bytes
        for shard in plan.shards:  # in shard order: the same sample on every rerun
            for doc in read_docs(plan.docs_file(shard)):
                yield doc.text[:budget]
                budget -= len(doc.text)
                if budget <= 0:
                    return

    tok = build_tokenizer(spec.tokenizer, spec.vocab_size, sample())
    tmp = path.with_name("tokenizer.json.tmp")
    tok.save(tmp)
    os.replace(tmp, path)
    return tok


def _concat_logs(plan: Plan, stages: list[str], kind: str, dest: Path) -> int:
    n = 0
    with atomic_file(dest, "w") as out:
        for stage in stages:
            for shard in plan.shards:
                path = plan.log_file(stage, shard, kind)
                if path.is_file():
                    with open(path, encoding="utf-8") as f:
                        for line in f:
                            out.write(line)
                            n += 1
    return n


def run_prep(cfg: PrepConfig, console: Any = None) -> dict[str, Any]:
    """Run the pipeline; returns the report dict (also written to OUTPUT/prep_report.json/html).

    Raises DataError, after the report and rejects.jsonl are written, when no document is kept."""
    from kiln.prep.report import build_report, print_report, write_html

    cfg.validate()
    t0 = time.time()
    out = Path(cfg.output.dir)
    shards = list_shards(cfg.input)
    plan = Plan(cfg, out, out / ".work", shards, len(shards))
    light = plan.light()
    resumed = _prepare_dirs(plan)
    workers = cfg.run.workers or os.cpu_count() or 1
    runner = make_runner(cfg.run)
    progress = _Progress(cfg.run.progress)
    n_globals = len(plan.globals)
    filter_stages = [f"stage-{k}" for k in range(n_globals)] + ["final"]
    results: list[dict[str, Any]] = []
    try:
        for k, stage in enumerate(filter_stages):
            advance = progress.task(stage, len(shards))
            stage_results = []
            for result in runner.map(run_shard_task, [(light, stage, shard) for shard in shards]):
                stage_results.append(result)
                advance(result)
            results.extend(sorted(stage_results, key=lambda r: r["shard"]))
            if stage != "final":
                n_parts = plan.globals[k].prepare_parts(plan.n_shards)
                if n_parts and not (plan.done_file(f"prepare-{k}").exists() and cfg.run.resume):
                    # parallel pieces of stage 2 (e.g. MinHash bands) first, then the single prepare
                    list(runner.map(run_prepare_part, [(light, k, p, n_parts) for p in range(n_parts)]))
                sharded = getattr(plan.globals[k], "prepare_sharded", None)
                if sharded is not None and not (plan.done_file(f"prepare-{k}").exists() and cfg.run.resume):
                    # multi-phase stage 2 (sharded clustering): the driver orders phases, runner.map runs tasks
                    sharded(_global_context(light, k)[1], plan.n_shards, runner.map)
                results.append(runner.call(run_prepare, light, k))
        token_info: dict[str, Any] = {}
        kept = sum(r.get("docs_out", 0) for r in results if r.get("stage") == "final")
        if cfg.tokenize.enabled and kept:  # nothing to tokenize: fail below, after the report
            tokenizer = _train_or_load_tokenizer(plan)
            advance = progress.task("tokenize", len(shards))
            parts = []
            for result in runner.map(run_shard_task, [(light, "tokenize", shard) for shard in shards]):
                parts.append(result)
                advance(result)
            parts.sort(key=lambda r: r["shard"])
            totals = merge_token_parts([plan.work / "tokens" / s.name for s in shards], parts, out / "tokens",
                                       tokenizer, extra={"source": "kiln prep", "val_fraction": cfg.tokenize.val_fraction})
            token_info = {"dir": str(out / "tokens"), "vocab_size": tokenizer.vocab_size, "tokens": totals,
                          "docs": {s: sum(p["docs"][s] for p in parts) for s in ("train", "val")},
                          "tokenizer": cfg.tokenize.tokenizer}
    finally:
        progress.close()
        runner.close()
    n_rejects = _concat_logs(plan, filter_stages, "rejects", out / "rejects.jsonl")
    n_removed = _concat_logs(plan, filter_stages, "removed", out / "removed.jsonl") if cfg.output.write_removed else 0
    stats: dict[str, dict[str, Any]] = {}
    hist_in, hist_out = [0] * N_BINS, [0] * N_BINS
    for r in results:
        merge_stats(stats, r.get("stats", {}), cfg.output.max_examples)
        hist_in = [a + b for a, b in zip(hist_in, r.get("hist_in", [0] * N_BINS))]
        hist_out = [a + b for a, b in zip(hist_out, r.get("hist_out", [0] * N_BINS))]
    order = [READ_STEP] + [s.name for s in cfg.steps]
    global_state = {}
    for k, g in enumerate(plan.globals):  # the memory estimate promised by GlobalStep.state_bytes_per_doc
        indexed = sum(r.get("docs_out", 0) for r in results if r.get("stage") == f"stage-{k}")
        global_state[g.name] = {"docs_indexed": indexed, "state_bytes_per_doc": g.state_bytes_per_doc,
                                "state_bytes_estimate": indexed * g.state_bytes_per_doc}
    report = build_report(cfg, order, stats, hist_in, hist_out, token_info,
                          {"shards": len(shards), "rejects": n_rejects, "removed": n_removed,
                           "resumed": resumed, "seconds": round(time.time() - t0, 3),
                           "executor": cfg.run.executor, "workers": workers, "global_steps": global_state})
    reject_warning = _reject_share_warning(stats, cfg.run.max_reject_share, out / "rejects.jsonl")
    if reject_warning:
        report["warnings"].append(reject_warning)
    atomic_write_json(out / "prep_report.json", report)
    write_html(report, out / "prep_report.html")
    if console is not None:
        print_report(report, console)
    if not kept:
        raise DataError(_nothing_kept_reason(cfg, stats, order, out))
    return report


def _top_reasons(stats: dict[str, dict[str, Any]], steps: list[str], n: int = 3) -> list[tuple[str, int]]:
    """The `n` most frequent drop reasons of `steps`, e.g. [('read:missing_text_field', 3000)]."""
    counts = [(reason, count) for step in steps for reason, count in stats.get(step, {}).get("dropped", {}).items()]
    return sorted(counts, key=lambda c: (-c[1], c[0]))[:n]


def _format_reasons(reasons: list[tuple[str, int]]) -> str:
    return ", ".join(f"{reason} {count:,}" for reason, count in reasons)


# Reader rejects whose usual cause is the config rather than the data: what to check.
_HINTS = {"read:missing_text_field": "check input.text_field", "read:bad_json": "check input.format",
          "read:not_object": "check input.format"}


def _reject_share_warning(stats: dict[str, dict[str, Any]], max_share: float, rejects_file: Path) -> str:
    """A warning when the reader rejected more than `max_share` of the input records, else ''."""
    read = stats.get(READ_STEP)
    if not read:
        return ""
    rejected = sum(read["dropped"].values())
    total = read["docs_kept"] + rejected
    if not total or rejected / total <= max_share:
        return ""
    return (f"the reader rejected {rejected:,} of {total:,} input records ({100 * rejected / total:.1f}%), "
            f"more than run.max_reject_share={max_share:g}: {_format_reasons(_top_reasons(stats, [READ_STEP]))}; "
            f"see {rejects_file}")


def _nothing_kept_reason(cfg: PrepConfig, stats: dict[str, dict[str, Any]], order: list[str], out: Path) -> str:
    """One line: why no document was kept, with the top drop reasons and what to check."""
    read = stats.get(READ_STEP, {"docs_kept": 0, "dropped": {}})
    total = read["docs_kept"] + sum(read["dropped"].values())
    if not total:
        return f"no document kept: input.path {cfg.input.path!r} has no records; see {out}/prep_report.json"
    top = _top_reasons(stats, order)
    hint = _HINTS.get(top[0][0], "") if top else ""
    if top and top[0][0] == "read:missing_text_field":
        hint += f" (now {cfg.input.text_field!r})"
    return (f"no document kept: all {total:,} input records were dropped, by {_format_reasons(top)}"
            f"{'; ' + hint if hint else ''}; see {out}/rejects.jsonl and {out}/prep_report.json")


def check_output_readable(out: Path) -> None:
    """Raise DataError unless OUTPUT/tokens is a complete shard directory (used by the CLI)."""
    from kiln.data.shards import ShardSet

    for split in ("train", "val"):
        ShardSet(out / "tokens", split)
    if not (out / "tokens" / "tokenizer.json").is_file():
        raise DataError(f"{out}/tokens has no tokenizer.json")

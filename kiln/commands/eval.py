"""kiln eval RUN_DIR [--data FILE...] [--gen-file F.jsonl] [--passk-file [F.jsonl]] [--lm-eval TASKS] [--out FILE]

Parts run in order (perplexity, generation metrics, pass@k, lm-eval); the JSON report is
rewritten after each one, so a part that fails leaves the finished ones on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from kiln.errors import KilnError

BUILTIN_PROBLEMS = "builtin"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a kiln run directory with a checkpoint")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--out", help="report JSON (default: RUN_DIR/reports/eval-step-N.json)")
    ppl = p.add_argument_group("loss / perplexity / bits-per-byte")
    ppl.add_argument("--data", nargs="+", metavar="PATH",
                     help="held-out text files (default: the run's validation shards)")
    ppl.add_argument("--skip-perplexity", action="store_true", help="run only the other parts")
    ppl.add_argument("--seq-len", type=int, help="window length (default: the run's data.seq_len)")
    ppl.add_argument("--batch-size", type=int, default=8)
    ppl.add_argument("--max-tokens", type=int, default=0, help="score at most this many tokens (0: all)")
    gen = p.add_argument_group("generation metrics (BLEU, chrF, ROUGE, exact match)")
    gen.add_argument("--gen-file", metavar="F.jsonl", help='rows {"prompt": ..., "reference": str or [str, ...]}')
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    code = p.add_argument_group("pass@k on code problems (run in a sandbox)")
    code.add_argument("--passk-file", nargs="?", const=BUILTIN_PROBLEMS, metavar="F.jsonl",
                      help="problem JSONL; without a value (put it after RUN_DIR), kiln's shipped problem set")
    code.add_argument("--n-samples", type=int, default=1, help="completions per problem")
    code.add_argument("--k", default="1", help="comma list of k, each <= --n-samples")
    code.add_argument("--passk-temperature", type=float,
                      help="sampling temperature (default: 0 for one sample, else 0.8)")
    code.add_argument("--passk-max-new-tokens", type=int, default=128)
    code.add_argument("--sample-timeout", type=float, default=10.0, help="wall seconds per program")
    code.add_argument("--sample-memory-mb", type=int, default=512)
    code.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="programs run at once")
    code.add_argument("--passk-allow-unsandboxed", action="store_true",
                      help="where the kernel refuses namespaces (no bwrap sandbox), run the samples anyway "
                           "with only rlimits, seccomp and the nobody user: no filesystem isolation")
    robust = p.add_argument_group("robustness probe (loss under meaning-preserving perturbations)")
    robust.add_argument("--robustness", nargs="?", const="default", metavar="SPECS",
                        help="comma list such as upper,typos:0.05 (default set when given bare); "
                             "scores --data or the run's validation text")
    harness = p.add_argument_group("lm-evaluation-harness")
    harness.add_argument("--lm-eval", metavar="TASKS", help="comma list of lm-eval task names")
    harness.add_argument("--lm-eval-include", nargs="+", metavar="PATH", help="directories of local task YAMLs")
    harness.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    harness.add_argument("--num-fewshot", type=int)


def run(args: argparse.Namespace) -> int:
    _validate(args)
    from kiln.eval.load import load_run

    loaded = load_run(args.run_dir, args.step, args.device)
    out = Path(args.out) if args.out else Path(args.run_dir) / "reports" / f"eval-step-{loaded.step}.json"
    report: dict[str, Any] = {"run_dir": str(loaded.run_dir), "step": loaded.step, "time": time.time(),
                              "parts": _earlier_parts(out, loaded.step), "failed": None}
    parts: list[tuple[str, Callable[[], dict]]] = []
    if not args.skip_perplexity:
        parts.append(("perplexity", lambda: _perplexity(loaded, args)))
    if args.gen_file:
        parts.append(("generation", lambda: _generation(loaded, args)))
    if args.passk_file:
        parts.append(("passk", lambda: _passk(loaded, args)))
    if args.robustness:
        parts.append(("robustness", lambda: _robustness(loaded, args)))
    if args.lm_eval:
        parts.append(("lm_eval", lambda: _lm_eval(loaded, args)))
    if not parts:
        raise KilnError("nothing to evaluate: --skip-perplexity needs --gen-file, --passk-file, "
                        "--robustness or --lm-eval")
    for name, part in parts:
        try:
            report["parts"][name] = {**part(), "evaluated_at": time.time()}
        except BaseException as e:
            report["failed"] = {"part": name, "error": f"{type(e).__name__}: {e}"}
            _write_report(out, report)
            done = ", ".join(p for p in report["parts"] if p != name) or "none"
            print(f"eval part {name!r} failed; finished parts ({done}) are in {out}")
            raise
        _write_report(out, report)
    _print_table(report)
    print(f"report: {out}")
    return 0


def _validate(args: argparse.Namespace) -> None:
    for key in ("batch_size", "max_new_tokens", "n_samples", "passk_max_new_tokens", "sample_memory_mb", "workers"):
        if getattr(args, key) <= 0:
            raise KilnError(f"--{key.replace('_', '-')}={getattr(args, key)} must be > 0")
    if args.max_tokens < 0:
        raise KilnError(f"--max-tokens={args.max_tokens} must be >= 0 (0: all)")
    if args.seq_len is not None and args.seq_len <= 0:
        raise KilnError(f"--seq-len={args.seq_len} must be > 0")
    if args.sample_timeout <= 0:
        raise KilnError(f"--sample-timeout={args.sample_timeout} must be > 0")
    if not 0.0 < args.top_p <= 1.0:
        raise KilnError(f"--top-p={args.top_p} must be in (0, 1]")
    args.ks = _parse_ks(args.k, args.n_samples)
    if args.limit is not None and args.limit <= 0:
        raise KilnError(f"--limit={args.limit} must be > 0")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)


def _parse_ks(text: str, n_samples: int) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise KilnError(f"--k {text!r}: expected a comma list of integers such as 1,5") from None
    if not ks or ks[0] < 1:
        raise KilnError(f"--k {text!r}: each k must be >= 1")
    if ks[-1] > n_samples:
        raise KilnError(f"--k {ks[-1]} needs --n-samples >= {ks[-1]} (got {n_samples})")
    return ks


# ------------------------------------------------------------------------------------ the parts


def _perplexity(loaded, args: argparse.Namespace) -> dict:
    from kiln.eval.perplexity import evaluate_texts, evaluate_tokens

    seq_len = min(args.seq_len or loaded.config.data.seq_len, loaded.config.model.max_seq_len)
    common = dict(seq_len=seq_len, batch_size=args.batch_size, device=args.device, max_tokens=args.max_tokens)
    if args.data:
        texts, sources = [], []
        for path in map(Path, args.data):
            if not path.is_file():
                raise KilnError(f"--data {path} not found (expected a UTF-8 text file)")
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise KilnError(f"--data {path}: not UTF-8 text ({e})") from None
            sources.append(str(path))
        if not any(t.strip() for t in texts):
            raise KilnError(f"--data {' '.join(sources)}: no text to score")
        result = evaluate_texts(loaded.model, loaded.tokenizer, texts, **common)
    else:
        import numpy as np

        from kiln.data.shards import ShardSet

        shard_dir = _shard_dir(loaded)
        val = ShardSet(shard_dir, "val")
        if val.n_tokens < 2:
            raise KilnError(f"{shard_dir}: the validation split has no tokens; pass --data FILE")
        ids = np.concatenate([np.asarray(t) for t in val.tokens])
        result = evaluate_tokens(loaded.model, loaded.tokenizer, ids, **common)
        sources = [f"{shard_dir} (val)"]
    return {"source": sources, "seq_len": seq_len, **result}


def _shard_dir(loaded) -> Path:
    from kiln.data.shards import is_shard_dir

    data = loaded.config.data
    if is_shard_dir(data.source):
        return Path(data.source)
    shard_dir = Path(data.shards_dir) if data.shards_dir else loaded.run_dir / "data"
    if not is_shard_dir(shard_dir):
        raise KilnError(f"{shard_dir} holds no token shards for the validation split; pass --data FILE")
    return shard_dir


def _generation(loaded, args: argparse.Namespace) -> dict:
    import torch

    from kiln.errors import DataError
    from kiln.eval.genmetrics import all_metrics
    from kiln.eval.jsonl import read_jsonl
    from kiln.model.generate import generate

    rows = read_jsonl(args.gen_file, required={"prompt": str, "reference": (str, list)},
                      optional={"stop": (str, list)})
    tok = loaded.tokenizer
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    predictions, references, samples = [], [], []
    for row in rows:
        refs = row.data["reference"]
        refs = [refs] if isinstance(refs, str) else refs
        if not refs or not all(isinstance(r, str) for r in refs):
            raise DataError(f"{row.where}: field 'reference' must be a string or a non-empty list of strings")
        stops = row.data.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        prompt_ids = tok.encode(row.data["prompt"]) or [tok.eos_id]
        new_ids = generate(loaded.model, prompt_ids, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           eos_id=tok.eos_id, generator=generator)
        text = tok.decode(new_ids)
        for stop in stops:
            if stop and stop in text:
                text = text[:text.index(stop)]
        prediction = text.strip()
        predictions.append(prediction)
        references.append(refs)
        samples.append({"line": row.line, "prompt": row.data["prompt"], "prediction": prediction, "reference": refs})
    return {"file": str(args.gen_file), **all_metrics(predictions, references),
            "decoding": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                         "max_new_tokens": args.max_new_tokens},
            "samples": samples}


def _passk(loaded, args: argparse.Namespace) -> dict:
    import torch

    from kiln.eval.passk import load_problems, run_samples, score, truncate_completion
    from kiln.eval.sandbox import SandboxLimits, ensure_available
    from kiln.model.generate import generate

    problems = load_problems(None if args.passk_file == BUILTIN_PROBLEMS else args.passk_file)
    limits = SandboxLimits(wall_s=args.sample_timeout, cpu_s=max(1, math.ceil(args.sample_timeout)),
                           memory_mb=args.sample_memory_mb, allow_unisolated=args.passk_allow_unsandboxed)
    ensure_available(limits)  # refuse before generating anything
    temperature = args.passk_temperature if args.passk_temperature is not None else \
        (0.0 if args.n_samples == 1 else 0.8)
    tok = loaded.tokenizer
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    completions: dict[str, list[str]] = {}
    for problem in problems:
        prompt_ids = tok.encode(problem.prompt) or [tok.eos_id]
        completions[problem.task_id] = [
            truncate_completion(tok.decode(generate(
                loaded.model, prompt_ids, max_new_tokens=args.passk_max_new_tokens, temperature=temperature,
                top_p=0.95 if temperature > 0 else 1.0, eos_id=tok.eos_id, generator=generator)))
            for _ in range(args.n_samples)]
    report = score(problems, run_samples(problems, completions, limits, workers=args.workers), args.ks)
    return {"file": "kiln:basic" if args.passk_file == BUILTIN_PROBLEMS else str(args.passk_file),
            "temperature": temperature, **report.to_dict(),
            "completions": {k: v[:3] for k, v in completions.items()}}


def _robustness(loaded, args: argparse.Namespace) -> dict:
    from kiln.eval.robustness import DEFAULT_PROBE, robustness_probe, shard_texts

    seq_len = min(args.seq_len or loaded.config.data.seq_len, loaded.config.model.max_seq_len)
    texts = ([Path(p).read_text(encoding="utf-8") for p in args.data] if args.data
             else shard_texts(_shard_dir(loaded), loaded.tokenizer, max_chars=200_000))
    specs = DEFAULT_PROBE if args.robustness == "default" else args.robustness.split(",")
    return robustness_probe(loaded.model, loaded.tokenizer, texts, seq_len=seq_len, perturbations=specs,
                            seed=args.seed, batch_size=args.batch_size, device=args.device,
                            max_tokens=args.max_tokens)


def _lm_eval(loaded, args: argparse.Namespace) -> dict:
    from kiln.eval.lm_eval_adapter import run_lm_eval

    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    if not tasks:
        raise KilnError(f"--lm-eval {args.lm_eval!r}: expected a comma list of task names")
    return run_lm_eval(loaded, tasks, include_path=args.lm_eval_include, limit=args.limit,
                       batch_size=args.batch_size, num_fewshot=args.num_fewshot)


# ------------------------------------------------------------------------------------ output


def _earlier_parts(path: Path, step: int) -> dict:
    """Parts of an earlier report for the same checkpoint; parts run now replace their namesakes.

    A report that cannot be read is moved aside (FILE.unreadable), never overwritten.
    """
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        if earlier.get("step") != step:
            return {}
        return dict(earlier.get("parts") or {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        aside = path.with_name(path.name + ".unreadable")
        os.replace(path, aside)
        print(f"{path} was not a readable report; moved it to {aside}")
        return {}


def _write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def summary_rows(report: dict) -> list[tuple[str, str, str]]:
    """(part, metric, value) rows of the headline numbers."""
    rows: list[tuple[str, str, str]] = []
    parts = report["parts"]
    if "perplexity" in parts:
        p = parts["perplexity"]
        rows += [("perplexity", "loss (nats/token)", f"{p['loss']:.4f}"), ("perplexity", "ppl", f"{p['ppl']:.3f}"),
                 ("perplexity", "bits/byte", f"{p['bpb']:.4f}"), ("perplexity", "tokens", str(p["tokens"]))]
    if "generation" in parts:
        g = parts["generation"]
        rows += [("generation", key, f"{g[key]:.4f}") for key in ("bleu", "chrf", "rouge1", "rouge2", "rougeL",
                                                                   "exact_match")]
    if "passk" in parts:
        rows += [("pass@k", key, f"{value:.4f}") for key, value in parts["passk"]["pass_at_k"].items()]
    if "robustness" in parts:
        rows += [("robustness", f"{name} delta loss", f"{r['delta_loss']:+.4f}")
                 for name, r in parts["robustness"].items() if isinstance(r, dict) and "delta_loss" in r]
    if "lm_eval" in parts:
        for task, metrics in parts["lm_eval"]["results"].items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and "stderr" not in key and key != "alias":
                    rows.append((f"lm-eval {task}", key, f"{value:.4f}"))
    return rows


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kiln eval: {report['run_dir']} (step {report['step']})")
    for column in ("part", "metric", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for row in summary_rows(report):
        table.add_row(*row)
    Console().print(table)

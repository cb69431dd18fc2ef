"""The parts `kiln eval` runs, by name, and the loop that runs them into one report.

A part is `function(loaded run, options) -> dict` (the dict becomes `parts[NAME]` of the eval
report, see kiln.eval.results); `PARTS` lists them in the order they run. `EvalOptions` holds every
part's settings, with the defaults the `kiln eval` flags show (kiln.commands.eval builds it from
the command line; library callers build it directly).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from kiln.errors import KilnError
from kiln.eval import results
from kiln.eval.load import LoadedRun

BUILTIN_PROBLEMS = "builtin"


@dataclass
class EvalOptions:
    run_dir: str
    step: int | None = None  # None: the latest checkpoint
    device: str = "cpu"
    dtype: str = "fp32"  # autocast for scoring: fp32 | bf16 | fp16
    out: str | None = None  # None: RUN_DIR/reports/eval-step-N.json
    data: list[str] | None = None  # held-out text files; None: the run's validation shards
    skip_perplexity: bool = False
    seq_len: int | None = None  # None: the run's data.seq_len
    batch_size: int = 8
    max_tokens: int = 0
    gen_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    passk_file: str | None = None  # BUILTIN_PROBLEMS: kiln's shipped problem set
    n_samples: int = 1
    k: str = "1"
    passk_temperature: float | None = None
    passk_max_new_tokens: int = 128
    sample_timeout: float = 10.0
    sample_memory_mb: int = 512
    workers: int = min(4, os.cpu_count() or 1)
    # where namespaces are refused (no bwrap sandbox): run samples anyway, without filesystem isolation
    passk_allow_unsandboxed: bool = False
    robustness: str | None = None  # "default" or a comma list of perturbation specs
    lm_eval: str | None = None
    lm_eval_include: list[str] | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    memorization: bool = False
    sequences: str | None = None  # JSONL of sequences to measure; None: RUN_DIR/canaries.jsonl
    candidates: int = 1000  # random canaries ranked against each true one (exposure)
    ngram: int = 5  # n of extraction likelihood's n-gram overlap
    el_stride: int = 1  # extraction likelihood: every stride-th prefix

    @classmethod
    def from_namespace(cls, ns: Any) -> "EvalOptions":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def validate(self) -> None:
        """Raise a KilnError (naming the flag) for any setting out of range."""
        for key in ("batch_size", "max_new_tokens", "n_samples", "passk_max_new_tokens", "sample_memory_mb",
                    "workers", "candidates", "ngram", "el_stride"):
            if getattr(self, key) <= 0:
                raise KilnError(f"--{key.replace('_', '-')}={getattr(self, key)} must be > 0")
        if self.max_tokens < 0:
            raise KilnError(f"--max-tokens={self.max_tokens} must be >= 0 (0: all)")
        if self.seq_len is not None and self.seq_len <= 0:
            raise KilnError(f"--seq-len={self.seq_len} must be > 0")
        if self.sample_timeout <= 0:
            raise KilnError(f"--sample-timeout={self.sample_timeout} must be > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise KilnError(f"--top-p={self.top_p} must be in (0, 1]")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise KilnError(f"--dtype={self.dtype}: expected fp32, bf16 or fp16")
        self.ks()
        if self.limit is not None and self.limit <= 0:
            raise KilnError(f"--limit={self.limit} must be > 0")

    def ks(self) -> list[int]:
        """The k of pass@k, sorted; each within 1..n_samples."""
        try:
            ks = sorted({int(k) for k in self.k.split(",") if k.strip()})
        except ValueError:
            raise KilnError(f"--k {self.k!r}: expected a comma list of integers such as 1,5") from None
        if not ks or ks[0] < 1:
            raise KilnError(f"--k {self.k!r}: each k must be >= 1")
        if ks[-1] > self.n_samples:
            raise KilnError(f"--k {ks[-1]} needs --n-samples >= {ks[-1]} (got {self.n_samples})")
        return ks


EvalPart = Callable[[LoadedRun, EvalOptions], dict]
PARTS: dict[str, EvalPart] = {}


def eval_part(name: str) -> Callable[[EvalPart], EvalPart]:
    def register(fn: EvalPart) -> EvalPart:
        PARTS[name] = fn
        return fn
    return register


def wanted_parts(options: EvalOptions) -> list[str]:
    """The parts the options ask for, in run order."""
    wanted = {"perplexity": not options.skip_perplexity, "generation": bool(options.gen_file),
              "passk": bool(options.passk_file), "robustness": bool(options.robustness),
              "lm_eval": bool(options.lm_eval), "memorization": options.memorization}
    names = [name for name in PARTS if wanted.get(name)]
    if not names:
        raise KilnError("nothing to evaluate: --skip-perplexity needs --gen-file, --passk-file, "
                        "--robustness, --lm-eval or --memorization")
    return names


def run_parts(loaded: LoadedRun, names: list[str], options: EvalOptions, out: Path) -> dict:
    """Run the named parts in order, rewriting the report at `out` after each, so a part that fails
    leaves the finished ones (and earlier ones of the same checkpoint) on disk; the failure is
    recorded in the report and re-raised."""
    report: dict[str, Any] = {"run_dir": str(loaded.run_dir), "step": loaded.step, "time": time.time(),
                              "parts": results.earlier_parts(out, loaded.step), "failed": None}
    for name in names:
        try:
            report["parts"][name] = {**PARTS[name](loaded, options), "evaluated_at": time.time()}
        except BaseException as e:
            report["failed"] = {"part": name, "error": f"{type(e).__name__}: {e}"}
            results.write_report(out, report)
            done = ", ".join(p for p in report["parts"] if p != name) or "none"
            print(f"eval part {name!r} failed; finished parts ({done}) are in {out}")
            raise
        results.write_report(out, report)
    return report


# ------------------------------------------------------------------------------------ the parts


def _seq_len(loaded: LoadedRun, options: EvalOptions) -> int:
    return min(options.seq_len or loaded.config.data.seq_len, loaded.config.model.max_seq_len)


def _masked(loaded: LoadedRun) -> bool:
    """Whether the run trained with attention masked to each packed document: it is scored so."""
    return loaded.config.data.windows == "packed_masked"


def _autocast(options: EvalOptions):
    import torch

    from kiln.train.evaluate import autocast_context

    return autocast_context(torch.device(options.device), options.dtype)


@eval_part("perplexity")
def perplexity(loaded: LoadedRun, options: EvalOptions) -> dict:
    """Loss, perplexity, bits-per-byte of --data files (each file one document), else of the run's
    validation shards; attention masked to each document where the run trained so."""
    from kiln.eval.perplexity import evaluate_texts, evaluate_tokens

    seq_len = _seq_len(loaded, options)
    common = dict(seq_len=seq_len, batch_size=options.batch_size, device=options.device,
                  max_tokens=options.max_tokens, autocast=_autocast(options))
    if options.data:
        texts, sources = _read_texts(options.data), [str(p) for p in options.data]
        result = evaluate_texts(loaded.model, loaded.tokenizer, texts, masked=_masked(loaded), **common)
    else:
        ids, source, offsets = validation_tokens(loaded)
        result = evaluate_tokens(loaded.model, loaded.tokenizer, ids, doc_offsets=offsets, **common)
        sources = [source]
    return {"source": sources, "seq_len": seq_len, **result}


def validation_tokens(loaded: LoadedRun):
    """(the run's validation split as one token stream, its name, its document offsets where the
    run masks attention to documents, else None); also kiln unlearn's data."""
    import numpy as np

    from kiln.data.shards import ShardSet

    shard_dir = _shard_dir(loaded)
    val = ShardSet(shard_dir, "val")
    if val.n_tokens < 2:
        raise KilnError(f"{shard_dir}: the validation split has no tokens; pass --data FILE")
    ids = np.concatenate([np.asarray(t) for t in val.tokens])
    offsets = None
    if _masked(loaded):  # each shard's offsets, shifted to where the shard starts in the stream
        from kiln.data.loader import checked_doc_offsets

        starts = np.cumsum([0] + [len(t) for t in val.tokens])
        offsets = np.unique(np.concatenate([
            checked_doc_offsets(np.asarray(d, dtype=np.int64), len(t), f"{shard_dir}/{val.shard_files(i)[1]}")
            + a for i, (d, t, a) in enumerate(zip(val.docs, val.tokens, starts))]))
    return ids, f"{shard_dir} (val)", offsets


def _read_texts(paths: list[str]) -> list[str]:
    texts = []
    for path in map(Path, paths):
        if not path.is_file():
            raise KilnError(f"--data {path} not found (expected a UTF-8 text file)")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise KilnError(f"--data {path}: not UTF-8 text ({e})") from None
    if not any(t.strip() for t in texts):
        raise KilnError(f"--data {' '.join(map(str, paths))}: no text to score")
    return texts


def _shard_dir(loaded: LoadedRun) -> Path:
    from kiln.data.shards import is_shard_dir

    data = loaded.config.data
    if is_shard_dir(data.source):
        return Path(data.source)
    shard_dir = Path(data.shards_dir) if data.shards_dir else loaded.run_dir / "data"
    if not is_shard_dir(shard_dir):
        raise KilnError(f"{shard_dir} holds no token shards for the validation split; pass --data FILE")
    return shard_dir


@eval_part("generation")
def generation(loaded: LoadedRun, options: EvalOptions) -> dict:
    """BLEU, chrF, ROUGE and exact match of completions of --gen-file prompts."""
    import torch

    from kiln.errors import DataError
    from kiln.eval.genmetrics import all_metrics
    from kiln.eval.jsonl import read_jsonl
    from kiln.model.generate import generate

    rows = read_jsonl(options.gen_file, required={"prompt": str, "reference": (str, list)},
                      optional={"stop": (str, list)})
    tok = loaded.tokenizer
    generator = torch.Generator(device=options.device).manual_seed(options.seed)
    predictions, references, samples = [], [], []
    for row in rows:
        refs = row.data["reference"]
        refs = [refs] if isinstance(refs, str) else refs
        if not refs or not all(isinstance(r, str) for r in refs):
            raise DataError(f"{row.where}: field 'reference' must be a string or a non-empty list of strings")
        stops = row.data.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        prompt_ids = tok.encode(row.data["prompt"]) or [tok.eos_id]
        new_ids = generate(loaded.model, prompt_ids, max_new_tokens=options.max_new_tokens,
                           temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                           eos_id=tok.eos_id, generator=generator)
        text = tok.decode(new_ids)
        for stop in stops:
            if stop and stop in text:
                text = text[:text.index(stop)]
        prediction = text.strip()
        predictions.append(prediction)
        references.append(refs)
        samples.append({"line": row.line, "prompt": row.data["prompt"], "prediction": prediction, "reference": refs})
    return {"file": str(options.gen_file), **all_metrics(predictions, references),
            "decoding": {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p,
                         "max_new_tokens": options.max_new_tokens},
            "samples": samples}


@eval_part("passk")
def passk(loaded: LoadedRun, options: EvalOptions) -> dict:
    """pass@k of sampled completions of code problems, each program run in the sandbox."""
    import torch

    from kiln.eval.passk import load_problems, run_samples, score, truncate_completion
    from kiln.eval.sandbox import SandboxLimits, ensure_available
    from kiln.model.generate import generate

    builtin = options.passk_file == BUILTIN_PROBLEMS
    problems = load_problems(None if builtin else options.passk_file)
    limits = SandboxLimits(wall_s=options.sample_timeout, cpu_s=max(1, math.ceil(options.sample_timeout)),
                           memory_mb=options.sample_memory_mb, allow_unisolated=options.passk_allow_unsandboxed)
    ensure_available(limits)  # refuse before generating anything
    temperature = options.passk_temperature if options.passk_temperature is not None else \
        (0.0 if options.n_samples == 1 else 0.8)
    tok = loaded.tokenizer
    generator = torch.Generator(device=options.device).manual_seed(options.seed)
    completions: dict[str, list[str]] = {}
    for problem in problems:
        prompt_ids = tok.encode(problem.prompt) or [tok.eos_id]
        completions[problem.task_id] = [
            truncate_completion(tok.decode(generate(
                loaded.model, prompt_ids, max_new_tokens=options.passk_max_new_tokens, temperature=temperature,
                top_p=0.95 if temperature > 0 else 1.0, eos_id=tok.eos_id, generator=generator)))
            for _ in range(options.n_samples)]
    report = score(problems, run_samples(problems, completions, limits, workers=options.workers), options.ks())
    return {"file": "kiln:basic" if builtin else str(options.passk_file),
            "temperature": temperature, **report.to_dict(),
            "completions": {k: v[:3] for k, v in completions.items()}}


@eval_part("robustness")
def robustness(loaded: LoadedRun, options: EvalOptions) -> dict:
    """Loss of --data (or the run's validation text) under meaning-preserving perturbations."""
    from kiln.eval.robustness import DEFAULT_PROBE, robustness_probe, shard_texts

    texts = (_read_texts(options.data) if options.data
             else shard_texts(_shard_dir(loaded), loaded.tokenizer, max_chars=200_000))
    specs = DEFAULT_PROBE if options.robustness == "default" else options.robustness.split(",")
    return robustness_probe(loaded.model, loaded.tokenizer, texts, seq_len=_seq_len(loaded, options),
                            perturbations=specs, seed=options.seed, batch_size=options.batch_size,
                            device=options.device, max_tokens=options.max_tokens, autocast=_autocast(options),
                            masked=_masked(loaded))


@eval_part("lm_eval")
def lm_eval(loaded: LoadedRun, options: EvalOptions) -> dict:
    """Tasks of EleutherAI's lm-evaluation-harness."""
    from kiln.eval.lm_eval_adapter import run_lm_eval

    tasks = [t.strip() for t in options.lm_eval.split(",") if t.strip()]
    if not tasks:
        raise KilnError(f"--lm-eval {options.lm_eval!r}: expected a comma list of task names")
    limit = int(options.limit) if options.limit is not None and options.limit >= 1 else options.limit
    return run_lm_eval(loaded, tasks, include_path=options.lm_eval_include, limit=limit,
                       batch_size=options.batch_size, num_fewshot=options.num_fewshot)


@eval_part("memorization")
def memorization(loaded: LoadedRun, options: EvalOptions) -> dict:
    """Exposure, extraction likelihood and memorization accuracy of --sequences (default: the run's
    canaries.jsonl), next to the same metrics on its held-out rows (kiln.privacy.metrics)."""
    from kiln.privacy.canaries import CANARY_FILE
    from kiln.privacy.metrics import sequence_metrics, summarize
    from kiln.privacy.sequences import read_sequences, split_heldout

    path = Path(options.sequences) if options.sequences else loaded.run_dir / CANARY_FILE
    if options.sequences is None and not path.is_file():
        raise KilnError(f"{loaded.run_dir} has no {CANARY_FILE} (trained without data.canaries); "
                        f"pass --sequences FILE")
    rows = read_sequences(path, loaded.tokenizer, loaded.config.model.max_seq_len)
    seen, heldout = split_heldout(rows)
    kwargs = dict(ngram=options.ngram, stride=options.el_stride, candidates=options.candidates, seed=options.seed)
    seen_items = sequence_metrics(loaded.model, loaded.tokenizer, seen, **kwargs)
    heldout_items = sequence_metrics(loaded.model, loaded.tokenizer, heldout, **kwargs)
    return {"file": str(path), "ngram": options.ngram, "candidates": options.candidates,
            "sequences": summarize(seen_items), "heldout": summarize(heldout_items),
            "per_sequence": [{"where": r["where"], "heldout": bool(r.get("heldout")), **m}
                             for r, m in zip(seen + heldout, seen_items + heldout_items)]}

"""kiln eval RUN_DIR [--data FILE...] [--gen-file F.jsonl] [--passk-file [F.jsonl]] [--robustness [SPECS]]
[--lm-eval TASKS] [--out FILE]

Argument parsing only: the parts, their order and the report live in kiln.eval.parts and
kiln.eval.results. Flag defaults come from kiln.eval.parts.EvalOptions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.eval.parts import BUILTIN_PROBLEMS, EvalOptions

D = EvalOptions  # the defaults


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a kiln run directory with a checkpoint")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--device", default=D.device, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=D.dtype, choices=("fp32", "bf16", "fp16"),
                   help="autocast dtype for loss scoring (default fp32)")
    p.add_argument("--out", help="report JSON (default: RUN_DIR/reports/eval-step-N.json)")
    ppl = p.add_argument_group("loss / perplexity / bits-per-byte")
    ppl.add_argument("--data", nargs="+", metavar="PATH",
                     help="held-out text files (default: the run's validation shards)")
    ppl.add_argument("--skip-perplexity", action="store_true", help="run only the other parts")
    ppl.add_argument("--seq-len", type=int, help="window length (default: the run's data.seq_len)")
    ppl.add_argument("--batch-size", type=int, default=D.batch_size)
    ppl.add_argument("--max-tokens", type=int, default=D.max_tokens, help="score at most this many tokens (0: all)")
    gen = p.add_argument_group("generation metrics (BLEU, chrF, ROUGE, exact match)")
    gen.add_argument("--gen-file", metavar="F.jsonl", help='rows {"prompt": ..., "reference": str or [str, ...]}')
    gen.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens)
    gen.add_argument("--temperature", type=float, default=D.temperature, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=D.top_k)
    gen.add_argument("--top-p", type=float, default=D.top_p)
    gen.add_argument("--seed", type=int, default=D.seed)
    code = p.add_argument_group("pass@k on code problems (run in a sandbox)")
    code.add_argument("--passk-file", nargs="?", const=BUILTIN_PROBLEMS, metavar="F.jsonl",
                      help="problem JSONL; without a value (put it after RUN_DIR), kiln's shipped problem set")
    code.add_argument("--n-samples", type=int, default=D.n_samples, help="completions per problem")
    code.add_argument("--k", default=D.k, help="comma list of k, each <= --n-samples")
    code.add_argument("--passk-temperature", type=float,
                      help="sampling temperature (default: 0 for one sample, else 0.8)")
    code.add_argument("--passk-max-new-tokens", type=int, default=D.passk_max_new_tokens)
    code.add_argument("--sample-timeout", type=float, default=D.sample_timeout, help="wall seconds per program")
    code.add_argument("--sample-memory-mb", type=int, default=D.sample_memory_mb)
    code.add_argument("--workers", type=int, default=D.workers, help="programs run at once")
    code.add_argument("--passk-allow-unsandboxed", action="store_true",
                      help="where the kernel refuses namespaces (no bwrap sandbox), run the samples anyway "
                           "with only rlimits, seccomp and the nobody user: no filesystem isolation")
    robust = p.add_argument_group("robustness probe (loss under meaning-preserving perturbations)")
    robust.add_argument("--robustness", nargs="?", const="default", metavar="SPECS",
                        help="comma list such as upper,typos:0.05 (default set when given bare); "
                             "scores --data or the run's validation text")
    mem = p.add_argument_group("memorization (exposure, extraction likelihood, memorization accuracy)")
    mem.add_argument("--memorization", action="store_true",
                     help="measure memorization of --sequences against their held-out rows")
    mem.add_argument("--sequences", metavar="FILE",
                     help="JSONL rows {text[, heldout, prefix, secret, digits]}; default RUN/canaries.jsonl")
    mem.add_argument("--candidates", type=int, default=D.candidates, help="random canaries per exposure rank")
    mem.add_argument("--ngram", type=int, default=D.ngram, help="n of the extraction likelihood n-gram overlap")
    mem.add_argument("--el-stride", type=int, default=D.el_stride, help="extraction likelihood: every Nth prefix")
    harness = p.add_argument_group("lm-evaluation-harness")
    harness.add_argument("--lm-eval", metavar="TASKS", help="comma list of lm-eval task names")
    harness.add_argument("--lm-eval-include", nargs="+", metavar="PATH", help="directories of local task YAMLs")
    harness.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    harness.add_argument("--num-fewshot", type=int)


def run(args: argparse.Namespace) -> int:
    from kiln.eval.load import load_run
    from kiln.eval.parts import run_parts, wanted_parts
    from kiln.eval.results import print_summary

    options = EvalOptions.from_namespace(args)
    options.validate()
    loaded = load_run(options.run_dir, options.step, options.device)
    names = wanted_parts(options)
    out = Path(options.out) if options.out else Path(options.run_dir) / "reports" / f"eval-step-{loaded.step}.json"
    print_summary(run_parts(loaded, names, options, out))
    print(f"report: {out}")
    return 0

"""kiln generate RUN_DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]"""

from __future__ import annotations

import argparse
import sys

import torch

from kiln.errors import KilnError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a kiln run directory with a checkpoint")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    from kiln.eval.load import load_run
    from kiln.model.generate import generate

    if args.max_tokens <= 0:
        raise KilnError(f"--max-tokens={args.max_tokens} must be > 0")
    if not 0.0 < args.top_p <= 1.0:
        raise KilnError(f"--top-p={args.top_p} must be in (0, 1]")
    loaded = load_run(args.run_dir, args.step, args.device)
    tok = loaded.tokenizer
    prompt_ids = tok.encode(args.prompt) if args.prompt else [tok.eos_id]
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    for i in range(args.num_samples):
        ids = generate(loaded.model, prompt_ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, eos_id=tok.eos_id, generator=gen)
        if args.num_samples > 1:
            print(f"--- sample {i + 1} (step {loaded.step})")
        sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    return 0

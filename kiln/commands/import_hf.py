"""kiln import-hf HF_DIR [--run-dir RUN_DIR]

Turns a local Hugging Face Llama or GPT-2 directory (config.json, tokenizer.json, safetensors
weights) into a kiln run that `kiln eval` scores and `kiln train --resume` continues; see
docs/interop.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="local Hugging Face model directory (no hub downloads)")
    p.add_argument("--run-dir", help="run directory to create (default: runs/<HF_DIR name>)")


def run(args: argparse.Namespace) -> int:
    from kiln.interop.hf_import import import_hf

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.hf_dir).resolve().name
    run_dir, model_type, notes = import_hf(args.hf_dir, run_dir)
    for note in notes:
        print(f"note: {note}")
    print(f"imported {args.hf_dir} ({model_type}) as {run_dir}; try kiln eval {run_dir} --data FILE, "
          f"or kiln train --resume {run_dir} --set data.source=... to continue training")
    return 0

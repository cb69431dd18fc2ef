"""kiln export RUN_DIR --to hf OUT_DIR [--step N]

Writes the run's checkpoint as a Hugging Face `transformers` model directory (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json); see docs/interop.md.
"""

from __future__ import annotations

import argparse

FORMATS = ("hf",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a kiln run directory with a checkpoint")
    p.add_argument("--to", required=True, choices=FORMATS, help="target format (hf: Hugging Face transformers)")
    p.add_argument("out_dir", help="directory to write (must not exist, or be empty)")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")


def run(args: argparse.Namespace) -> int:
    from kiln.interop.hf_export import export_run

    out_dir, hf_class, step = export_run(args.run_dir, args.out_dir, args.step)
    print(f"exported {args.run_dir} step {step} to {out_dir} ({hf_class}); "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")
    return 0

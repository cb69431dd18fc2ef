"""The `kiln` command line: a thin dispatcher to `kiln/commands/<name>.py`.

Each command module has `add_arguments(parser)` and `run(args) -> int`. User errors
(`KilnError`) print one line and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from kiln.errors import KilnError

COMMANDS = {
    "train": "train a model (the embedded default when no config is given)",
    "generate": "sample text from a trained run",
    "eval": "evaluate a trained run (loss, perplexity, bits-per-byte, and more)",
    "prep": "prepare raw documents into clean, deduplicated token shards",
    "report": "write an HTML report of a run",
    "sweep": "short-run hyperparameter search",
    "export": "export a run as a Hugging Face transformers model (--to hf)",
    "import-hf": "turn a local Hugging Face Llama or GPT-2 model into a kiln run",
    "unlearn": "remove memorized sequences from a run by gradient ascent, into a new run",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="From raw text to a trained, evaluated language model.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        try:
            module_name = f"kiln.commands.{name.replace('-', '_')}"  # import-hf -> import_hf.py
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # a command whose module is not part of this build
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


@record  # under torchrun, a rank's uncaught exception reaches the launcher's summary with its rank
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KilnError as e:
        from kiln.parallel.dims import rank_label

        print(f"{rank_label()}kiln {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kiln {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

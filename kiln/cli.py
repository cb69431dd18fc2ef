"""The `kiln` command line: a thin dispatcher to `kiln/commands/<name>.py`.

Each command module has `add_arguments(parser)` and `run(args) -> int`. User errors
(`KilnError`) print one line and exit 2; anything else is a bug and keeps its traceback.
Only the chosen command's module is imported (and torch only by the commands that need it), so
`kiln --help` and light commands start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kiln.errors import KilnError, rank_label

COMMANDS = {
    "train": "train a model (the embedded default when no config is given)",
    "generate": "sample text from a trained run",
    "eval": "evaluate a trained run (loss, perplexity, bits-per-byte, and more)",
    "prep": "prepare raw documents into clean, deduplicated token shards",
    "report": "write an HTML report of a run",
    "sweep": "short-run hyperparameter search",
    "export": "export a run as a Hugging Face transformers model (--to hf)",
    "import-hf": "turn a local Hugging Face Llama or GPT-2 model into a kiln run",
    "plan": "what to train and how: compute-optimal size, fastest layout that fits, checkpoint interval, cost",
    "unlearn": "remove memorized sequences from a run by gradient ascent, into a new run",
    "loader-bench": "where training waits on data: compute vs warm vs cold loading, and the data.* settings that fix it",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command is listed; only the one named in `argv` (all of them when argv is None)
    imports its module and adds its arguments."""
    parser = argparse.ArgumentParser(prog="kiln", description="From raw text to a trained, evaluated language model.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if chosen is not None and name != chosen:
            continue
        module_name = f"kiln.commands.{name.replace('-', '_')}"  # import-hf -> import_hf.py
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # Under torchrun: a rank's uncaught exception reaches the launcher's summary with its rank.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KilnError as e:
        print(f"{rank_label()}kiln {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kiln {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

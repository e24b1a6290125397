"""`rdepth <command>`: one entry point; each subcommand lives in its own module.

A command module defines ``register(subparsers)`` which adds its parser and sets
``func=run`` (a function taking the parsed ``argparse.Namespace`` and returning an exit code).
`rdepth CMD ...` imports only CMD's module, so a command starts fast and one broken optional
dependency cannot take down unrelated commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module that registers it (order = order in `rdepth --help`)
COMMANDS: dict[str, str] = {
    "quickstart": "recurrent_depth.cli.quickstart",
    "train": "recurrent_depth.cli.train",
    "generate": "recurrent_depth.cli.generate",
    "eval": "recurrent_depth.cli.evaluate",
    "analyze": "recurrent_depth.cli.analyze",
    "serve": "recurrent_depth.cli.serve",
    "average": "recurrent_depth.cli.average",
    "tokenizer": "recurrent_depth.cli.tokenizer",
    "export": "recurrent_depth.cli.export",
    "lm-eval": "recurrent_depth.cli.lm_eval",
    "info": "recurrent_depth.cli.info",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdepth",
        description="Recurrent-depth language models: train, generate, analyse, evaluate, serve.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `rdepth lm-eval ...` forwards its arguments untouched to lm-eval's own CLI.
    if argv and argv[0] == "lm-eval":
        from recurrent_depth.cli.lm_eval import run_passthrough

        return run_passthrough(argv[1:])
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    # Bad values and unusable paths (--out naming an existing file, an unwritable directory, ...) are
    # the user's to fix: one line that names them, not a traceback.
    except (ValueError, OSError) as exc:
        print(f"rdepth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional dependency (lm-eval, ...) the command needs
        print(f"rdepth {args.command}: error: {exc}; the optional dependencies come with "
              f"pip install 'recurrent-depth[dev]' (or pip install -e '.[dev]' in a checkout)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rdepth {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

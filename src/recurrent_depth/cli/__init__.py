"""`rdepth <command>`: one entry point; each subcommand lives in its own module.

A command module defines ``register(subparsers)`` which adds its parser and sets
``func=run`` (a function taking the parsed ``argparse.Namespace`` and returning an exit code).
`rdepth CMD ...` imports only CMD's module, so a command starts fast and one broken optional
dependency cannot take down unrelated commands.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import NoReturn

# command name -> module that registers it (order = order in `rdepth --help`)
COMMANDS: dict[str, str] = {
    "quickstart": "recurrent_depth.cli.quickstart",
    "train": "recurrent_depth.cli.train",
    "sft": "recurrent_depth.cli.sft",
    "rl": "recurrent_depth.cli.rl",
    "generate": "recurrent_depth.cli.generate",
    "eval": "recurrent_depth.cli.evaluate",
    "analyze": "recurrent_depth.cli.analyze",
    "serve": "recurrent_depth.cli.serve",
    "average": "recurrent_depth.cli.average",
    "tokenizer": "recurrent_depth.cli.tokenizer",
    "export": "recurrent_depth.cli.export",
    "lm-eval": "recurrent_depth.cli.lm_eval",
    "info": "recurrent_depth.cli.info",
    "loop": "recurrent_depth.cli.loop",
    "retrofit": "recurrent_depth.cli.retrofit",
    "experiment": "recurrent_depth.cli.experiment",
    "sweep": "recurrent_depth.cli.sweep",
    "scaling": "recurrent_depth.cli.scaling",
}
# Commands whose work is torch compute: without --threads they measure the free cores once at start
# (recurrent_depth.accel.threads); the others keep torch's default unless --threads is given.
MEASURE_THREADS = frozenset({"quickstart", "train", "sft", "rl", "generate", "eval", "analyze", "serve", "loop",
                             "experiment"})
# Commands whose --threads bounds another library's threads, which the command sets itself (`rdepth tokenizer`:
# the tokenizers library's Rayon pool); torch, whose import alone takes seconds, is not imported for them.
OWN_THREADS = frozenset({"tokenizer"})


def _version() -> str:
    from recurrent_depth import __version__

    return __version__


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from recurrent_depth.cli.parser import Parser

    parser = Parser(
        prog="rdepth",
        description="Recurrent-depth language models: train, generate, analyse, evaluate, serve.",
    )
    parser.add_argument("--version", action="version", version=f"rdepth {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        importlib.import_module(module_name).register(subparsers)
    for name, command_parser in subparsers.choices.items():
        _add_threads_to_leaves(command_parser, measured=name in MEASURE_THREADS)
    return parser


def unknown_command(word: str) -> NoReturn:
    """`rdepth infoo`: argparse listed all the commands; name the one meant, as a mistyped flag gets (exit 2)."""
    import difflib

    near = difflib.get_close_matches(word, COMMANDS, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}?" if near else f"choose one of {', '.join(COMMANDS)}"
    # (no command registered: the usage line without importing any command module)
    build_parser(only="").error(f"unknown command {word!r}: {hint} (rdepth --help lists them)")


def _add_threads_to_leaves(parser: argparse.ArgumentParser, measured: bool) -> None:
    """`--threads` on every command (on the leaves of a command with sub-actions, like `tokenizer train`)."""
    from recurrent_depth.cli.common import add_threads_arg

    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested and "--threads" not in parser._option_string_actions:  # (a command may give its own help)
        add_threads_arg(parser, measured)
    for action in nested:
        for child in action.choices.values():
            _add_threads_to_leaves(child, measured)


def _configure_threads(args: argparse.Namespace) -> None:
    requested = getattr(args, "threads", None)
    if args.command not in MEASURE_THREADS:
        if requested is not None and args.command not in OWN_THREADS:
            import torch

            torch.set_num_threads(requested)
        return
    from recurrent_depth.accel.threads import configure_threads

    # quickstart prints its thread count in its own first line; under torchrun (which sets RANK, and one thread per
    # process unless OMP_NUM_THREADS says otherwise) rank 0 prints it, not every rank
    quiet = args.command == "quickstart" or os.environ.get("RANK", "0") != "0"
    log = None if quiet else (lambda line: print(f"rdepth {args.command}: {line}", file=sys.stderr))
    args.threads = configure_threads(requested, log)


@contextlib.contextmanager
def _warnings_as_notes(command: str) -> Iterator[None]:
    """The library's own warnings (a QK-clip rule, ignored config keys, ...) print as one line of the
    command's output; a warning from another package keeps Python's form, which names its source."""
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    python_form = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' signature)
        if not os.path.abspath(str(filename)).startswith(package_dir):
            python_form(message, category, filename, lineno, file, line)
            return
        print(f"rdepth {command}: warning: {message}", file=file if file is not None else sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = python_form


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`rdepth ... | head`): stop quietly, as the reader asked. stdout points
        # at /dev/null from here, so the interpreter's last flush cannot fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:  # Ctrl-C while the command's modules import (torch: ~1 s), before it runs
        print("rdepth: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # before the command modules are imported: no torch, no transformers
        print(f"rdepth {_version()}")
        return 0
    # `rdepth lm-eval ...` forwards its arguments untouched to lm-eval's own CLI.
    if argv and argv[0] == "lm-eval":
        from recurrent_depth.cli.lm_eval import run_passthrough

        return run_passthrough(argv[1:])
    from recurrent_depth.cli.parser import parse

    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        unknown_command(argv[0])
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        _configure_threads(args)
        with _warnings_as_notes(args.command):
            return int(args.func(args) or 0)
    # Bad values and unusable paths (--out naming an existing file, an unwritable directory, ...) are
    # the user's to fix: one line that names them, not a traceback.
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as exc:
        print(f"rdepth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional dependency (lm-eval, ...) the command needs
        extra = {"lm_eval": "eval", "peft": "lora", "scipy": "scaling"}.get((exc.name or "").split(".")[0], "dev")
        print(f"rdepth {args.command}: error: {exc}; it comes with pip install 'recurrent-depth[{extra}]' "
              f"(or pip install -e '.[{extra}]' in a checkout)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a message says what was kept (`rdepth train` saves a checkpoint)
        # A trainer's stop (TrainingInterrupted, with its exit_status) is agreed by every rank after the same step and
        # checkpoint: under torchrun rank 0 says it, as the run's other lines, not once per rank.
        if not (hasattr(exc, "exit_status") and os.environ.get("RANK", "0") != "0"):
            print(f"rdepth {args.command}: interrupted{f': {exc}' if str(exc) else ''}", file=sys.stderr)
        return getattr(exc, "exit_status", 130)  # 128 + the signal: 143 when preempted by SIGTERM (TrainingInterrupted)


if __name__ == "__main__":
    sys.exit(main())

"""The argument parser every `rdepth` command uses: no abbreviations, errors in the command's terms.

argparse's defaults send users the wrong way: `--num 16` is silently taken as `--num-steps 16`
(an abbreviation that a later flag can make ambiguous), and a mistyped flag is reported by the
top-level parser with `rdepth`'s usage, not the subcommand's. `Parser` turns abbreviations off,
remembers which (sub)command parsed the line, and `unrecognized` reports leftovers with that
command's usage and the closest flags it has. An empty output directory (`--out ''`, say from an unset
shell variable) is a usage error too: it meant the current directory.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

_LEAF = "_rdepth_parser"  # namespace attribute: the innermost parser that ran


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if not hasattr(ns, _LEAF):  # a subcommand's parser finishes first and is the one to report
            setattr(ns, _LEAF, self)
        return ns, extras

    def error(self, message: str) -> NoReturn:
        """The command's own usage (one line where it would run to many) and the error; exit 2."""
        usage = self.format_usage()
        if usage.count("\n") > 4:
            usage = f"usage: {self.prog} [options]  (see {self.prog} --help)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def closest_flags(word: str, parser: argparse.ArgumentParser, limit: int = 3) -> list[str]:
    """The parser's long flags nearest to `word` (a prefix of a flag counts as near)."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    name = word.split("=", 1)[0]
    prefixed = [f for f in flags if f.startswith(name) and len(name) > 2]
    close = difflib.get_close_matches(name, flags, n=limit, cutoff=0.6)
    return list(dict.fromkeys(prefixed + close))[:limit]


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, leftovers reported by the command that was given them."""
    args, extras = parser.parse_known_args(argv)
    leaf = getattr(args, _LEAF, parser)
    if hasattr(args, _LEAF):
        delattr(args, _LEAF)
    if extras:
        unrecognized(leaf, extras)
    for dest in EMPTY_REFUSED:
        if getattr(args, dest, None) == "":
            leaf.error(f"argument --{dest}: expected a directory path, got '' (an unset shell variable?)")
    return args


# output directories given as '' ($OUT unset): most commands wrote into the current directory, quickstart and
# scaling fit into their default one; refused as a usage error, before anything is written
EMPTY_REFUSED = ("out", "save")


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> NoReturn:
    hints = []
    for word in extras:
        if word.startswith("--"):
            near = closest_flags(word, parser)
            if near:
                hints.append(f"{word.split('=', 1)[0]}: did you mean {' or '.join(near)}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")

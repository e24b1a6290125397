"""Found by running the examples of docs/training.md & co. as a user would (session 35, part B)."""

from __future__ import annotations

import argparse
import ast
import inspect
import re

import recurrent_depth.train.quickstart as quickstart
from recurrent_depth.cli import build_parser


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(only=name)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_quickstart_messages_name_the_current_flags():
    """`rdepth quickstart --max-minutes 1` warned "raise --minutes for a meaningful result": the old alias, not
    the flag its --help and the docs name. Every flag a quickstart message names is a flag's first spelling."""
    canonical = {a.option_strings[0] for a in _subparser("quickstart")._actions if a.option_strings}
    texts = [node.value for node in ast.walk(ast.parse(inspect.getsource(quickstart)))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    named = {flag for text in texts for flag in re.findall(r"--[a-z][a-z-]*", text)}
    named.discard("--resume")  # named to say a quickstart has none
    assert named and named <= canonical, sorted(named - canonical)

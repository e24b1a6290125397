"""docs/*.md stay copyable: every `rdepth ...` they show, in code blocks and in prose, is a real (sub)command
with the flags it shows, and every python block parses. (The blocks themselves were run by hand on tiny
models; this keeps a renamed flag or a broken edit from slipping back in.)"""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

import pytest

from tests.test_readme_hunt import unknown_in

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", flags=re.S | re.M)


def block_commands(body: str) -> list[str]:
    """The `rdepth ...` command lines of a code block: continuations joined, comments and messages dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", textwrap.dedent(body))
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"\s#.*", "", line).strip().rstrip("&").strip()
        line = re.sub(r"^torchrun .*?-m recurrent_depth\.cli\b", "rdepth", line)
        # "rdepth generate: warning: ..." is output; "rdepth rl ... --resume" elides the rest
        if line.startswith("rdepth ") and not re.match(r"rdepth [\w-]+:", line) and "..." not in line:
            commands.append(line)
    return commands


def doc_commands(text: str) -> list[str]:
    """Every `rdepth ...` a doc shows: code blocks' command lines and prose's single commands."""
    commands = [c for _, body in FENCE.findall(text) for c in block_commands(body)]
    prose = FENCE.sub("", text)
    # alternatives ("a \| b", "generate / serve", "x | y"), "<cmd>" placeholders, "..." and messages are not one command
    commands += [s for s in re.findall(r"`(rdepth [^`]*)`", prose)
                 if not re.search(r"\||/|<|\.\.\.|^rdepth [\w-]+:", s)]
    return commands


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from recurrent_depth.cli import build_parser

    return build_parser()


def test_every_rdepth_command_in_the_docs_exists_with_its_flags(parser):
    shown = {doc.name: doc_commands(doc.read_text()) for doc in DOCS}
    assert sum(map(len, shown.values())) > 200, shown
    unknown = {(name, c): unknown_in(c, parser) for name, cs in shown.items() for c in cs if unknown_in(c, parser)}
    assert unknown == {}
    # the extraction sees continued lines, torchrun launches and prose, and skips output and comments
    sample = ("```bash\nrdepth train --config a.yaml \\\n    --max-step 3   # --no-such-flag\n"
              "torchrun --nproc_per_node=2 -m recurrent_depth.cli train --fsdp --bogus\n"
              "rdepth generate: warning: --x\n```\nthen `rdepth serve --port 1 --portt 2`.")
    assert {c: unknown_in(c, parser) for c in doc_commands(sample)} == {
        "rdepth train --config a.yaml --max-step 3": ["--max-step"],
        "rdepth train --fsdp --bogus": ["--bogus"],
        "rdepth serve --port 1 --portt 2": ["--portt"]}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_python_block_in_the_docs_parses(doc):
    for lang, body in FENCE.findall(doc.read_text()):
        if lang == "python":
            compile(textwrap.dedent(body), doc.name, "exec")  # a SyntaxError names the doc and line

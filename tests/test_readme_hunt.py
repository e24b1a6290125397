"""README.md stays true to the code: its links reach existing docs headings, and every `rdepth ...` it
names is a real (sub)command with the flags it shows."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def heading_anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def broken_links(text: str) -> list[str]:
    """Relative links in `text` (README-relative) whose file or heading anchor does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        doc = ROOT / path if path else README
        if not doc.exists() or (anchor and doc.suffix == ".md" and anchor not in heading_anchors(doc)):
            broken.append(target)
    return broken


def test_every_readme_link_reaches_a_file_and_heading():
    assert broken_links(README.read_text()) == []
    # the check itself sees a renamed heading or a missing file
    assert broken_links("[a](docs/training.md#no-such-heading) [b](docs/nope.md)") == [
        "docs/training.md#no-such-heading", "docs/nope.md"]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def unknown_in(command: str, root: argparse.ArgumentParser) -> list[str]:
    """The words of `rdepth ...` that name no (sub)command, or flags its command does not have."""
    words = command.split()[1:]
    parser, unknown = root, []
    while words and not words[0].startswith("-") and subcommands(parser):
        name = words.pop(0)
        if name not in subcommands(parser):
            return [name]
        parser = subcommands(parser)[name]
    if any(a.nargs == argparse.REMAINDER for a in parser._actions):
        return []  # the rest is handed to another tool (`rdepth lm-eval`: lm-eval's own arguments)
    flags = {s for a in parser._actions for s in a.option_strings}
    unknown += [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in flags]
    return unknown


@pytest.fixture(scope="module")
def rdepth_parser() -> argparse.ArgumentParser:
    from recurrent_depth.cli import build_parser

    return build_parser()


def test_every_rdepth_command_in_the_readme_exists_with_its_flags(rdepth_parser):
    spans = re.findall(r"`(rdepth [^`]*)`", README.read_text())
    # alternatives ("a \| b", "generate / serve") and "<command>" placeholders are prose, not one command line
    commands = [s for s in spans if not re.search(r"\\\||/|<", s)]
    assert len(commands) > 20, commands
    assert {c: unknown_in(c, rdepth_parser) for c in commands if unknown_in(c, rdepth_parser)} == {}
    assert unknown_in("rdepth generate --model DIR --num-step 4", rdepth_parser) == ["--num-step"]
    assert unknown_in("rdepth sweep start X", rdepth_parser) == ["start"]

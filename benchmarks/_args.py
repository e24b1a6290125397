"""Argument checks the benchmark scripts share: a bad value is argparse's one-line error naming its flag,
before anything heavy runs (not a traceback from deep inside torch or the loader, nor a silent default).

The library is imported inside the functions that need it: `ab_commits.py serving` runs this checkout's
benchmarks/serving.py against an older commit's library, which may lack the newer helpers."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type of a count, length, depth or thread number: 0 or less gave empty rows, a default in its
    place (`args.num_steps or 16`) or torch's traceback (`set_num_threads`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers, each >= 1 (a concurrency or depth list)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def weight_formats(text: str) -> list[str]:
    """argparse type: comma-separated `--weights` formats ("int8,int4,int4:g128"), each checked as the library does."""
    from recurrent_depth.weight_quant import check_weights

    formats = [part.strip() for part in text.split(",") if part.strip()]
    if not formats:
        raise argparse.ArgumentTypeError(f"expected comma-separated weight formats such as int8,int4, got {text!r}")
    try:
        for fmt in formats:
            check_weights(fmt)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return formats


def int_range(text: str) -> tuple[int, int]:
    """argparse type of a "LO,HI" length range (a single N means N,N), both >= 1 and LO <= HI."""
    parts = [part.strip() for part in text.split(",")]
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI (or one integer >= 1), got {text!r}")
    return values[0], values[1]


def out_file(text: str) -> str:
    """argparse type of a file the run writes at its end (--out JSON, --plot): a directory there, or a parent that
    is missing or not writable, failed only after the whole measurement, with a traceback."""
    path = Path(text)
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: expected a file path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def out_dir(text: str) -> str:
    """argparse type of a demo's output directory: a file there failed at `mkdir` with a traceback."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: expected a directory (or a path to create one at)")
    return text


def preset_name(text: str) -> str:
    """argparse type of --preset: an unknown name is refused with the list, not `from_preset`'s traceback."""
    from recurrent_depth.config import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose one of {', '.join(sorted(PRESETS))}")
    return text


def checked_model_dir(parser: argparse.ArgumentParser, path: str | None, flag: str = "--model") -> str | None:
    """A benchmark's model flag before anything loads: a run directory means its model/ (as in `rdepth`); a
    missing path, a file or a directory without config.json is the parser's one-line error naming `flag`."""
    if path is None:
        return None
    from recurrent_depth.cli.common import check_model_path, run_model_dir

    path = run_model_dir(path, flag)
    try:
        check_model_path(path, flag)
    except OSError as exc:
        parser.error(str(exc))
    return path

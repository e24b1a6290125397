"""`rdepth quickstart`: the main job. Trains the `small` model on the Python standard library in
about 10 minutes on a 2-core CPU and shows that thinking longer (more core steps) lowers the loss."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quickstart",
        help="train a small recurrent-depth model on the stdlib in minutes and show test-time scaling",
        description="Train a 4096-token BPE and the `small` recurrent-depth model on the Python standard "
                    "library's source within a wall-clock budget, evaluate validation loss at depths "
                    "1..64, and write a model directory, summary.json, plots and a report.",
    )
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="total wall-clock budget in minutes, tokenizer to report (default: %(default)s)")
    parser.add_argument("--out", default="runs/quickstart", metavar="DIR",
                        help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: measured at start; 1 wins on a busy machine)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.train.quickstart import quickstart

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is invalid: expected an integer >= 1")
    quickstart(minutes=args.minutes, out=args.out, seed=args.seed, threads=args.threads)
    return 0

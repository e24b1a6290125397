"""`python -m recurrent_depth.evaluation.reasoning {train,export}`: the reasoning recipe and its corpus.

    # train + evaluate accuracy against depth (the `quickstart --task` recipe), ~20 minutes on 2 cores
    python -m recurrent_depth.evaluation.reasoning train --task chains --max-minutes 20 --out runs/chains

    # a JSONL corpus + byte tokenizer for the general trainer (`rdepth train --config examples/reasoning_chains.yaml`)
    python -m recurrent_depth.evaluation.reasoning export --task chains --difficulties 0-6 --out data/chains
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recurrent_depth.data.tokenizer import save_tokenizer
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer, write_jsonl
from recurrent_depth.evaluation.reasoning.tasks import TASKS, get_task
from recurrent_depth.evaluation.reasoning.train import run_reasoning, task_preset


def difficulty_range(text: str) -> list[int]:
    """'0-6' or '1,2,4' -> a list of integers."""
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(v) for v in text.split("-"))
            return list(range(lo, hi + 1))
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'LOW-HIGH' or comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recurrent_depth.evaluation.reasoning", description=__doc__,
                                     allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", allow_abbrev=False,
                           help="train on a reasoning task, then measure accuracy against depth")
    train.add_argument("--task", default="chains", choices=sorted(TASKS), help="task family (default: chains)")
    train.add_argument("--max-minutes", "--minutes", dest="minutes", type=float, default=None,
                       help="wall-clock training budget (default: the preset's, 20; --minutes is the old name)")
    train.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: none)")
    train.add_argument("--train-difficulties", type=difficulty_range, default=None,
                       help="difficulties seen in training, 'LOW-HIGH' (default: the preset's, chains 0-6)")
    train.add_argument("--depths", type=difficulty_range, default=None,
                       help="test-time depths (default: the preset's, e.g. 1,2,4,8,16,32)")
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    train.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    train.add_argument("--out", default="runs/reasoning", help="output directory (default: runs/reasoning)")
    export = sub.add_parser("export", allow_abbrev=False,
                            help="write a JSONL corpus and the byte tokenizer for rdepth train")
    export.add_argument("--task", default="chains", choices=sorted(TASKS), help="task family (default: chains)")
    export.add_argument("--difficulties", type=difficulty_range, default=list(range(0, 7)),
                        help="difficulties to include (default: 0-6)")
    export.add_argument("--count", type=int, default=20_000, help="problems per difficulty (default: 20000)")
    export.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    export.add_argument("--out", required=True, help="directory for train.jsonl and tokenizer/")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            train_range = args.train_difficulties
            config = task_preset(
                args.task, minutes=args.minutes, max_steps=args.max_steps, depths=args.depths, threads=args.threads,
                seed=args.seed, out=args.out,
                train_difficulties=(min(train_range), max(train_range)) if train_range else None,
            )
            summary = run_reasoning(config)
            print(json.dumps(summary["extrapolation"]))
        else:
            out = Path(args.out)
            path = write_jsonl(out / "train.jsonl", get_task(args.task), args.count, args.difficulties, args.seed)
            save_tokenizer(byte_tokenizer(), out / "tokenizer")
            print(f"wrote {path} and {out / 'tokenizer'}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

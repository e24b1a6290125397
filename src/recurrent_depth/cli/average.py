"""`rdepth average`: the paper's post-hoc EMA over saved checkpoints into a new model directory.

    rdepth average --run runs/small --last 75 --dilation 7 --beta 0.9 --out runs/small-ema
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "average",
        help="EMA-average saved checkpoints into a new model directory (the paper's averaged model; "
             "its direction is assumed)",
        description="Exponential moving average over checkpoints, oldest first: ema = beta*ema + (1-beta)*w. "
                    "Takes every --dilation-th checkpoint counting back from the newest, at most --last. "
                    "The direction (oldest first, so the newest weighs 1-beta) is an assumption: the paper "
                    "says only that its EMA starts from the last checkpoint and publishes no code; list the "
                    "chosen checkpoints with --checkpoints newest first for the other reading.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="a training run directory (its checkpoints/ are used)")
    source.add_argument("--checkpoints", nargs="+", metavar="DIR",
                        help="model/checkpoint directories, oldest first")
    parser.add_argument("--beta", type=float, default=0.9, help="EMA decay (default: %(default)s)")
    parser.add_argument("--last", type=int, default=None,
                        help="use at most this many checkpoints (default: all; the paper used 75)")
    parser.add_argument("--dilation", type=int, default=1,
                        help="take every d-th checkpoint counting back from the newest (default: %(default)s; "
                             "the paper used 7)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="copy the tokenizer from here (default: the checkpoints' own, which must agree; "
                             "their retrofit.json and generation_config.json are kept too)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output model directory (required)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.files import check_out_dir
    from recurrent_depth.train.averaging import (
        average_checkpoints,
        run_checkpoints,
        run_model_dtype,
        select_checkpoints,
    )

    check_out_dir(args.out)
    if args.run == "":  # (an unset shell variable: it would have meant the current directory's checkpoints/)
        raise ValueError("--run '' is empty: expected a training run directory")
    paths = run_checkpoints(args.run) if args.run is not None else list(args.checkpoints)
    chosen = select_checkpoints(paths, args.last if args.last is not None else len(paths), args.dilation)
    # a run started from a bf16 directory writes its model/ in bf16 (its checkpoints in float32): so does its average
    dtype = run_model_dtype(args.run) if args.run else None
    out = average_checkpoints(chosen, args.out, beta=args.beta, tokenizer_dir=args.tokenizer, dtype=dtype)
    print(f"averaged {len(chosen)} checkpoint(s) (beta {args.beta}): {', '.join(str(p) for p in chosen)}")
    print(f"model: {out}")
    return 0

"""Depth extrapolation on a reasoning task: train (or load) a model, then accuracy per difficulty and depth.

    python benchmarks/reasoning_depth.py --minutes 20                      # train the chains preset, then measure
    python benchmarks/reasoning_depth.py --model runs/chains/model          # measure an existing model

Prints one JSON line (training steps and time, the hardest difficulty solved at >= 90% / >= 50%
within and beyond the training range, accuracy at depth 1 vs the best depth per difficulty) and
the difficulty x depth table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _args import checked_model_dir, out_dir, positive_int, positive_int_list


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="chains", help="reasoning task (default: chains)")
    parser.add_argument("--model", default=None, help="a trained model directory; default: train one first")
    parser.add_argument("--minutes", type=float, default=20.0, help="training budget (default: 20)")
    parser.add_argument("--max-steps", type=int, default=None, help="training step cap (default: none)")
    parser.add_argument("--trained-up-to", type=int, default=6, help="hardest training difficulty (default: 6)")
    parser.add_argument("--difficulties", default="0-12", help="difficulties to measure, LOW-HIGH (default: 0-12)")
    parser.add_argument("--depths", default="1,2,4,8,16,32", type=positive_int_list,
                        help="depths (default: 1,2,4,8,16,32)")
    parser.add_argument("--count", type=positive_int, default=100, help="problems per difficulty (default: 100)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="runs/bench-reasoning", type=out_dir,
                        help="output directory (default: runs/bench-reasoning)")
    args = parser.parse_args(argv)
    args.model = checked_model_dir(parser, args.model)

    import torch

    from recurrent_depth import RecurrentDepthLM
    from recurrent_depth.evaluation.reasoning import ReasoningRunConfig, accuracy_grid, get_task
    from recurrent_depth.evaluation.reasoning.__main__ import difficulty_range
    from recurrent_depth.evaluation.reasoning.train import summarize, train_reasoning

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    depths = args.depths
    try:  # a bad task or range was a traceback, after training when --model was not given
        get_task(args.task)
    except ValueError as exc:
        parser.error(f"--task: {exc}")
    try:
        difficulties = difficulty_range(args.difficulties)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--difficulties: {exc}")
    config = ReasoningRunConfig(task=args.task, minutes=args.minutes, max_steps=args.max_steps, depths=depths,
                                train_difficulties=(0, args.trained_up_to), out=args.out, threads=args.threads)
    started = time.perf_counter()
    if args.model is None:
        model, stats = train_reasoning(config)
    else:
        model, stats = RecurrentDepthLM.from_pretrained(args.model).eval(), {"model": args.model}
    grid = accuracy_grid(model, get_task(args.task), difficulties, depths, count=args.count, seed=10_000,
                         trained_difficulties=list(range(0, args.trained_up_to + 1)))
    summary = summarize(grid, config, stats)
    line = {
        "benchmark": "reasoning_depth", "task": args.task, "trained_up_to": args.trained_up_to,
        "train": {k: stats.get(k) for k in ("steps", "train_seconds", "curriculum_reached", "model") if k in stats},
        "solved_up_to": summary["solved_up_to"], "extrapolation": summary["extrapolation"],
        "depth1_vs_best": {str(d): [grid.accuracy[d][depths[0]], grid.best(d)[1], grid.best(d)[0]]
                           for d in difficulties},
        "torch_threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(line))
    print(grid.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

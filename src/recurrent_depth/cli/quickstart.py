"""`rdepth quickstart`: the main job. Trains the `small` model on the Python standard library in
about 10 minutes on a 2-core CPU and shows that thinking longer (more core steps) lowers the loss.

With `--task NAME` it runs the reasoning recipe instead: a small model trained on a synthetic task
generated in code (e.g. `shells`), then accuracy against test-time depth, beyond the training range too."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quickstart",
        help="train a small recurrent-depth model on the stdlib in minutes and show test-time scaling",
        description="Train a 4096-token BPE and the `small` recurrent-depth model on the Python standard "
                    "library's source within a wall-clock budget, evaluate validation loss at depths "
                    "1..64, and write a model directory, summary.json, plots and a report. With --task, "
                    "train on a reasoning task generated in code instead and measure accuracy against "
                    "test-time depth, on problems harder than any seen in training too (depth extrapolation).",
    )
    parser.add_argument("--task", default=None, choices=sorted(_task_names()),
                        help="reasoning task instead of the stdlib corpus, e.g. shells (track a ball under cup "
                             "swaps; about 20 minutes in all) (default: none)")
    # --max-minutes is the wall-clock limit's name in every command (train's too); --minutes stays an alias.
    parser.add_argument("--max-minutes", "--minutes", dest="minutes", type=float, default=None,
                        help="total wall-clock budget in minutes, tokenizer to report (default: 10); with --task, "
                             "the training time (default: the task preset's, 18-20), evaluation comes after "
                             "(--minutes is the old name)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output directory; a rerun there trains from scratch, reusing the tokenizer and "
                             "token shards; one holding another run's model/ or checkpoints is refused "
                             "(default: runs/quickstart, or runs/quickstart-TASK)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.set_defaults(func=run)


def _task_names() -> list[str]:
    from recurrent_depth.evaluation.reasoning.train import TASK_PRESETS

    return list(TASK_PRESETS)


def run(args: argparse.Namespace) -> int:
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError(f"--max-minutes={args.minutes} is invalid: expected a number > 0")
    if not 0 <= args.seed < 2**63:  # (named as the flag, before the tokenizer is trained)
        raise ValueError(f"--seed={args.seed} is invalid: expected an integer in [0, 2**63)")
    if args.task is not None:
        return run_task(args)
    from recurrent_depth.train.quickstart import check_minutes, quickstart

    minutes = 10.0 if args.minutes is None else args.minutes
    check_minutes(minutes, "--max-minutes")  # named as the flag, before anything is written
    quickstart(minutes=minutes, out=args.out or "runs/quickstart", seed=args.seed, threads=args.threads)
    return 0


def extrapolation_line(task: str, extrapolation: dict) -> str:
    """How far past its training difficulty the model solves the task, in words (None: at no difficulty)."""
    best90, best50 = extrapolation["beyond_training_at_0.9"], extrapolation["beyond_training_at_0.5"]
    at90 = f"beyond training up to {best90}" if best90 is not None else "at no difficulty beyond training"
    at50 = f"up to {best50}" if best50 is not None else "at none"
    return f"trained on {task} up to {extrapolation['trained_up_to']}; solved (>= 90%) {at90}, (>= 50%) {at50}"


def run_task(args: argparse.Namespace) -> int:
    """Train on a reasoning task, then print the accuracy grid and how far depth carries past training."""
    from recurrent_depth.evaluation.reasoning.train import run_reasoning, task_preset
    from recurrent_depth.train.trainer import TrainingInterrupted

    config = task_preset(args.task, minutes=args.minutes, seed=args.seed, threads=args.threads,
                         out=args.out or f"runs/quickstart-{args.task}")
    try:
        summary = run_reasoning(config)
    except TrainingInterrupted as exc:  # the trainer says "continue with --resume": a quickstart has no --resume
        exc.args = (f"{str(exc).split(';')[0]}; a quickstart does not resume: run it again to train from scratch",)
        raise
    print("\n" + extrapolation_line(args.task, summary["extrapolation"]))
    print(f"wrote {config.out}/summary.json, accuracy.json, accuracy_vs_depth.png and model/")
    return 0

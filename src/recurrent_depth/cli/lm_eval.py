"""`rdepth lm-eval ...`: lm-evaluation-harness's own CLI, in a process that knows recurrent-depth models.

    rdepth lm-eval run --model recurrent-depth --model_args pretrained=DIR,num_steps=16 --tasks rd_chains_mc
    rdepth lm-eval run --model hf --model_args pretrained=DIR,mean_recurrence=32 --tasks rd_stdlib_bpb
    rdepth lm-eval ls tasks

Every argument goes to lm-eval unchanged (lm-eval has no plugin entry point, so this wrapper
imports `recurrent_depth` first: that registers the ``recurrent-depth`` backend and our model types
with transformers' Auto classes, so ``--model hf`` loads our checkpoints and Huginn-0125 too).
Two conveniences: the shipped offline tasks (``rd_*``) are added to ``--include_path``, and
``--device cpu`` is added when no device is given and CUDA is absent (lm-eval defaults to cuda:0).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

LM_EVAL_SUBCOMMANDS = ("run", "ls", "validate")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness with the recurrent-depth backend and offline rd_* tasks available",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval (see lm-eval --help)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_passthrough(list(args.lm_eval_args))


def prepare_argv(argv: list[str], cuda_available: bool) -> list[str]:
    """Add our task directory to --include_path and a CPU device when needed (see the module docstring)."""
    from recurrent_depth.evaluation.tasks import TASKS_DIR

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        return argv
    command = argv[0] if argv[0] in LM_EVAL_SUBCOMMANDS else "run"
    for i, arg in enumerate(argv):
        if arg == "--include_path" and i + 1 < len(argv):
            argv[i + 1] = f"{argv[i + 1]}:{TASKS_DIR}"
            break
        if arg.startswith("--include_path="):
            argv[i] = f"{arg}:{TASKS_DIR}"
            break
    else:
        argv += ["--include_path", str(TASKS_DIR)]
    has_device = any(a == "--device" or a.startswith("--device=") for a in argv)
    if command == "run" and not has_device and not cuda_available:
        argv += ["--device", "cpu"]
    return argv


def take_threads(argv: list[str]) -> tuple[list[str], int | None]:
    """`--threads N` / `--threads=N` taken out of lm-eval's arguments (lm-eval has no such flag and
    would refuse it; every rdepth command takes it): the other arguments and N (None if not given)."""
    rest: list[str] = []
    threads = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg != "--threads" and not arg.startswith("--threads="):
            rest.append(arg)
            i += 1
            continue
        text = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        i += 1 if "=" in arg else 2
        try:
            threads = int(text)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"argument --threads: expected an integer >= 1, got {text!r}")
    return rest, threads


def backend_run_args(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], Any] | None:
    """The model_args, gen_kwargs and batch_size (None if not given) of an lm-eval `run` with our backend
    (``--model recurrent-depth``), read by lm-eval's own parser (``--model_args X``, ``--model_args=X``, ``-a``,
    several ``key=value`` words, JSON), so they are the values the backend will get. None for another command or
    model, with ``--config`` (lm-eval merges its file in), or when lm-eval's parser refuses the arguments (lm-eval
    then says why, once)."""
    try:
        from lm_eval._cli import HarnessCLI  # (lm-eval's own parser: private, so its absence only skips the check)
    except ImportError:
        return None
    from recurrent_depth.integrations.autoregister import LM_EVAL_BACKEND_NAME

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # HarnessCLI.parse_args reads (and may complete) sys.argv
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = HarnessCLI().parse_args()
    except SystemExit:  # --help, a parse error: lm-eval's own run prints it
        return None
    finally:
        sys.argv = saved
    if args.command != "run" or getattr(args, "config", None) or args.model != LM_EVAL_BACKEND_NAME:
        return None
    gen_kwargs = getattr(args, "gen_kwargs", None)
    return (dict(args.model_args or {}), dict(gen_kwargs) if isinstance(gen_kwargs, dict) else {},
            getattr(args, "batch_size", None))


@contextlib.contextmanager
def split_include_paths() -> Iterator[None]:
    """lm-eval's CLI hands `--include_path` to its TaskManager as one path: its help shows `a:b`, but 0.4.13
    never splits it, so the user's directory joined with ours (`prepare_argv`) named no directory and both sets
    of tasks went missing ("Tasks not found"). Split it on os.pathsep while lm-eval runs."""
    from lm_eval.tasks import TaskManager

    from recurrent_depth.evaluation.lm_eval_env import include_path_list

    init = TaskManager.__init__

    def split_init(self: Any, *args: Any, include_path: Any = None, **kwargs: Any) -> None:
        if isinstance(include_path, str) and os.pathsep in include_path:
            include_path = include_path_list(include_path)
        init(self, *args, include_path=include_path, **kwargs)

    TaskManager.__init__ = split_init
    try:
        yield
    finally:
        TaskManager.__init__ = init


def run_passthrough(argv: list[str]) -> int:
    """Import recurrent_depth (registering everything), then run lm-eval's CLI main with `argv`."""
    try:
        argv, threads = take_threads(argv)
    except ValueError as exc:
        print(f"rdepth lm-eval: error: {exc}", file=sys.stderr)
        return 2
    import recurrent_depth  # noqa: F401
    import recurrent_depth.integrations  # noqa: F401  (Auto classes + the lm-eval backend, lazily)

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        print(f"rdepth lm-eval: lm-eval is not installed ({exc}); pip install 'lm-eval[hf]'", file=sys.stderr)
        return 2
    import torch

    from recurrent_depth.evaluation.lm_eval_env import quiet_git_probe

    if threads is not None:
        torch.set_num_threads(threads)

    quiet_git_probe()
    argv = prepare_argv(argv, torch.cuda.is_available())
    saved = sys.argv
    try:
        run_args = backend_run_args(argv)
        if run_args is not None:  # our checks before lm-eval indexes its ~15k task configs (10+ s)
            from recurrent_depth.evaluation.lm_eval_backend import preflight

            preflight(*run_args)
        sys.argv = ["lm-eval", *argv]
        with split_include_paths():
            cli_evaluate()
    except SystemExit as exc:  # argparse and lm-eval exit with a code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except (ValueError, OSError) as exc:
        # Bad model args, a missing directory, ...: one line, as every other command says it (main()'s
        # handler is not around this passthrough), instead of a traceback through lm-eval.
        print(f"rdepth lm-eval: error: {exc}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0

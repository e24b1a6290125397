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
INCLUDE_PATH_FLAG = "--include_path"


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
    # the last one given is the one lm-eval reads (argparse), under any prefix it takes (`--include DIR`): one
    # missed left ours last, and lm-eval read ours alone (the user's folder dropped)
    given = [i for i, arg in enumerate(argv) if names_include_path(arg)]
    if not given:
        argv += ["--include_path", str(TASKS_DIR)]
    elif "=" in argv[given[-1]]:
        argv[given[-1]] += f"{os.pathsep}{TASKS_DIR}"
    elif given[-1] + 1 < len(argv):
        argv[given[-1] + 1] += f"{os.pathsep}{TASKS_DIR}"
    has_device = any(a == "--device" or a.startswith("--device=") for a in argv)
    if command == "run" and not has_device and not cuda_available:
        argv += ["--device", "cpu"]
    return argv


def names_include_path(arg: str) -> bool:
    """Whether `arg` is lm-eval's --include_path option (`--include_path`, `--include_path=X`, or a prefix argparse
    takes for it: `--include`; no other option of lm-eval's begins with `--i`)."""
    name = arg.partition("=")[0]
    return len(name) >= len("--i") and INCLUDE_PATH_FLAG.startswith(name)


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


def parsed_lm_eval_args(argv: list[str]) -> argparse.Namespace | None:
    """`argv` as lm-eval's own parser reads it (every spelling it takes), or None when it refuses them (--help, a
    parse error: lm-eval's own run then says why, once) or lm-eval has no such parser."""
    try:
        from lm_eval._cli import HarnessCLI  # (lm-eval's own parser: private, so its absence only skips the checks)
    except ImportError:
        return None

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # HarnessCLI.parse_args reads (and may complete) sys.argv
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return HarnessCLI().parse_args()
    except SystemExit:
        return None
    finally:
        sys.argv = saved


def check_include_path(args: argparse.Namespace | None) -> None:
    """A ValueError naming the first --include_path folder that is not one (lm-eval only logs it and goes on
    without its tasks), as `rdepth eval --lm-eval-include-path` says it; `args`: `parsed_lm_eval_args`'s."""
    from recurrent_depth.evaluation.depth_eval import include_dirs

    if args is not None:
        include_dirs(getattr(args, "include_path", None), INCLUDE_PATH_FLAG)


def backend_run_args(args: argparse.Namespace | None) -> tuple[dict[str, Any], dict[str, Any], Any] | None:
    """The model_args, gen_kwargs and batch_size (None if not given) of an lm-eval `run` with our backend
    (``--model recurrent-depth``), read by lm-eval's own parser (``--model_args X``, ``--model_args=X``, ``-a``,
    several ``key=value`` words, JSON), so they are the values the backend will get. None for another command or
    model, with ``--config`` (lm-eval merges its file in), or when lm-eval's parser refuses the arguments (lm-eval
    then says why, once: `args` is None). `args`: `parsed_lm_eval_args`'s."""
    from recurrent_depth.integrations.autoregister import LM_EVAL_BACKEND_NAME

    if args is None:
        return None
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
        parsed = parsed_lm_eval_args(argv)
        check_include_path(parsed)  # (before our backend's checks: a folder named is the first thing read)
        run_args = backend_run_args(parsed)
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

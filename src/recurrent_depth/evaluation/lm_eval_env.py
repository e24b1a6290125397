"""How this library calls lm-evaluation-harness: task names checked up front, its git probe quiet.

lm-eval records `git describe` of the working directory in every result and lets git print
`fatal: not a git repository` to stderr whenever it is not one (every run outside a checkout);
`quiet_git_probe` keeps the recorded value and discards git's stderr.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any


def quiet_git_probe() -> None:
    import lm_eval.evaluator as evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash() -> Any:
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, OSError):
            return get_commit_from_path(os.getcwd())

    evaluator.get_git_commit_hash = git_commit_hash


def include_path_list(value: str | os.PathLike[str] | list[Any] | tuple[Any, ...] | None) -> list[str]:
    """lm-eval's include_path as a list of directories: each entry split on os.pathsep (lm-eval's help shows
    `a:b`, but 0.4.13's TaskManager never splits it and reads the whole string as one path), empty parts dropped."""
    items = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
    return [part for item in items for part in os.fspath(item).split(os.pathsep) if part]


def check_task_names(manager: Any, names: list[str]) -> None:
    """A ValueError naming the tasks lm-eval does not know (instead of its traceback, after the model loaded)."""
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        shipped = sorted(name for name in known if name.startswith("rd_"))
        raise ValueError(f"unknown lm-eval task(s) {unknown}; this library ships {shipped}, and `lm-eval ls tasks` "
                         f"lists the others")

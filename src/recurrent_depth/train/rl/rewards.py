"""RL rewards: the reasoning tasks' checkers, a user's Python function, and the depth and length penalties.

A reward function is called once per rollout as

    reward(prompt: str, completion: str, depths: list[int]) -> float

prompt: the prompt text (no special tokens; a chat prompt's: its render, special tokens as text); completion:
the generated text up to (not including) the end token (a chat's: its end of turn too); depths: the core steps
that produced each completion token (depths[0] is the prompt's last position, at the prompt depth), as the
rollout recorded them.

A user's function is named `module:function` (`load_reward_function`) and runs **in-process, as
trusted code**: it can do anything the training process can, so only name code you would run yourself.

`ShapedReward` adds the penalties to a base reward, both scaled to [0, 1] before their weight:

    r = base - compute_penalty * mean(depths) / max_depth - length_penalty * len(completion tokens) / max_new_tokens

(the compute penalty beside the length penalty of the Composer 2 notes, linear here). A base
function that raises is reported in one line with its input; `on_error` decides what follows:
"stop" raises `RewardError`, "zero" scores the rollout 0, "skip" leaves it out of its group and the loss.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from recurrent_depth.evaluation.reasoning.tasks import ReasoningTask

RewardFunction = Callable[[str, str, list[int]], float]
ON_ERROR = ("stop", "zero", "skip")


class RewardError(ValueError):
    """A reward function raised (or returned no finite number) under `on_error="stop"` (a ValueError: the
    CLI ends with its one line)."""


@dataclass(frozen=True)
class TaskReward:
    """1.0 when the completion is the task's answer to the prompt (its solver recomputes it), else 0.0."""

    task: ReasoningTask

    def __call__(self, prompt: str, completion: str, depths: list[int]) -> float:
        return float(completion.strip() == self.task.solve(prompt))


def load_reward_function(spec: str) -> RewardFunction:
    """The callable `function` of module `module` for `spec` = "module:function" (trusted code, imported here
    from `sys.path` or the current directory)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"reward function {spec!r} is invalid: expected 'module:function' (e.g. my_rewards:score)")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        raise ValueError(f"reward function {spec!r}: {module_name!r} is a file path; expected a module name "
                         f"(my_rewards for ./my_rewards.py, run from its directory)")
    # `python -m` puts the current directory on sys.path, the installed `rdepth` script does not: a module
    # beside the run (./my_rewards.py) is found either way (appended, so it shadows no installed package)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({exc})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no callable {name!r}")
    return function


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@dataclass
class ShapedReward:
    """A base reward with the compute and length penalties and the error policy (module docstring).

    `__call__` returns the reward, or None for a rollout to leave out ("skip"); `errors` counts
    the base function's failures, `log` receives their one-line reports."""

    base: RewardFunction
    max_depth: int
    max_new_tokens: int
    compute_penalty: float = 0.0
    length_penalty: float = 0.0
    on_error: str = "stop"
    log: Callable[[str], None] = print
    errors: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_reward_error={self.on_error!r} is invalid: expected one of {ON_ERROR}")
        for name in ("compute_penalty", "length_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number >= 0")
        for name in ("max_depth", "max_new_tokens"):  # (the penalties' divisors: 0 was a ZeroDivisionError per rollout)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShapedReward {name}={value!r} is invalid: expected an integer >= 1")

    def __call__(self, prompt: str, completion: str, depths: list[int], num_tokens: int) -> float | None:
        try:
            value = self.base(prompt, completion, list(depths))
            if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d torch / numpy number
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"returned {value!r}, not a finite number")
        except Exception as exc:  # a user's function may raise anything: report it with its input
            self.errors += 1
            name = getattr(self.base, "__name__", type(self.base).__name__)
            line = (f"reward function {name} failed ({type(exc).__name__}: {exc}) on prompt={_short(prompt)} "
                    f"completion={_short(completion)} depths={list(depths)}")
            if self.on_error == "stop":
                raise RewardError(line) from exc
            outcome = "scored 0" if self.on_error == "zero" else "left out"
            self.log(f"{line}; on_reward_error={self.on_error}: {outcome}")
            if self.on_error == "skip":
                return None
            value = 0.0
        mean_depth = sum(depths) / len(depths) if depths else 0.0
        return (float(value) - self.compute_penalty * mean_depth / self.max_depth
                - self.length_penalty * num_tokens / self.max_new_tokens)


def get_reward(name: str, task: ReasoningTask | None) -> RewardFunction:
    """"task" (the task's checker) or a user's "module:function"."""
    if name == "task":
        if task is None:
            raise ValueError("reward 'task' needs a reasoning task (--task) whose solver checks the answer")
        return TaskReward(task)
    return load_reward_function(name)

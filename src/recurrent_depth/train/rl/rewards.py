"""RL rewards: the reasoning tasks' checkers, a user's Python function, and the depth and length penalties.

A reward function is called once per rollout as

    reward(prompt: str, completion: str, depths: list[int]) -> float

prompt: the prompt text (no special tokens; a chat prompt's: its render, special tokens as text); completion:
the generated text up to (not including) the end token (a chat's: its end of turn too); depths: the core steps
that produced each completion token (depths[0] is the prompt's last position, at the prompt depth), as the
rollout recorded them.

A function that also takes keyword arguments gets the prompt record's other fields (`--prompts FILE.jsonl`:
`{"messages": [...], "answer": "42"}`, `data.chat.prompt_fields`), as trl's GRPOTrainer passes a row's other
columns to its reward functions: under `**kwargs` every field, else the fields its parameters after the three name
(`def score(prompt, completion, depths, answer)`); each of the prompt's G completions gets them. A named parameter
without a default is a field every prompt must have (checked before the first rollout, `RewardKeywords.check`);
text and task prompts have no fields. A function of the three alone is called as above (`RewardKeywords.of`).

A user's function is named `module:function` (`load_reward_function`) and runs **in-process, as
trusted code**: it can do anything the training process can, so only name code you would run yourself.

`ShapedReward` adds the penalties to a base reward, both scaled to [0, 1] before their weight:

    r = base - compute_penalty * mean(depths) / max_depth - length_penalty * len(completion tokens) / max_new_tokens

(the compute penalty beside the length penalty of the Composer 2 notes, linear here). A base
function that raises is reported in one line with its input; `on_error` decides what follows:
"stop" raises `RewardError`, "zero" scores the rollout 0, "skip" leaves it out of its group and the loss.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from recurrent_depth.evaluation.reasoning.tasks import ReasoningTask
from recurrent_depth.files import clipped

RewardFunction = Callable[..., float]  # (prompt, completion, depths, **the prompt fields it takes) -> reward
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


ARGUMENTS = 3  # (prompt, completion, depths): the positional arguments every reward function is called with


@dataclass(frozen=True)
class RewardKeywords:
    """Which of a prompt's fields a reward function takes as keyword arguments (module docstring): all of them
    (`every`, under **kwargs), else those `named` by its parameters after the three; none for a function of the
    three, or one whose signature Python cannot read (called as before)."""

    function: str  # its name, for the errors
    every: bool = False
    named: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()  # named without a default: every prompt must have the field
    taken: frozenset[str] = frozenset()  # the three's names: a field of one would be given twice under **kwargs

    @classmethod
    def of(cls, function: Callable[..., Any]) -> RewardKeywords:
        name = getattr(function, "__name__", type(function).__name__)
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # (a builtin without a signature: called with the three, as before)
            return cls(name)
        every, positional, taken, named = False, 0, set(), {}
        for p in parameters:
            if p.kind is p.VAR_KEYWORD:
                every = True
            elif p.kind is p.VAR_POSITIONAL:  # (*args takes what is left of the three)
                positional = ARGUMENTS
            elif positional < ARGUMENTS and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional += 1
                if p.kind is p.POSITIONAL_OR_KEYWORD:
                    taken.add(p.name)
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                named[p.name] = p.default is p.empty
        return cls(name, every, frozenset(named), frozenset(n for n, needed in named.items() if needed),
                   frozenset(taken) if every else frozenset())

    def check(self, fields: Mapping[str, Any] | None, where: str) -> None:
        """A one-line ValueError naming `where` (the prompt: FILE:LINE) when its `fields` (None: a text or task prompt,
        which has none) lack one the function requires, or hold one it would be given twice."""
        missing = sorted(self.required - set(fields or {}))
        if missing:
            needs = f"reward function {self.function} takes {', '.join(missing)} (no default)"
            if fields is None:
                raise ValueError(f"{where}: {needs}, a prompt record's field, and text and task prompts have none; "
                                 f"give --prompts FILE.jsonl records with it, or the parameter a default")
            raise ValueError(f"{where}: {needs}, which this record has no field for; give every record the field, "
                             f"or the parameter a default")
        twice = sorted(self.taken & set(fields or {}))
        if twice:
            raise ValueError(f"{where}: field {twice[0]!r} has the name of reward function {self.function}'s argument "
                             f"{twice[0]}, which its **kwargs would be given twice; rename the field")

    def take(self, fields: Mapping[str, Any] | None) -> dict[str, Any]:
        """The keyword arguments for one call: copies, so a function that changes one leaves the next call's as read."""
        return {key: copy.deepcopy(value) for key, value in (fields or {}).items() if self.every or key in self.named}


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@dataclass
class ShapedReward:
    """A base reward with the compute and length penalties and the error policy (module docstring).

    `__call__` returns the reward, or None for a rollout to leave out ("skip"); `errors` counts
    the base function's failures, `log` receives their one-line reports; `keywords`: the prompt fields it takes."""

    base: RewardFunction
    max_depth: int
    max_new_tokens: int
    compute_penalty: float = 0.0
    length_penalty: float = 0.0
    on_error: str = "stop"
    log: Callable[[str], None] = print
    errors: int = field(default=0, init=False)
    keywords: RewardKeywords = field(init=False)

    def __post_init__(self) -> None:
        self.keywords = RewardKeywords.of(self.base)
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

    def __call__(self, prompt: str, completion: str, depths: list[int], num_tokens: int,
                 fields: Mapping[str, Any] | None = None) -> float | None:
        """`fields`: the prompt record's other fields (None: a text or task prompt's, none)."""
        kwargs = self.keywords.take(fields)
        try:
            value = self.base(prompt, completion, list(depths), **kwargs)
            if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d torch / numpy number
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"returned {value!r}, not a finite number")
        except Exception as exc:  # a user's function may raise anything: report it with its input
            self.errors += 1
            given = f" fields={clipped(kwargs, 200)}" if kwargs else ""
            line = (f"reward function {self.keywords.function} failed ({type(exc).__name__}: {exc}) on "
                    f"prompt={_short(prompt)} completion={_short(completion)} depths={list(depths)}{given}")
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

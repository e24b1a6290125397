"""Reasoning tasks that need depth: generators with a difficulty knob, solvers, training, evaluation."""

from recurrent_depth.evaluation.reasoning.data import ProblemEncoder, byte_tokenizer, write_jsonl
from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid, accuracy_grid
from recurrent_depth.evaluation.reasoning.tasks import (
    TASKS,
    Addition,
    Problem,
    ReasoningTask,
    RunningSum,
    ShellGame,
    VariableChains,
    get_task,
    make_problems,
)
from recurrent_depth.evaluation.reasoning.train import (
    TASK_PRESETS,
    ReasoningRunConfig,
    run_reasoning,
    task_preset,
    train_reasoning,
)

__all__ = [
    "TASKS",
    "TASK_PRESETS",
    "AccuracyGrid",
    "Addition",
    "Problem",
    "ProblemEncoder",
    "ReasoningRunConfig",
    "ReasoningTask",
    "RunningSum",
    "ShellGame",
    "VariableChains",
    "accuracy_grid",
    "byte_tokenizer",
    "get_task",
    "make_problems",
    "run_reasoning",
    "task_preset",
    "train_reasoning",
    "write_jsonl",
]

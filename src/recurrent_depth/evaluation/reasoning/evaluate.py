"""Accuracy of a model on a reasoning task, for every (difficulty, test-time depth) pair.

Exact match of the greedy answer: with teacher forcing, greedy decoding writes the answer exactly
when the argmax at every answer position is the expected token (the end token is not scored:
every task's answer has a fixed length), so one
forward per depth decides it (no generation loop). All depths come from one pass
(`readout.logits_at_depths`), from the same seeded initial state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recurrent_depth.evaluation.readout import check_depths, logits_at_depths
from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
from recurrent_depth.evaluation.reasoning.tasks import ReasoningTask, make_problems
from recurrent_depth.model.recurrent import RecurrentDepthLM, library_model


@dataclass
class AccuracyGrid:
    """accuracy[difficulty][depth] in [0, 1], over `count` problems per difficulty."""

    task: str
    difficulty_name: str
    difficulties: list[int]
    depths: list[int]
    count: int
    accuracy: dict[int, dict[int, float]] = field(default_factory=dict)
    chance: float | None = None
    trained_difficulties: list[int] | None = None

    def best(self, difficulty: int) -> tuple[int, float]:
        """(depth, accuracy) of the best depth for one difficulty (the shallowest on ties)."""
        row = self.accuracy[difficulty]
        depth = max(self.depths, key=lambda d: (row[d], -d))
        return depth, row[depth]

    def saturation_depth(self, difficulty: int, tolerance: float = 0.01) -> int:
        """The shallowest depth whose accuracy is within `tolerance` of the best (the paper's saturation)."""
        _, top = self.best(difficulty)
        return min(d for d in self.depths if self.accuracy[difficulty][d] >= top - tolerance)

    def solved_up_to(self, threshold: float = 0.9) -> int | None:
        """The largest difficulty d such that every difficulty <= d reaches `threshold` at some depth."""
        solved = None
        for difficulty in sorted(set(self.difficulties)):  # (given unsorted, an easier failure came too late)
            if self.best(difficulty)[1] < threshold:
                break
            solved = difficulty
        return solved

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task, "difficulty_name": self.difficulty_name, "difficulties": self.difficulties,
            "depths": self.depths, "count": self.count, "chance": self.chance,
            "trained_difficulties": self.trained_difficulties,
            "accuracy": {str(d): {str(r): a for r, a in row.items()} for d, row in self.accuracy.items()},
            "best": {str(d): {"depth": self.best(d)[0], "accuracy": self.best(d)[1]} for d in self.difficulties},
            "saturation_depth": {str(d): self.saturation_depth(d) for d in self.difficulties},
        }

    def table(self) -> str:
        head = f"{self.difficulty_name:>8} | " + " ".join(f"r={d:<4}" for d in self.depths)
        lines = [head, "-" * len(head)]
        trained = set(self.trained_difficulties or [])
        for difficulty in self.difficulties:
            mark = " " if difficulty in trained or not trained else "*"
            cells = " ".join(f"{self.accuracy[difficulty][d]:<6.2f}" for d in self.depths)
            lines.append(f"{difficulty:>7}{mark} | {cells}")
        if trained:
            lines.append("* harder than any training problem")
        return "\n".join(lines)


def item_states(
    model: RecurrentDepthLM, input_ids: torch.Tensor, labels: torch.Tensor, init_scale: float | None, seed: int
) -> torch.Tensor | None:
    """s_0 `[B, T, h]` with each row drawn alone from a stream seeded by `seed` and its tokens up to its last
    scored position (the columns after it, padding, are zero); None for a model whose s_0 is e."""
    if model.config.state_init != "random":
        return None
    scale = model.config.init_scale if init_scale is None else init_scale
    B, T = input_ids.shape
    states = torch.zeros((B, T, model.config.hidden_size), device=input_ids.device,
                         dtype=model.transformer.wte.weight.dtype)
    scored = (labels != -100).nonzero()
    for b in range(B):
        cols = scored[scored[:, 0] == b, 1]
        length = int(cols.max()) + 1 if len(cols) else T
        key = hashlib.blake2b(f"{seed}:{input_ids[b, :length].tolist()}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=input_ids.device).manual_seed(int.from_bytes(key, "little") % 2**63)
        states[b, :length] = model.initial_state(states[b : b + 1, :length], scale, generator)[0]
    return states


@torch.no_grad()
def answer_correct_at_depths(
    model: RecurrentDepthLM,
    batch: dict[str, torch.Tensor],
    depths: Sequence[int],
    init_scale: float | None = None,
    seed: int = 0,
) -> dict[int, torch.Tensor]:
    """depth -> bool [B]: is the whole answer (every scored token of `labels`) the greedy choice at that depth.

    Each row's s_0 comes from its own stream, seeded by `seed` and the row's tokens (up to its last
    scored one), so a problem gets the same s_0, and the same answer, whatever the batch, its
    padding or its neighbours: what it gets alone."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    targets = labels[:, 1:]
    scored = targets != -100
    states = item_states(model, input_ids, labels, init_scale, seed)
    out = {}
    for depth, logits in logits_at_depths(model, input_ids, depths, init_scale=init_scale, input_states=states):
        hits = (logits[:, :-1].argmax(-1) == targets) | ~scored
        out[depth] = hits.all(dim=1)
    return out


def accuracy_grid(
    model: RecurrentDepthLM,
    task: ReasoningTask,
    difficulties: Sequence[int],
    depths: Sequence[int],
    count: int = 100,
    seed: int = 1,
    batch_size: int = 100,
    encoder: ProblemEncoder | None = None,
    init_scale: float | None = None,
    trained_difficulties: Sequence[int] | None = None,
    progress: bool = False,
) -> AccuracyGrid:
    """Accuracy on `count` fresh problems per difficulty (seeded; disjoint from training streams by seed).

    `progress`: a progress bar with an ETA on stderr (problems scored out of all)."""
    from tqdm.auto import tqdm

    depths = check_depths(depths)
    if not isinstance(task, ReasoningTask):  # (a task name reached `.name` deep inside: an AttributeError)
        raise TypeError(f"task must be a ReasoningTask (get_task(name) gives one), got {type(task).__name__}")
    # (a batch_size <= 0 made range() skip every problem: accuracy 0 everywhere, or range()'s own error)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
    if not difficulties:
        raise ValueError("difficulties is empty: give at least one difficulty")
    for difficulty in difficulties:  # every one before the first is scored
        task.check_difficulty(difficulty)
    model = library_model(model)  # (a transformers-loaded model: the library model it holds)
    encoder = encoder or ProblemEncoder()
    grid = AccuracyGrid(
        task.name, task.difficulty_name, list(difficulties), depths, count,
        chance=task.chance(),
        trained_difficulties=list(trained_difficulties) if trained_difficulties is not None else None,
    )
    was_training = model.training
    model.eval()
    bar = tqdm(total=count * len(difficulties), unit="problem", desc=f"evaluating {task.name} at depths {depths}",
               dynamic_ncols=True, disable=None if progress else True)  # None: bars on a terminal only
    try:
        for difficulty in difficulties:
            problems = make_problems(task, count, [difficulty], seed=seed)
            correct = dict.fromkeys(depths, 0)
            for start in range(0, count, batch_size):
                batch = encoder.batch(problems[start : start + batch_size])
                batch = {k: v.to(model.device) for k, v in batch.items()}
                hits = answer_correct_at_depths(model, batch, depths, init_scale, seed=seed)
                for depth in depths:
                    correct[depth] += int(hits[depth].sum())
                bar.update(len(problems[start : start + batch_size]))
            grid.accuracy[difficulty] = {d: correct[d] / count for d in depths}
    finally:
        bar.close()
        model.train(was_training)
    return grid

"""A short CPU recipe: train a small recurrent-depth model on a reasoning task, then show depth helps.

    from recurrent_depth.evaluation.reasoning import ReasoningRunConfig, run_reasoning
    summary = run_reasoning(ReasoningRunConfig(task="chains", minutes=20, out="runs/chains"))

What makes it learnable in minutes on two cores (a plain attempt learned only to guess a digit):
- fresh problems every step, byte-level tokens, and loss on the answer only;
- a curriculum: training starts with the easiest problems and admits the next difficulty once the
  current hardest one is answered correctly often enough (`promote_at`);
- the paper's depth sampling (log-normal Poisson, mean `mean_recurrence`, truncated backprop
  `backprop_depth`), so the model learns to use whatever depth it is given;
- a small model (h = 128) and short rows (~100 tokens), ~3-10 optimizer steps per second.

The run writes `<out>/model` (a normal model directory with the byte tokenizer), `metrics.jsonl`
(one line per logged step), `accuracy.json` (difficulty x depth grid, training range included),
`accuracy_vs_depth.png` and `summary.json`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.config import ModelConfig
from recurrent_depth.data.tokenizer import save_tokenizer
from recurrent_depth.evaluation.readout import check_depths
from recurrent_depth.evaluation.reasoning.data import BYTE_VOCAB_SIZE, ProblemEncoder, special_ids
from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid, accuracy_grid
from recurrent_depth.evaluation.reasoning.tasks import get_task
from recurrent_depth.model.depth import DepthSampler
from recurrent_depth.model.recurrent import RecurrentDepthLM


@dataclass
class ReasoningRunConfig:
    """Everything a reasoning run needs; the defaults are the `quickstart --task chains` preset."""

    task: str = "chains"
    task_options: dict[str, Any] = field(default_factory=dict)
    train_difficulties: tuple[int, int] = (0, 6)  # inclusive range seen in training
    test_difficulties: list[int] | None = None  # default: 0 .. 2 x the hardest trained, within the task's range
    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    curriculum: bool = True
    promote_at: float = 0.85  # accuracy on the current hardest difficulty that admits the next one
    depth_curriculum: bool = True  # sample depths around min(mean_recurrence, difficulty + 1), at least 2
    intermediate: bool = True  # supervise every intermediate step where the task has one (training_segments)
    # Shift each training row's positions by a random offset (< max_seq_len - length), so that the longer
    # problems of the extrapolation test do not meet positions training never saw.
    position_jitter: bool = True
    hidden_size: int = 128
    num_heads: int = 4
    intermediate_size: int = 352
    prelude_layers: int = 1
    core_layers: int = 2
    coda_layers: int = 1
    mean_recurrence: int = 8
    backprop_depth: int = 4
    max_seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    minutes: float = 20.0
    max_steps: int | None = None
    eval_count: int = 100
    seed: int = 0
    threads: int | None = None
    log_every: int = 25
    out: str = "runs/reasoning"

    def validate(self) -> ReasoningRunConfig:
        task = get_task(self.task, **self.task_options)
        lo, hi = self.train_difficulties
        task.check_difficulty(lo)
        task.check_difficulty(hi)
        if lo > hi:
            raise ValueError(f"train_difficulties={self.train_difficulties}: expected (low, high) with low <= high")
        check_depths(self.depths, "depths")
        for name in ("batch_size", "eval_count", "mean_recurrence", "backprop_depth", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if not self.minutes > 0:
            raise ValueError(f"minutes={self.minutes!r} is invalid: expected a number > 0")
        if not 0 < self.promote_at <= 1:
            raise ValueError(f"promote_at={self.promote_at!r} is invalid: expected a number in (0, 1]")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} is invalid: expected a number > 0")
        return self

    def resolved_test_difficulties(self) -> list[int]:
        if self.test_difficulties is not None:
            return list(self.test_difficulties)
        task = get_task(self.task, **self.task_options)
        hi = min(task.max_difficulty, max(2 * self.train_difficulties[1], self.train_difficulties[1] + 2))
        return list(range(task.min_difficulty, hi + 1))

    def model_config(self) -> ModelConfig:
        ids = special_ids()
        return ModelConfig(
            vocab_size=BYTE_VOCAB_SIZE, hidden_size=self.hidden_size, num_heads=self.num_heads,
            intermediate_size=self.intermediate_size, prelude_layers=self.prelude_layers,
            core_layers=self.core_layers, coda_layers=self.coda_layers, mean_recurrence=self.mean_recurrence,
            mean_backprop_depth=self.backprop_depth, max_seq_len=self.max_seq_len,
            bos_token_id=ids["begin_text"], eos_token_id=ids["end_text"], pad_token_id=ids["pad"],
        )


# Per-task recipes for `rdepth quickstart --task NAME` (ReasoningRunConfig fields over its defaults),
# tuned on a 2-core CPU; the measured accuracy grids are in docs/evaluation.md.
# The small recipe both sequential tasks were tuned with: a 0.23 M-parameter model, rows of 32 problems.
_SEQUENTIAL_RECIPE: dict[str, Any] = dict(
    test_difficulties=[1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32], depths=[1, 2, 4, 8, 16, 32, 64],
    hidden_size=64, intermediate_size=176, batch_size=32, lr=3e-3, max_seq_len=128,
)
TASK_PRESETS: dict[str, dict[str, Any]] = {
    # The shell game has no constant-depth shortcut: the model learns to carry the ball from swap to
    # swap, one step of the recurrence at a time, and runs longer on games longer than any it saw.
    "shells": dict(_SEQUENTIAL_RECIPE, train_difficulties=(1, 16), minutes=18.0),
    # Running sums need one dependent addition per digit, but counting digits is a shortcut that a few
    # layers learn, so depth helps and extrapolation stops about two digits past training.
    "modsum": dict(_SEQUENTIAL_RECIPE, train_difficulties=(1, 12), minutes=20.0),
    "chains": dict(train_difficulties=(0, 6), minutes=20.0),
    "addition": dict(train_difficulties=(1, 6), minutes=20.0),
}


def task_preset(task: str, **overrides: Any) -> ReasoningRunConfig:
    """The tuned recipe for `task`, with `overrides` (None values ignored) on top; validated."""
    if task not in TASK_PRESETS:
        raise ValueError(f"unknown reasoning task {task!r}: expected one of {sorted(TASK_PRESETS)}")
    values = {"task": task, **TASK_PRESETS[task]}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ReasoningRunConfig(**values).validate()


class Curriculum:
    """Difficulties drawn uniformly from [low, current]; `current` rises when it is mastered."""

    def __init__(self, low: int, high: int, enabled: bool, promote_at: float, window: int = 256) -> None:
        self.low, self.high, self.promote_at, self.window = low, high, promote_at, window
        self.current = min(low + 1, high) if enabled else high
        self._hits: list[float] = []

    def draw(self, rng: random.Random, count: int) -> list[int]:
        return [rng.randint(self.low, self.current) for _ in range(count)]

    def observe(self, difficulties: list[int], correct: list[float]) -> bool:
        """Record the accuracy of rows at the current hardest difficulty; True when it was promoted."""
        self._hits.extend(c for d, c in zip(difficulties, correct) if d == self.current)
        self._hits = self._hits[-self.window :]
        ready = self.current < self.high and len(self._hits) >= self.window // 2
        if ready and sum(self._hits) / len(self._hits) >= self.promote_at:
            self.current += 1
            self._hits = []
            return True
        return False


def _lr_at(config: ReasoningRunConfig, step: int, elapsed_fraction: float) -> float:
    """Linear warmup, constant, linear cooldown over the last 20% of the time (or step) budget."""
    warm = min(1.0, (step + 1) / max(1, config.warmup_steps))
    cool = min(1.0, max(0.0, (1.0 - elapsed_fraction) / 0.2))
    return config.lr * warm * max(cool, 0.05)


def train_reasoning(config: ReasoningRunConfig, log: Any = print) -> tuple[RecurrentDepthLM, dict[str, Any]]:
    """Train on fresh problems until the time or step budget is spent; returns the model and stats."""
    config.validate()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    rng = random.Random(f"train:{config.seed}")
    depth_generator = torch.Generator().manual_seed(config.seed)
    task = get_task(config.task, **config.task_options)
    encoder = ProblemEncoder()
    model = RecurrentDepthLM(config.model_config()).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95),
    )
    curriculum = Curriculum(*config.train_difficulties, config.curriculum, config.promote_at)
    budget_s = config.minutes * 60
    start = time.perf_counter()
    step, tokens, promotions = 0, 0, []
    with open(out / "metrics.jsonl", "w") as metrics:
        while True:
            elapsed = time.perf_counter() - start
            fraction = elapsed / budget_s
            if config.max_steps is not None:
                fraction = max(fraction, step / config.max_steps)
            if fraction >= 1:
                break
            difficulties = curriculum.draw(rng, config.batch_size)
            batch = encoder.training_batch(
                [task.training_segments(rng, d, intermediate=config.intermediate) for d in difficulties]
            )
            mean_depth = config.mean_recurrence
            if config.depth_curriculum:  # easy problems need little depth: cheaper steps, more of them
                mean_depth = min(config.mean_recurrence, max(2, curriculum.current + 1))
            num_steps = DepthSampler(mean_depth, config.backprop_depth).sample_from(depth_generator)
            lr = _lr_at(config, step, fraction)
            for group in optimizer.param_groups:
                group["lr"] = lr
            position_ids = None
            if config.position_jitter:
                B, T = batch["input_ids"].shape
                room = max(config.max_seq_len - T, 0)
                offsets = torch.tensor([rng.randint(0, room) for _ in range(B)]).unsqueeze(1)
                position_ids = torch.arange(T).unsqueeze(0) + offsets
            output = model(batch["input_ids"], num_steps=num_steps, labels=batch["labels"], position_ids=position_ids)
            optimizer.zero_grad(set_to_none=True)
            output.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            if math.isfinite(grad_norm):
                optimizer.step()
            with torch.no_grad():  # per row: the fraction of its answer tokens that are the argmax
                targets = batch["labels"][:, 1:]
                scored = (targets != -100) & (targets != encoder.eos)  # the end token is too easy to count
                right = (output.logits[:, :-1].argmax(-1) == targets) & scored
                hits = (right.sum(1) / scored.sum(1).clamp(min=1)).tolist()
            loss_value = float(output.loss.detach())
            if curriculum.observe(difficulties, hits):
                promotions.append({"step": step, "difficulty": curriculum.current})
            tokens += int(batch["input_ids"].numel())
            step += 1
            if step % config.log_every == 0:
                row = {
                    "step": step, "loss": round(loss_value, 5), "answer_acc": round(sum(hits) / len(hits), 4),
                    "curriculum": curriculum.current, "num_steps": list(num_steps), "lr": lr,
                    "grad_norm": round(grad_norm, 4), "elapsed_s": round(time.perf_counter() - start, 1),
                    "tokens_per_s": round(tokens / (time.perf_counter() - start), 1),
                }
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                log(
                    f"step {step:5d}  loss {row['loss']:.4f}  answer acc {row['answer_acc']:.2f}  "
                    f"{task.difficulty_name} <= {curriculum.current}  r={sum(num_steps):2d}  "
                    f"{row['tokens_per_s']:.0f} tok/s  {row['elapsed_s']:.0f}s"
                )
    model.eval()
    stats = {
        "steps": step, "train_seconds": round(time.perf_counter() - start, 1), "tokens": tokens,
        "curriculum_reached": curriculum.current, "promotions": promotions,
    }
    return model, stats


def save_model(model: RecurrentDepthLM, path: Path) -> None:
    from recurrent_depth.evaluation.reasoning.data import byte_tokenizer

    model.save_pretrained(path)
    save_tokenizer(byte_tokenizer(), path, model_max_length=model.config.max_seq_len)


def run_reasoning(config: ReasoningRunConfig, log: Any = print) -> dict[str, Any]:
    """Train, save, evaluate accuracy against depth (in and beyond the training range), plot."""
    from recurrent_depth.evaluation.plots import plot_reasoning_grid

    config.validate()
    out = Path(config.out)
    model, stats = train_reasoning(config, log=log)
    save_model(model, out / "model")
    task = get_task(config.task, **config.task_options)
    # The hardest difficulty training actually drew: the curriculum may not reach the configured top.
    lo, hi = config.train_difficulties[0], stats["curriculum_reached"]
    grid = accuracy_grid(
        model, task, config.resolved_test_difficulties(), config.depths, count=config.eval_count,
        seed=10_000 + config.seed, trained_difficulties=list(range(lo, hi + 1)), progress=True,
    )
    summary = summarize(grid, config, stats)
    (out / "accuracy.json").write_text(json.dumps(grid.to_dict(), indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_reasoning_grid(grid, out / "accuracy_vs_depth.png")
    log(grid.table())
    log(json.dumps({k: summary[k] for k in ("solved_up_to", "extrapolation", "depth_gain")}))
    return summary


def summarize(grid: AccuracyGrid, config: ReasoningRunConfig, stats: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: how far past training it extrapolates and how much depth adds.

    "Beyond training" starts above the hardest difficulty training drew (`curriculum_reached`).
    """
    hi = stats["curriculum_reached"]
    shallow = grid.depths[0]
    harder = [d for d in grid.difficulties if d > hi]
    gain = {
        str(d): round(grid.best(d)[1] - grid.accuracy[d][shallow], 4) for d in grid.difficulties
    }
    return {
        "config": asdict(config),
        "train": stats,
        "solved_up_to": {"0.9": grid.solved_up_to(0.9), "0.5": grid.solved_up_to(0.5)},
        "extrapolation": {
            "trained_up_to": hi,
            "beyond_training_at_0.9": max([d for d in harder if grid.best(d)[1] >= 0.9], default=None),
            "beyond_training_at_0.5": max([d for d in harder if grid.best(d)[1] >= 0.5], default=None),
        },
        "depth_gain": gain,
        "accuracy": grid.to_dict(),
    }

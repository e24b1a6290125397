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

Training is the library's `Trainer`, configured by this recipe: a `ProblemStream` data source (fresh
problems, labels only on the answers), a `CurriculumDepth` sampler, AdamW with warmup and a cool-down
over the last 20% of the budget, and the accuracy grid as the final evaluation hook.

The run writes `<out>/model` (a normal model directory with the byte tokenizer), `metrics.jsonl`
(one line per step), `run.json`, `eval.jsonl` and `accuracy.json` (difficulty x depth grid, training
range included), `accuracy_vs_depth.png` and `summary.json`.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.config import ModelConfig
from recurrent_depth.data.tokenizer import save_tokenizer
from recurrent_depth.evaluation.readout import check_depths
from recurrent_depth.evaluation.reasoning.data import BYTE_VOCAB_SIZE, ProblemEncoder, special_ids
from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid, accuracy_grid
from recurrent_depth.evaluation.reasoning.tasks import get_task
from recurrent_depth.files import locked_directory
from recurrent_depth.model.depth import DepthSampler, truncate
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train import distributed as ddist
from recurrent_depth.train.batches import BatchSource
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.trainer import Trainer, TrainResult


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
        if self.test_difficulties is not None:  # checked now, not when the final evaluation meets one after training
            if not self.test_difficulties:
                raise ValueError("test_difficulties is empty: give at least one difficulty (or None: the default)")
            for difficulty in self.test_difficulties:
                task.check_difficulty(difficulty)
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


class ProblemStream(BatchSource):
    """Fresh problems every micro-batch, difficulties from the curriculum, loss on the answers only
    (`labels` are -100 elsewhere), positions shifted by a random offset when `position_jitter`.

    rank / world_size (torchrun): every rank draws the same global batch of `batch_size x world_size` problems
    from the same random stream and keeps rows `[rank B, (rank + 1) B)`, so the ranks train on one process's
    global batch, not on world_size copies of the same rows. The curriculum learns from every rank's rows (their
    accuracies are all-reduced in `observe`), so it stays the same on every rank, as the draws need."""

    def __init__(self, config: ReasoningRunConfig, curriculum: Curriculum, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}: expected 0 <= rank < world_size")
        self.config, self.curriculum = config, curriculum
        self.rank, self.world_size = rank, world_size
        self.task = get_task(config.task, **config.task_options)
        self.encoder = ProblemEncoder()
        self.rng = random.Random(f"train:{config.seed}")
        # the global batches' difficulties, one list per batch served and not yet observed (the trainer fetches a
        # step's micro-batches before it observes them)
        self.pending: deque[list[int]] = deque()
        self.promotions: list[dict[str, int]] = []
        self.steps = 0

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        config, rng = self.config, self.rng
        difficulties = self.curriculum.draw(rng, batch_size * self.world_size)
        self.pending.append(difficulties)
        rows = [self.encoder.row(self.task.training_segments(rng, d, intermediate=config.intermediate), end=True)
                for d in difficulties]
        mine = slice(self.rank * batch_size, (self.rank + 1) * batch_size)
        batch = self.encoder.pad_rows(rows[mine])
        if config.position_jitter:
            # the room of the global batch's longest row: every rank draws the same offsets (and stays in step)
            room = max(config.max_seq_len - max(len(tokens) for tokens, _ in rows), 0)
            offsets = torch.tensor([rng.randint(0, room) for _ in rows][mine]).unsqueeze(1)
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0) + offsets
        return batch

    def observe(self, batch: dict[str, torch.Tensor], output: Any) -> dict[str, Any]:
        """Per row, the fraction of its answer tokens that are the argmax; the curriculum learns from every rank's
        rows, and `answer_acc` is their mean."""
        targets = batch["labels"][:, 1:]
        scored = (targets != -100) & (targets != self.encoder.eos)  # the end token is too easy to count
        right = (output.logits[:, :-1].argmax(-1) == targets) & scored
        hits = right.sum(1) / scored.sum(1).clamp(min=1)
        difficulties = self.pending.popleft()
        if self.world_size > 1:  # the global batch's accuracies: each rank fills its own rows, the sum has them all
            B = len(hits)
            every = torch.zeros(B * self.world_size, dtype=torch.float64, device=hits.device)
            every[self.rank * B : (self.rank + 1) * B] = hits
            torch.distributed.all_reduce(every)
            hits = every
        row_hits = hits.tolist()
        if self.curriculum.observe(difficulties, row_hits):
            self.promotions.append({"step": self.steps, "difficulty": self.curriculum.current})
        self.steps += 1
        return {"answer_acc": round(sum(row_hits) / len(row_hits), 4), "curriculum": self.curriculum.current}

    def describe(self) -> dict[str, Any]:
        return {"source": "reasoning problems", "task": self.config.task, "options": self.config.task_options,
                "train_difficulties": list(self.config.train_difficulties)}


@dataclass(frozen=True)
class CurriculumDepth(DepthSampler):
    """The paper's depth distribution, centred on min(mean_recurrence, current difficulty + 1), at least 2:
    easy problems need little depth, so early steps are cheaper and more of them fit the budget."""

    curriculum: Curriculum | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # One stream for the whole run (the mean moves with the curriculum, so draws are not per-step).
        object.__setattr__(self, "_generator", torch.Generator().manual_seed(self.seed))

    def sample(self, step: int, rank: int = 0) -> tuple[int, int]:
        mean = self.mean_recurrence
        if self.curriculum is not None:
            mean = min(mean, max(2, self.curriculum.current + 1))
        return truncate(self.draw(self._generator, mean), self.backprop_depth)

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(DepthSampler)},
                "curriculum": self.curriculum is not None}


def trainer_config(config: ReasoningRunConfig) -> TrainConfig:
    """The `TrainConfig` of a reasoning run: AdamW, warmup, a cool-down over the last 20% of the budget."""
    optim = OptimConfig(name="adamw", lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=config.weight_decay,
                        grad_clip=1.0, warmup_steps=config.warmup_steps, cooldown_fraction=0.2,
                        min_lr=0.05 * config.lr, description="reasoning recipe")
    return TrainConfig(batch_size=config.batch_size, max_steps=config.max_steps, max_minutes=config.minutes,
                       optim=optim, seed=config.seed, out=config.out, eval_interval=0, save_every=0,
                       progress=False, tensorboard=False)


def _run_source(out: Path) -> Any:
    """The data source `out/run.json` records (None: no run.json, or not readable)."""
    from recurrent_depth.files import read_json

    try:
        return read_json(out / "run.json", 16 << 20, "run file")["data"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def train_reasoning(config: ReasoningRunConfig, log: Any = print) -> tuple[RecurrentDepthLM, dict[str, Any]]:
    """Train on fresh problems until the time or step budget is spent (the `Trainer`, configured by this
    recipe); returns the model and stats. The model directory is written to `<out>/model`."""
    result, curriculum, stream = _train(config, log)
    return result.model, _train_stats(result, curriculum, stream)


def _train_stats(result: TrainResult, curriculum: Curriculum, stream: ProblemStream) -> dict[str, Any]:
    return {
        "steps": result.steps, "train_seconds": round(result.elapsed_s, 1), "tokens": result.tokens,
        "curriculum_reached": curriculum.current, "promotions": stream.promotions,
    }


def _train(
    config: ReasoningRunConfig, log: Any, evaluate: Any = None
) -> tuple[TrainResult, Curriculum, ProblemStream]:
    """The recipe's `Trainer` run (`evaluate`: its evaluation hook); the curriculum and stream it used."""
    from recurrent_depth.evaluation.reasoning.data import byte_tokenizer

    config.validate()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    # the ranks under torchrun: rank 0 prepares `out` alone, and each rank trains on its share of every global batch
    joined = not ddist.group_initialized()
    env = ddist.init_distributed()
    tokenizer_dir = out / "tokenizer"

    def prepare_out() -> None:
        # A reasoning run always trains from scratch (its problem stream has no position to resume from); a run
        # training there now is refused, not cleared away (the trainer then locks the directory for its run).
        out.mkdir(parents=True, exist_ok=True)
        with locked_directory(out, "--out"):
            # (another run's checkpoints, a `rdepth train --out`'s, are refused: they were deleted before the trainer
            # looked; this recipe's: an accuracy.json, or a run.json of reasoning problems for a run stopped early)
            if ((out / "checkpoints").exists() and not (out / "accuracy.json").is_file()
                    and _run_source(out) != "reasoning problems"):
                raise ValueError(f"--out {out} holds the checkpoints of a run that is not a reasoning run's, which "
                                 f"this run would delete; choose a new --out")
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            if (out / "accuracy.json").is_file():  # this recipe's earlier model/ (the trainer refuses any other)
                shutil.rmtree(out / "model", ignore_errors=True)
        save_tokenizer(byte_tokenizer(), tokenizer_dir, model_max_length=config.max_seq_len)

    ddist.run_on_main(env, "prepare the output directory", prepare_out)
    torch.manual_seed(config.seed)
    model = RecurrentDepthLM(config.model_config())
    curriculum = Curriculum(*config.train_difficulties, config.curriculum, config.promote_at)
    stream = ProblemStream(config, curriculum, rank=env.rank, world_size=env.world_size)
    depth = CurriculumDepth(config.mean_recurrence, config.backprop_depth, seed=config.seed,
                            curriculum=curriculum if config.depth_curriculum else None)
    difficulty_name = stream.task.difficulty_name

    def log_progress(trainer: Trainer, record: dict[str, Any]) -> None:
        if record["step"] % config.log_every == 0:
            loss = float("nan") if record["loss"] is None else record["loss"]
            rate = trainer.state.tokens / max(record["elapsed_s"], 1e-9)
            trainer.log(f"step {record['step']:5d}  loss {loss:.4f}  answer acc {record['answer_acc']:.2f}  "
                        f"{difficulty_name} <= {record['curriculum']}  r={record['num_steps'][-1]:2d}  "
                        f"{rate:.0f} tok/s  {record['elapsed_s']:.0f}s")

    trainer = Trainer(trainer_config(config), model=model, data=stream, tokenizer_dir=tokenizer_dir, depth=depth,
                      evaluate=evaluate, on_step=log_progress, log=log)
    trainer.adopt_group(joined)  # (the group joined here is the trainer's to leave: close())
    with trainer:  # (closed after, as `rdepth train` ends: the logs, the DDP wrapper, then a group joined here left)
        result = trainer.run()
    model.eval()
    return result, curriculum, stream


def run_reasoning(config: ReasoningRunConfig, log: Any = print) -> dict[str, Any]:
    """Train, save, evaluate accuracy against depth (in and beyond the training range), plot."""
    from recurrent_depth.evaluation.plots import plot_reasoning_grid

    config.validate()
    out = Path(config.out)
    task = get_task(config.task, **config.task_options)

    def accuracy_by_depth(trainer: Trainer, final: bool) -> AccuracyGrid | None:
        if not final:
            return None
        # The hardest difficulty training actually drew: the curriculum may not reach the configured top.
        lo, hi = config.train_difficulties[0], trainer.source.curriculum.current
        trainer.model.eval()
        return accuracy_grid(
            trainer.model, task, config.resolved_test_difficulties(), config.depths, count=config.eval_count,
            seed=10_000 + config.seed, trained_difficulties=list(range(lo, hi + 1)), progress=True,
        )

    result, curriculum, stream = _train(config, log, evaluate=accuracy_by_depth)
    grid, stats = result.final_eval, _train_stats(result, curriculum, stream)
    summary = summarize(grid, config, stats)
    if stream.rank != 0:  # (under torchrun rank 0 writes and reports; every rank returns the summary)
        return summary
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

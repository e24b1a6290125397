"""`rdepth quickstart`: train a small recurrent-depth model on the embedded corpus and show test-time scaling.

One function, `quickstart(minutes, out)`, does the whole job on a fresh machine:

1. train a 4096-token BPE tokenizer on the Python standard library's source (`stdlib`),
2. pack it into token shards, train the `small` preset with the paper's depth sampler until the
   token budget or the time cap (wall clock, leaving time for the steps below),
3. evaluate validation loss at depths 1, 2, 4, 8, 16, 32, 64 (same tokens, same initial states),
4. write `<out>/model/` (a model directory), `<out>/summary.json`, three PNGs and a report,
   print the depth table and a sample completion.

The recipe (`QuickstartRecipe`) was tuned on a 2-core CPU; see docs/training.md for the numbers.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.accel.threads import ThreadGuard, choose_threads
from recurrent_depth.files import check_out_dir, locked_directory
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig

# What "test-time scaling is visible" means (the bar): the best depth at least this much below
# depth 1, and depth 64 (8x the training mean) within this much of the best.
MIN_DEPTH_GAIN = 0.05
MAX_EXTRAPOLATION_GAP = 0.02
# Time kept back at the end for the final evaluation's margin, saving, plots and the report (at most
# FIXED_RESERVE_SHARE of the time left: a short budget keeps less).
FIXED_RESERVE_S = 12.0
FIXED_RESERVE_SHARE = 0.25
# Training's share of the time left after that and one evaluation batch: at least MIN_TRAIN_SHARE, more where
# MIN_TRAIN_STEPS steps (at the measured step time) need it, up to MAX_TRAIN_SHARE; the final evaluation gets
# the rest (its batches stop at their deadline, after one batch at least, so the estimate need not be a worst
# case).
MIN_TRAIN_SHARE = 0.5
MAX_TRAIN_SHARE = 0.8
MIN_TRAIN_STEPS = 20
EVAL_MARGIN = 1.1  # on the measured evaluation batch time


@dataclass(frozen=True)
class BudgetPlan:
    eval_batches: int  # final-evaluation batches planned
    train_s: float  # training window from now
    reserve_s: float  # kept after training: evaluation + FIXED_RESERVE_S (or less)
    fixed_s: float  # of which saving, plots and the report


def plan_budget(left_s: float, eval_batch_s: float, step_s: float, max_eval_batches: int,
                fixed_s: float = FIXED_RESERVE_S) -> BudgetPlan:
    """Split the `left_s` seconds left between training and the final evaluation, from the measured seconds of
    one evaluation batch and one training step. Training always gets a window (at least MIN_TRAIN_SHARE of
    what the fixed end and the one evaluation batch that always runs leave) whenever any time is left after
    those; a busy machine evaluates fewer batches. The first batch is reserved in full, so a short budget holds
    (training shrinks instead); where even it does not fit, training gets no time."""
    left_s = max(float(left_s), 0.0)
    fixed = min(fixed_s, FIXED_RESERVE_SHARE * left_s)
    usable = left_s - fixed
    batch = EVAL_MARGIN * max(eval_batch_s, 0.0)
    rest = usable - min(batch, usable)  # after the first evaluation batch
    train_min = min(MAX_TRAIN_SHARE * rest, max(MIN_TRAIN_SHARE * rest, MIN_TRAIN_STEPS * max(step_s, 0.0)))
    fits = 1 + int((rest - train_min) // batch) if batch > 0 else max_eval_batches
    eval_batches = max(1, min(max_eval_batches, fits))
    eval_s = min(eval_batches * batch, usable - train_min)
    return BudgetPlan(eval_batches=eval_batches, train_s=usable - eval_s, reserve_s=fixed + eval_s, fixed_s=fixed)


@dataclass
class QuickstartRecipe:
    """The quickstart's training recipe (the defaults are the tuned ones)."""

    preset: str = "small"
    data: str = "stdlib"
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 8
    max_tokens: int = 4_000_000
    val_fraction: float = 0.02
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig.from_preset(
            "demo",
            lr=4e-3,
            warmup_steps=20,
            cooldown_fraction=0.3,
        )
    )
    eval_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    eval_batches: int = 6
    sample_prompt: str = "import os\nimport sys\n\n\ndef main():\n"
    sample_tokens: int = 48

    def train_config(self, out: Path, seed: int) -> TrainConfig:
        return TrainConfig(
            preset=self.preset, data=self.data, tokenizer=str(out / "tokenizer"), val_fraction=self.val_fraction,
            keep_all=True, data_dir=str(out / "data"), seq_len=self.seq_len, batch_size=self.batch_size,
            max_steps=None, max_tokens=self.max_tokens, optim=self.optim, eval_depths=list(self.eval_depths),
            eval_batches=self.eval_batches, eval_interval=0, save_every=0, keep_last=1, seed=seed, out=str(out),
        )


def prepare_tokenizer(out: Path, recipe: QuickstartRecipe, seed: int, log: Callable[[str], None]) -> Path:
    """Train the BPE on the stdlib's training documents, or reuse `<out>/tokenizer` if it matches."""
    from recurrent_depth.data import build_tokenizer, load_corpus

    tok_dir = out / "tokenizer"
    corpus = load_corpus(recipe.data)
    info = corpus.info()
    meta_file = tok_dir / "tokenizer_training.json"
    if meta_file.is_file() and (tok_dir / "tokenizer.json").is_file():
        meta = json.loads(meta_file.read_text())
        split = meta.get("split") or {}
        if (meta.get("corpus", {}).get("sha256") == info.sha256 and meta.get("vocab_size") == recipe.vocab_size
                and split.get("val_fraction") == recipe.val_fraction and split.get("seed") == seed):
            log(f"reusing the tokenizer in {tok_dir}")
            return tok_dir
    start = time.perf_counter()
    build_tokenizer(corpus, recipe.vocab_size, val_fraction=recipe.val_fraction, seed=seed, out_dir=tok_dir)
    log(f"trained a {recipe.vocab_size}-token BPE on {info.num_documents} {info.name} files "
        f"({info.num_bytes / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s")
    return tok_dir


# What a quickstart run writes in its --out besides the tokenizer and token-shard caches (cleared on a rerun).
RUN_DIRS = ("checkpoints", "model", "tensorboard")
RUN_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json", "run.json", "report.md", "report.html",
             "loss_curve.png", "val_loss_by_depth.png", "sampled_depths.png")


def _json_field(path: Path, *keys: str) -> Any:
    """`path`'s JSON at `keys` (None: no such file, not JSON, or no such field)."""
    from recurrent_depth.files import read_json

    try:
        value = read_json(path, 16 << 20, "file")
        for key in keys:
            value = value.get(key)
        return value
    except (OSError, ValueError, AttributeError):
        return None


def is_quickstart_run(out: Path) -> bool:
    """Whether `out` holds an earlier quickstart's run: its summary.json, or (a run stopped before writing it) its
    run.json, whose tokenizer and token shards are `out`'s caches (a `rdepth train` run records its own or none)."""
    if _json_field(out / "summary.json", "title") == "rdepth quickstart":
        return True
    tokenizer, data_dir = (_json_field(out / "run.json", "config", key) for key in ("tokenizer", "data_dir"))
    return (isinstance(tokenizer, str) and isinstance(data_dir, str)
            and Path(tokenizer).resolve() == (out / "tokenizer").resolve()
            and Path(data_dir).resolve() == (out / "data").resolve())


def clear_previous_run(out: Path) -> None:
    """A quickstart always trains from scratch; tokenizer and token shards are caches and stay. Another run's
    model/, checkpoints and records (a `rdepth train --out` directory, or a user's files) are refused, not deleted."""
    found = [name for name in RUN_DIRS + RUN_FILES if (out / name).exists()]
    if found and not is_quickstart_run(out):
        raise ValueError(f"--out {out} holds {', '.join(found[:4])}{', ...' if len(found) > 4 else ''} of a run that "
                         f"is not a quickstart's, which a quickstart would delete; choose a new --out")
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)


def estimate_eval_seconds(model, rows: torch.Tensor, depths: list[int], batches: int,
                          step_depth: float | None = None) -> float | tuple[float, float]:
    """Time the final evaluation will take, from one timed batch `rows [B, T + 1]` at a shallow depth
    (untrained weights cost the same as trained ones, so `model` can be a freshly built one). With
    `step_depth` (the sampler's mean depth): (that, the seconds of one training step on such a batch, its
    forward and backward taken as 3 forwards of prelude + step_depth core steps + coda)."""
    from recurrent_depth.train.validation import depth_losses

    model.eval()
    depth_losses(model, rows, [1])  # warm-up
    start = time.perf_counter()
    depth_losses(model, rows, [4])
    seconds = time.perf_counter() - start
    cfg = model.config
    # Cost in layer passes: prelude + 4 steps of the core + coda, vs prelude + max depth steps + a coda per depth.
    probe = cfg.prelude_layers + 4 * cfg.core_layers + cfg.coda_layers + 1
    full = cfg.prelude_layers + max(depths) * cfg.core_layers + len(depths) * (cfg.coda_layers + 1)
    if step_depth is None:
        return seconds * full / probe * batches
    step = 3 * (cfg.prelude_layers + step_depth * cfg.core_layers + cfg.coda_layers + 1)
    return seconds * full / probe * batches, seconds * step / probe


@torch.no_grad()
def greedy_completion(model, tokenizer, prompt: str, new_tokens: int, num_steps: int) -> str:
    """Greedy continuation of `prompt` at a fixed depth, s0 = 0 (deterministic), by `rd.generate`
    (which stops at the config's eos); the prompt keeps its last tokens when it would not fit."""
    from recurrent_depth.inference import generate

    ids = tokenizer.encode(prompt).ids
    new_tokens = min(new_tokens, model.config.max_seq_len - 1)
    ids = ids[-(model.config.max_seq_len - new_tokens):]
    model.eval()
    out = generate(model, torch.tensor([ids]), max_new_tokens=new_tokens, num_steps=num_steps, init_scale=0.0)
    return tokenizer.decode(out.sequences[0, : len(ids) + int(out.lengths[0])].tolist(), skip_special_tokens=True)


MINUTES_RANGE = (0.5, 24 * 60)  # the time cap's bounds: enough for one evaluation; at most a day


def check_minutes(minutes: object, name: str) -> None:
    """A one-line ValueError naming `name` unless `minutes` is a number in MINUTES_RANGE."""
    low, high = MINUTES_RANGE
    if not isinstance(minutes, int | float) or isinstance(minutes, bool) or not low <= minutes <= high:
        raise ValueError(f"{name}={minutes!r} is invalid: expected a number of minutes in [{low:g}, {high:g}]")


def quickstart(
    minutes: float = 10.0,
    out: str | Path = "runs/quickstart",
    seed: int = 0,
    recipe: QuickstartRecipe | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the quickstart within `minutes` of wall time in all; returns the summary (also in summary.json)."""
    from recurrent_depth.data import load_tokenizer, prepare_dataset
    from recurrent_depth.model.recurrent import RecurrentDepthLM
    from recurrent_depth.train import report
    from recurrent_depth.train.trainer import Trainer, TrainingInterrupted

    check_minutes(minutes, "minutes")
    recipe = recipe or QuickstartRecipe()
    out = Path(out)
    # A bad seed (or recipe) and an --out naming a file are refused before the tokenizer and shards are built.
    cfg = recipe.train_config(out, seed)
    cfg.validate()
    check_out_dir(out, "--out")
    start = time.perf_counter()
    deadline = start + 60.0 * minutes
    out.mkdir(parents=True, exist_ok=True)
    # A run training there now is refused, not cleared away; the lock is held while the tokenizer and the token
    # shards are written too (a second quickstart there meanwhile is refused), then the trainer locks it for its run.
    with locked_directory(out, "--out"):
        clear_previous_run(out)
        used_threads = threads if threads is not None else choose_threads()
        torch.set_num_threads(used_threads)
        log(f"rdepth quickstart: {minutes:g} minute budget, {used_threads} thread(s), output in {out}")

        tok_dir = prepare_tokenizer(out, recipe, seed, log)
        t_data = time.perf_counter()
        data = prepare_dataset(recipe.data, tok_dir, recipe.seq_len, out / "data", val_fraction=recipe.val_fraction,
                               seed=seed, keep_all=True)
    if not data.metadata.get("reused"):
        splits = data.metadata["splits"]
        log(f"packed {splits['train']['tokens']:,} training and {splits['validation']['tokens']:,} validation "
            f"tokens in {time.perf_counter() - t_data:.1f}s")
    prep_seconds = time.perf_counter() - start

    specials = data.metadata["tokenizer"]["special_token_ids"]
    probe = RecurrentDepthLM(cfg.model_config(data.metadata["tokenizer"]["vocab_size"],
                                              bos_token_id=specials["begin_text"], eos_token_id=specials["end_text"],
                                              pad_token_id=specials["pad"]))
    val_rows = next(iter(data.dataset("validation", shuffle=False).iter_batches(cfg.batch_size, drop_last=False)))
    mean_depth = cfg.mean_recurrence if cfg.mean_recurrence is not None else probe.config.mean_recurrence
    per_batch, per_step = estimate_eval_seconds(probe, val_rows, list(recipe.eval_depths), 1,
                                                step_depth=float(mean_depth))
    del probe
    # On a slow or busy machine, evaluate fewer batches rather than eat the training time; training always
    # keeps a share of what is left (plan_budget).
    eval_batches = plan_budget(deadline - time.perf_counter(), per_batch, per_step, recipe.eval_batches).eval_batches
    if eval_batches < recipe.eval_batches:
        log(f"this machine is slow right now: evaluating {eval_batches} instead of {recipe.eval_batches} batches")
        cfg = cfg.replace(eval_batches=eval_batches)
    guard = ThreadGuard(log)
    trainer = Trainer(cfg, log=log, on_step=guard)
    # The deadlines from the time left once the trainer is built (building it takes time too).
    plan = plan_budget(deadline - time.perf_counter(), per_batch, per_step, eval_batches)
    reserve = plan.reserve_s
    trainer.deadline = deadline - reserve
    trainer.eval_deadline = deadline - plan.fixed_s
    train_window = trainer.deadline - time.perf_counter()
    log(f"training for up to {max(train_window, 0):.0f}s (keeping {reserve:.0f}s for evaluation at depths "
        f"{', '.join(map(str, recipe.eval_depths))} and saving)")
    if train_window < 30:
        log("warning: under 30 s left for training; raise --max-minutes for a meaningful result")
    over = plan.fixed_s + EVAL_MARGIN * per_batch - (deadline - time.perf_counter())
    if over > 1:
        log(f"warning: the {minutes:g}-minute budget will overrun by about {over:.0f}s: preparation left too little "
            f"time for one evaluation batch (~{per_batch:.0f}s on this machine right now)")
    run_start = time.perf_counter()
    try:
        result = trainer.run()
    except TrainingInterrupted as exc:  # the trainer says "continue with --resume": a quickstart has no --resume
        exc.args = (f"{str(exc).split(';')[0]}; a quickstart does not resume: run it again to train from scratch "
                    f"(the tokenizer and token shards in {out} are reused)",)
        raise
    run_end = time.perf_counter()
    train_seconds = result.elapsed_s

    assert result.final_eval is not None
    by_depth = {str(d): v for d, v in sorted(result.final_eval.loss.items())}
    best_depth = result.final_eval.best_depth()
    best = by_depth[str(best_depth)]
    first = by_depth[str(min(recipe.eval_depths))]
    deepest = by_depth[str(max(recipe.eval_depths))]
    gain, gap = first - best, deepest - best
    scaling_ok, stable_ok = gain >= MIN_DEPTH_GAIN, gap <= MAX_EXTRAPOLATION_GAP
    verdict = (f"best depth {best_depth} is {gain:.3f} nats below depth {min(recipe.eval_depths)} "
               f"({'>=' if scaling_ok else '<'} {MIN_DEPTH_GAIN}); depth {max(recipe.eval_depths)} is {gap:.3f} "
               f"above the best ({'<=' if stable_ok else '>'} {MAX_EXTRAPOLATION_GAP})")

    metrics = report.read_jsonl(out / "metrics.jsonl")
    evals = report.read_jsonl(out / "eval.jsonl")
    images = {
        "Training loss": report.plot_loss_curve(metrics, out / "loss_curve.png", evals),
        "Validation loss vs test-time depth": report.plot_val_by_depth(
            by_depth, out / "val_loss_by_depth.png", trainer.sampler.mean_recurrence),
        "Sampled training depths": report.plot_depth_histogram(
            report.sampled_depths(metrics), out / "sampled_depths.png", trainer.sampler.expected_total_steps()),
    }
    tokenizer = load_tokenizer(tok_dir)
    sample_depth = int(round(trainer.sampler.mean_recurrence))
    sample = greedy_completion(result.model, tokenizer, recipe.sample_prompt, recipe.sample_tokens, sample_depth)
    corpus = data.metadata["corpus"]
    summary: dict[str, Any] = {
        "title": "rdepth quickstart",
        "val_loss_by_depth": by_depth,
        "token_correlation_by_depth": {str(d): v for d, v in sorted(result.final_eval.token_correlation.items())},
        "best_depth": best_depth,
        "depth_gain": gain,
        "extrapolation_gap": gap,
        "test_time_scaling": scaling_ok,
        "stable_extrapolation": stable_ok,
        "verdict": verdict,
        "val_tokens": result.final_eval.tokens,
        # the batches evaluated: the planned ones stop at the evaluation's deadline (after one at least)
        "eval_batches": -(-result.final_eval.tokens // (cfg.batch_size * recipe.seq_len)),
        "preset": recipe.preset,
        "parameters": result.model.num_parameters(),
        "steps": result.steps,
        "tokens": result.tokens,
        "stop_reason": result.stop_reason,
        "skipped_steps": result.skipped_steps,
        "final_train_loss": sum(result.losses[-20:]) / max(1, len(result.losses[-20:])),
        "tokens_per_s": result.tokens / train_seconds if train_seconds else 0.0,
        "train_seconds": train_seconds,
        "prep_seconds": prep_seconds,
        "eval_and_save_seconds": run_end - run_start - train_seconds,
        "minutes": minutes,
        "threads": used_threads,
        "thread_changes": guard.changes,
        "seed": seed,
        "mean_recurrence": trainer.sampler.mean_recurrence,
        "backprop_depth": trainer.sampler.backprop_depth,
        "data_description": f"{corpus['name']}: {corpus['num_documents']} files, {corpus['num_bytes'] / 1e6:.1f} MB, "
                            f"sha256 {corpus['sha256'][:12]}",
        "recipe": _recipe_dict(recipe),
        "model_dir": str(result.model_dir),
        "sample_prompt": recipe.sample_prompt,
        "sample_depth": sample_depth,
        "sample_completion": sample,
        "images": {k: str(v) for k, v in images.items()},
    }
    summary["total_seconds"] = time.perf_counter() - start
    summary["reports"] = report.write_training_report(out, summary, images, sample)
    summary["total_seconds"] = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    log("")
    log(report.format_depth_table(by_depth))
    log("")
    log(verdict)
    log(f"trained {result.steps} steps / {result.tokens:,} tokens in {train_seconds:.0f}s; "
        f"total {summary['total_seconds']:.0f}s of {60 * minutes:.0f}s")
    log(f"\nsample (greedy, depth {sample_depth}):\n{sample}\n")
    log(f"model: {result.model_dir}   report: {out / 'report.html'}   summary: {out / 'summary.json'}")
    return summary


def _recipe_dict(recipe: QuickstartRecipe) -> dict[str, Any]:
    data = asdict(recipe)
    data["optim"] = recipe.optim.to_dict()
    data["eval_depths"] = list(recipe.eval_depths)
    return data

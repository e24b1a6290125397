"""The training loop: the paper's recipe, one readable loop from one CPU to torchrun.

    result = Trainer(TrainConfig(preset="tiny", data="stdlib", max_steps=200, out="runs/tiny")).run()

Each optimizer step runs `grad_accum` micro-batches. Micro-batch number `m` (counted over the whole
run, so a resumed run continues the count) draws its depth `(no_grad_steps, grad_steps) =
DepthSampler(seed).sample(m)` (the same on every rank: locked-step) and its initial state from a
generator seeded by (seed, m, rank); the loss is next-token cross-entropy on the final output.
Then: clip the gradient norm, skip (and count) the step if the norm is not finite, step the
optimizer(s) at the scheduled learning rate. Parallelism, activation checkpointing and compile
are applied to the model from outside (see `prepare_model`).

Recipes configure the loop through the constructor rather than writing their own: `model=` (any
`nn.Module` whose output has `logits` or `loss`, e.g. a transformers causal LM), `data=` (a
`BatchSource`: fresh problems, an answer-only loss mask through `-100` labels), `depth=` (a sampler
with `sample(micro_step, rank)`), `evaluate=` (the evaluation hook), `stop_when=` and `deadline=`.
A model without a depth sampler is called without `num_steps` (one forward, as any causal LM).

Outputs in `cfg.out`: `run.json` (resolved config, versions, hardware, data hashes), `metrics.jsonl`
(one line per optimizer step, flushed), `eval.jsonl` (validation by depth), `checkpoints/step-N/`,
`tensorboard/` and, at the end, `model/` (weights + tokenizer: a model directory). With `out=None`
(and `data=`) nothing is written: experiments read the run from `on_step` and the `TrainResult`.
What goes into checkpoints and how a run resumes is `train/trainer_checkpoints.py`; run.json, the
JSON-lines logs and tensorboard are `train/run_record.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recurrent_depth import accel
from recurrent_depth.accel.allocator import keep_freed_memory
from recurrent_depth.accel.cpu import slow_bf16_warnings
from recurrent_depth.config import ModelConfig
from recurrent_depth.data.corpus import Corpus, load_corpus
from recurrent_depth.data.tokenizer import eos_token_ids
from recurrent_depth.files import DIR_LOCK_FILE, check_out_dir, lock_directory
from recurrent_depth.generation_config import GENERATION_CONFIG_FILE
from recurrent_depth.model.mixers.dsa import pop_indexer_loss
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train import distributed as ddist
from recurrent_depth.train import trainer_checkpoints
from recurrent_depth.train.batches import BatchSource, RowBatches, batch_to
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.depth import DepthSampler, stream_seed
from recurrent_depth.train.distill import (
    Distillation,
    check_vocabularies,
    find_teacher_dir,
    load_teacher,
    teacher_record,
    teacher_summary,
)
from recurrent_depth.train.distill_cache import (
    CachedTeacher,
    has_cache,
    matching_manifest,
    teacher_change,
    write_cache,
)
from recurrent_depth.train.init_from import (
    depth_change_note,
    find_model_dir,
    kept_depth_note,
    load_for_training,
    resolved_config,
    run_tokenizer_dir,
    start_record,
)
from recurrent_depth.train.lora import adapter_settings, base_model_of, is_peft_model
from recurrent_depth.train.objective import LanguageModeling, Objective
from recurrent_depth.train.optim import build_optimizers, clip_and_check_grads
from recurrent_depth.train.qk_clip import QKClip
from recurrent_depth.train.run_record import (
    EVAL_FILE,
    METRICS_FILE,
    RUN_FILE,
    TENSORBOARD_DIR,
    JsonlLog,
    git_revision,
    hardware_info,
    library_versions,
    num_parameters,
    open_tensorboard,
    record_entry_holding,
    run_metadata,
    set_aside_run_record,
    tensorboard_step,
    write_run_file,
)
from recurrent_depth.train.schedule import lr_at, set_lr
from recurrent_depth.train.trainer_checkpoints import RESUMABLE_CHANGES
from recurrent_depth.train.validation import DepthEval, autocast_context, validation_loss_by_depth

# Public names of the run record and of checkpointing stay importable from here, where they lived before.
__all__ = [
    "EVAL_FILE", "METRICS_FILE", "MODEL_DIR", "RESUMABLE_CHANGES", "RUN_FILE", "TOKENIZER_DIR", "JsonlLog",
    "LoopState", "StopTraining", "TooManySkippedSteps", "Trainer", "TrainingInterrupted", "TrainResult",
    "check_out_state", "compile_core", "git_revision", "hardware_info", "library_versions", "num_parameters",
    "prepare_model", "train", "validation_by_depth",
]

MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
# a name of each kind of file a run writes in `out` (run.json and logs, tokenizer and checkpoint files, shards)
OUT_FILE_NAMES = ("x.json", "x.jsonl", "x.jinja", "x.safetensors", "x.bin", "x.tmp")
# What a run starting from step 0 would overwrite of an earlier session in its `out` (set aside first).
EARLIER_RUN_NAMES = (RUN_FILE, METRICS_FILE, EVAL_FILE, TENSORBOARD_DIR, MODEL_DIR)


class StopTraining(Exception):
    """Raised by an `on_step` callback to stop the loop at once (tests use it to simulate a crash)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), or SIGTERM / SIGUSR1 (a cluster's preemption notice: SLURM, torchrun passing it on), during
    training: raised after the step in progress finished and was checkpointed. `signum` is the signal;
    `exit_status` (128 + signum: 130, 143 for SIGTERM, 138 for SIGUSR1 on Linux) is what `rdepth` exits with."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class TooManySkippedSteps(ValueError):
    """More than `max_skipped_fraction` of the run's steps were skipped for a non-finite gradient.

    Raised at the very end (checkpoint, model and final evaluation are written); `result` is the run's
    `TrainResult`. A ValueError because the usual cause is the configuration (a learning rate too high),
    so every command that trains reports it in one line."""

    def __init__(self, message: str, result: TrainResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class LoopState:
    """What the loop needs besides weights and optimizer to continue exactly (saved in checkpoints)."""

    step: int = 0  # optimizer steps done
    micro_step: int = 0  # micro-batches done (the depth sampler's step)
    tokens: int = 0  # training tokens consumed, all ranks
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient
    elapsed_s: float = 0.0  # training wall time so far (earlier sessions included)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TrainResult:
    out: Path | None  # None: nothing was written
    model: nn.Module = field(repr=False)  # (its repr is the whole module tree)
    model_dir: Path | None
    steps: int
    tokens: int
    skipped_steps: int
    elapsed_s: float
    stop_reason: str
    final_eval: Any  # a DepthEval by default; whatever the `evaluate` hook returned otherwise
    last_checkpoint: Path | None
    tokenizer_dir: Path | None
    losses: list[float] = field(default_factory=list)


class Trainer:
    """Set up from a `TrainConfig`, then `run()`. `cfg.out=None` writes nothing (no run.json, logs,
    checkpoints or model directory; needs `data`): the run is what `on_step` sees and `run()` returns.

    corpus: optional `Corpus` object used instead of `cfg.data` (tests, notebooks).
    model: a module to train instead of the `RecurrentDepthLM` that `cfg` describes (moved to the device,
        not re-initialised). Its output needs `logits` (batches with `targets`) or `loss` (batches with
        `labels`); the final weights are written with its `save_pretrained` when it has one.
    data: a `BatchSource` used instead of `cfg.data`'s token shards (needs `model`, since the shards'
        tokenizer is what would set the vocabulary). Without `evaluate`, such a run has no evaluation.
    tokenizer_dir: a tokenizer directory saved beside the weights (with `data`; the shards bring their own).
    depth: the depth sampler (`sample(micro_step, rank) -> num_steps`); default: `cfg`'s `DepthSampler`
        for a `RecurrentDepthLM`, none (no `num_steps` argument) for any other model.
    evaluate: hook `(trainer, final) -> result` run every `cfg.eval_interval` steps and at the end; a result
        with `to_dict()` (or a dict) is logged to `eval.jsonl`. Default: validation loss by depth.
    stop_when: hook `(trainer) -> reason | None` checked before each step, on top of the step, token and
        time budgets (e.g. a CPU-time budget).
    on_step: optional callback `(trainer, record)` after each optimizer step; may raise `StopTraining`.
    log: where status lines go (default: print on rank 0).
    deadline: optional `time.perf_counter()` value by which training must stop (on top of
        `cfg.max_minutes`); `rdepth quickstart` uses it to leave time for evaluation and saving.
    eval_deadline: optional `time.perf_counter()` value by which the final evaluation should end
        (it then evaluates fewer than `cfg.eval_batches` batches, at least one).
    objective: the forward and loss of a micro-batch (`train/objective.py`); default `LanguageModeling`
        (next-token cross-entropy at the drawn depth). RL's policy-gradient losses plug in here.
    save_dtype: the dtype of the final model directory's weights (default: as trained); checkpoints keep
        the trained dtype. `cfg.init_from` (train/init_from.py) loads that model unless `model` is given,
        and sets it to the directory's stored dtype.
    start_dir: the model directory a given `model` was loaded from (`rdepth rl --init-from`); default: the one
        `cfg.init_from` names, if any. Its identity (`checkpoint.model_identity`) is recorded in each checkpoint
        (`start`, with the run's tokenizer files' digests, which a run from scratch records too), and a `--resume`
        from another model directory, or from one (or a tokenizer) changed since, is refused. Its retrofit.json and
        generation_config.json are written into every checkpoint and the final model directory of a full-weight run;
        a resumed one takes them from its checkpoint (as the run started), not from the start directory again.
    budget_flags: the flags that raise the run's budgets, as the command spells them, for the hint a finished run
        resumed prints (`rdepth rl`: "--updates").
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        corpus: Any | None = None,
        model: nn.Module | None = None,
        data: BatchSource | None = None,
        tokenizer_dir: str | Path | None = None,
        depth: Any | None = None,
        evaluate: Callable[[Trainer, bool], Any] | None = None,
        stop_when: Callable[[Trainer], str | None] | None = None,
        on_step: Callable[[Trainer, dict[str, Any]], None] | None = None,
        log: Callable[[str], None] | None = None,
        device: str | None = None,
        deadline: float | None = None,
        eval_deadline: float | None = None,
        objective: Objective | None = None,
        save_dtype: torch.dtype | None = None,
        start_dir: str | Path | None = None,
        budget_flags: str = "--max-steps, --max-tokens or --max-minutes",
    ) -> None:
        from recurrent_depth.integrations.export import read_companions

        # (a dict, or a module that is not one, failed deep inside with an AttributeError)
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"Trainer takes a TrainConfig (TrainConfig(max_steps=...), or TrainConfig.from_yaml(path)),"
                            f" got {type(cfg).__name__}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"Trainer(model=...) takes a torch module (RecurrentDepthLM.from_pretrained(path) loads "
                            f"one; TrainConfig(init_from=path) starts from a directory), got {type(model).__name__}")
        # --init-from: the model directory's config and tokenizer, and the optimizer for all weights or an adapter
        cfg = resolved_config(cfg, lora=is_peft_model(model))
        if start_dir is None and cfg.init_from is not None:
            start_dir = find_model_dir(cfg.init_from)
        # where the run started, as each checkpoint records it: the model directory (none: weights made here) and the
        # tokenizer files' digests (a run training its own tokenizer records them once it has it: `_prepare_data`),
        # and the files of that directory that the run's checkpoints and model/ keep (retrofit.json, ...)
        start_path = Path(start_dir) if start_dir is not None else None
        tokenizer = run_tokenizer_dir(cfg, start_path)
        self.start_files = read_companions(start_path, before="training") if start_path is not None else {}
        self.start = start_record(start_path, tokenizer, self.start_files) if tokenizer is not None else None
        if data is not None and model is None and cfg.init_from is None:
            raise ValueError("Trainer(data=...) needs model=... too: without token shards nothing sets the vocabulary")
        if data is not None and corpus is not None:
            raise ValueError("Trainer: pass corpus= (a text corpus to tokenize) or data= (a BatchSource), not both")
        self.cfg = cfg
        self.deadline = deadline
        self.eval_deadline = eval_deadline
        self.save_dtype = save_dtype
        self.stop_when = stop_when
        # (`rdepth rl` counts updates with --updates: its --max-steps is the exit criterion's bound)
        self.budget_flags = budget_flags
        self.objective: Objective = objective if objective is not None else LanguageModeling()
        joined = not ddist.group_initialized()
        self.env = ddist.init_distributed(device)
        self._owns_group = self.env.enabled and joined  # (close() leaves a group that this Trainer joined)
        self._ddp_released = False
        if cfg.keep_freed_memory and self.env.device.type == "cpu":
            keep_freed_memory()
        self.out = Path(cfg.out) if cfg.out is not None else None
        self.on_step = on_step
        self._log = log if log is not None else print
        if cfg.init_from is not None and cfg.optim_default is not None:  # (chosen for the run: say which)
            self.log(f"optimizer: the {cfg.optim_default} preset ({cfg.optim.name}, lr {cfg.optim.lr:g}): the run "
                     "names no optimizer preset or learning rate (--optim-preset, --lr)")
        depth_note = (depth_change_note(cfg, is_peft_model(model), self.start_files.get(GENERATION_CONFIG_FILE))
                      if cfg.init_from is not None else None)
        if depth_note is not None:  # (--mean-recurrence / --backprop-depth / --model-set change DIR's config)
            self.log(depth_note)
        if (kept_note := kept_depth_note(cfg)) is not None:  # (a resumed --init-from run of older code)
            self.log(kept_note)
        self.state = LoopState()
        self.losses: list[float] = []
        self.session_start = 0.0
        self.session_start_elapsed = 0.0
        self.session_steps = 0
        # Seconds a time budget keeps for the end of the run (final checkpoint, model, evaluation), measured.
        self.final_reserve_s = 0.0
        self.save_seconds = 0.0  # the longest checkpoint write of this session
        self.previous_finish: dict[str, Any] | None = None  # how an earlier session of this run ended
        self._out_lock: Any = None  # rank 0's flock on `out` (files.lock_directory), held while set up or running
        self._made_out = False  # whether this run created `out` (`_open_out_dir`)
        # (step, path) of the newest checkpoint this trainer resumed from or wrote (path None: no `out`): a later
        # `run()` does not write that step again (an existing checkpoint is never overwritten)
        self.saved: tuple[int, Path | None] = (-1, None)
        self._logs_open = False
        # the teacher the run distils from, as each checkpoint records it (a resume refuses one changed since)
        self.teacher_start: dict[str, str] | None = None
        try:
            with ddist.one_line_if_peer_lost(self.env):  # (another rank's failure: one line here, its own error there)
                if cfg.teacher is not None:  # (alpha = 0 too) a wrong path, before `out` holds run.json and the logs
                    find_teacher_dir(cfg.teacher)
                    if cfg.distill_alpha > 0 or cfg.distill_cache_only:  # (alpha = 0 never reads it)
                        self.teacher_start = teacher_record(cfg.teacher)
                self._setup(corpus, model, data, tokenizer_dir, depth, evaluate)
                if cfg.teacher is not None and (cfg.distill_alpha > 0 or cfg.distill_cache_only):
                    if objective is not None:
                        raise ValueError("TrainConfig.teacher distils with the language-modeling loss: it cannot be "
                                         "combined with another objective")
                    self.objective = self._distillation()
        except BaseException:
            self._discard_new_out()
            self._unlock_out()
            raise

    def _discard_new_out(self) -> None:
        """A run refused while it sets up (a bad --data, ...) leaves no `out` behind that it created and that holds
        nothing but its lock file (removed while the lock is held: no other run can be holding it)."""
        env = getattr(self, "env", None)
        if not self._made_out or self.out is None or (env is not None and not env.is_main):
            return
        with contextlib.suppress(OSError):
            if {p.name for p in self.out.iterdir()} <= {DIR_LOCK_FILE}:
                (self.out / DIR_LOCK_FILE).unlink(missing_ok=True)
                self.out.rmdir()

    # ------------------------------------------------------------------ setup
    def log(self, message: str) -> None:
        if self.env.is_main:
            self._log(message)

    def _setup(self, corpus: Any | None, model: nn.Module | None, data: BatchSource | None,
               tokenizer_dir: str | Path | None, depth: Any | None, evaluate: Any | None) -> None:
        cfg, env = self.cfg, self.env
        self.resume_from = None
        for flag, directory in (("--out", self.out), ("--data-dir", cfg.data_dir)):  # before a tokenizer is trained
            if directory is not None:
                check_out_dir(directory, flag)
        if data is None:  # (a wrong --data, or an --out inside it, named before `out` is made or a tokenizer trained)
            corpus = corpus if corpus is not None else load_corpus(
                cfg.data, text_field=cfg.text_field, follow_symlinks=cfg.follow_symlinks)
            self._check_outside_corpus(corpus)
        if self.out is not None:
            self._open_out_dir(adapter_settings(model), model)
        elif data is None:
            raise ValueError("TrainConfig.out=None writes nothing, so it needs Trainer(data=...): the token shards "
                             "and tokenizer of cfg.data are prepared in the out directory")

        self.data = self.train_data = self.val_data = None
        self.seq_len: int | None = None
        if model is None and cfg.init_from is not None:
            start = load_for_training(cfg, env.device)
            model, self.save_dtype = start.model, self.save_dtype or start.dtype
            tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else start.tokenizer_dir
        if data is None:
            self._setup_shards(corpus, model)
        else:
            self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
            self.source = data
        if model is None:
            self._warn_about_slow_bf16()
            torch.manual_seed(cfg.seed)  # the weight init
            self.model = RecurrentDepthLM(self.model_config).to(env.device)
        else:
            # What a given model draws from torch's generator in training (a LoRA adapter's dropout) comes from the
            # run's seed, as the weight init above does, not from whatever ran in this process before.
            torch.manual_seed(cfg.seed)
            self.model = model.to(env.device)
            self.model_config = getattr(model, "config", None)
        self.sampler = depth if depth is not None else self._default_sampler()
        base = base_model_of(self.model)
        if isinstance(self.sampler, DepthSampler) and isinstance(base, RecurrentDepthLM):
            # the model's depth ceiling covers every depth drawn: max_depth, or none (the draws' tail is uncapped)
            base.max_depth = max(base.max_depth, self.sampler.max_steps or sys.maxsize)
        self.eval_depths = (cfg.resolved_eval_depths(self.sampler.mean_recurrence)
                            if isinstance(self.sampler, DepthSampler) else None)
        if evaluate is None and self.val_data is not None and isinstance(base_model_of(self.model), RecurrentDepthLM):
            evaluate = validation_by_depth
        self.evaluate_hook = evaluate

        # The tuning of `recurrent_depth.accel`, from outside the model (`accel: false` or RDEPTH_NO_ACCEL=1: none).
        self.accel = accel.apply(self.model, enabled=cfg.accel and accel.enabled_by_default())
        self.wrapped = prepare_model(self.model, cfg, env)
        self.optimizer = build_optimizers(self.model, cfg.optim)
        with warnings.catch_warnings():
            if not env.is_main:  # (each rank builds the same clip, and would repeat its warning: rank 0 says it)
                warnings.simplefilter("ignore")
            self.qk_clip = QKClip(self.model, cfg.qk_clip) if cfg.qk_clip is not None or cfg.record_max_logit else None
        # Known up front for packed rows (the schedule of a token budget needs it); measured per step otherwise.
        self.tokens_per_step: int | None = (
            cfg.batch_size * self.seq_len * cfg.grad_accum * env.world_size if self.seq_len is not None else None)

        if self.resume_from is not None:
            # (an older checkpoint when this one does not load into the model; None: none is left)
            self.resume_from = trainer_checkpoints.resume(self)
        if self.resume_from is not None:
            self.saved = (self.state.step, self.resume_from)
        else:
            self._start_from_scratch()
        self._open_logs()
        if env.is_main and self.out is not None:
            write_run_file(self.out, self.run_metadata())

    def _start_from_scratch(self) -> None:
        """A run starting at step 0 (no --resume, or no checkpoint left to resume from) whose `out` holds an earlier
        session's record (a run that failed before its first checkpoint, or whose every checkpoint was invalid) would
        empty its logs and replace its run.json and model/: rank 0 sets that record aside (`set_aside_run_record`),
        said in one line, with the resume's "starting from scratch"."""
        if self.out is None or not self.env.is_main:
            return
        # (a directory the run reads inside what moves: its checkpoints and model/ lacked the tokenizer, and its
        # record named as its start or teacher the model/ it then replaced, so that no resume was possible)
        reads = {"--init-from": (self.start or {}).get("directory"), "the tokenizer": self.tokenizer_dir,
                 "--teacher": (self.teacher_start or {}).get("directory")}
        for flag, directory in reads.items():
            if directory is not None and (entry := record_entry_holding(self.out, EARLIER_RUN_NAMES, directory)):
                raise ValueError(f"{flag} {directory} lies in {entry}, of the earlier session's record, which a run "
                                 f"starting from scratch moves to {self.out / 'previous-<k>'}: move it out of "
                                 f"{self.out} and name its new place, or choose a new --out")
        try:
            moved = set_aside_run_record(self.out, EARLIER_RUN_NAMES)
        except OSError as exc:  # (nothing moved: what was, was moved back)
            raise ValueError(f"cannot set aside the earlier run record in {self.out} ({exc.strerror or exc}) before "
                             f"starting from scratch: move {', '.join(EARLIER_RUN_NAMES)} out of it, or choose a new "
                             "--out") from None
        where = ""
        if moved is not None:
            target, names = moved
            listed = ", ".join(name + "/" * (target / name).is_dir() for name in names)
            where = f"moved the earlier session's {listed} to {target} (kept, not overwritten)"
        if self.cfg.resume:
            root = ckpt.checkpoints_root(self.out)
            self.log(f"no valid checkpoint in {root}: starting from scratch" + (f"; {where}" if where else ""))
        elif where:
            self.log(f"{self.out} holds the record of an earlier run and no checkpoint: starting from scratch; {where}")

    def _open_logs(self) -> None:
        """metrics.jsonl and eval.jsonl, their lines after this step dropped (a resumed run redoes those steps), and
        tensorboard, those steps hidden; on rank 0 of a run with `out`. Again at a later `run()` of this trainer,
        which continues the run after `close_logs` (its steps were not written before)."""
        writes, step = self.env.is_main and self.out is not None, self.state.step
        self.metrics = JsonlLog(self.out / METRICS_FILE if writes else None, keep_through=step)
        self.eval_log = JsonlLog(self.out / EVAL_FILE if writes else None, keep_through=step)
        self.tb = open_tensorboard(self.out, enabled=self.cfg.tensorboard and writes, purge_step=step + 1)
        self._logs_open = True

    def _check_outside_corpus(self, corpus: Any) -> None:
        """Refuse an --out or --data-dir where the directory corpus reads every file: the run's tokenizer, logs,
        checkpoints and shards would become documents (of this run's packing pass and of every later session)."""
        from recurrent_depth.data.prepare import SHARD_FILE_NAMES, corpus_would_read

        if not isinstance(corpus, Corpus):  # (a caller's own document source: nothing to compare)
            return
        for flag, directory, names in (("--out", self.out, OUT_FILE_NAMES), ("--data-dir", self.cfg.data_dir,
                                                                             SHARD_FILE_NAMES)):
            if directory is not None and corpus_would_read(corpus, directory, names):
                raise ValueError(
                    f"{flag} {directory} lies inside --data {corpus.name}, a directory whose every file is read: the "
                    f"run's files would become training documents; choose a {flag} outside it (or a hidden "
                    "directory in it, such as .runs/)")

    def _open_out_dir(self, adapter: dict[str, Any] | None, model: nn.Module | None) -> None:
        """Create `out` and lock it (rank 0: another process training into it is refused); find the checkpoint
        to resume from (refusing to mix a new run into an old one, or to resume with another config, LoRA
        `adapter` (`lora.adapter_settings`), given `model` or starting model directory)."""
        cfg = self.cfg
        self._made_out = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # (mkdir's own message names neither the option nor what to do)
            raise ValueError(f"--out {self.out} cannot be created ({exc.strerror or exc}): choose a writable "
                             "directory") from None
        self._lock_out()
        check_out_state(self.out, cfg.resume)  # (again, now that the lock is held)
        root = ckpt.checkpoints_root(self.out)
        self.resume_from = trainer_checkpoints.find_resume_checkpoint(root, self.env, self.log) if cfg.resume else None
        if self.resume_from is not None:  # before any data work, which could overwrite the run's caches
            if model is not None:  # (first: another config is named field by field, not as another directory)
                trainer_checkpoints.check_same_model(model, self.resume_from)
            trainer_checkpoints.check_resumable(self.resume_from, cfg, self.env.world_size, adapter, self.start,
                                                self.teacher_start)
            self.previous_finish = _finish_record(self.out)

    def _lock_out(self) -> None:
        """Take the flock of `out` (rank 0 writes it; the other ranks do not): one run at a time."""
        if self.out is not None and self.env.is_main and self._out_lock is None:
            self._out_lock = lock_directory(self.out, "--out")

    def _unlock_out(self) -> None:
        lock, self._out_lock = self._out_lock, None
        if lock is not None:
            lock.close()

    def _setup_shards(self, corpus: Any | None, model: nn.Module | None) -> None:
        """The tokenizer and token shards `cfg.data` names; the model config their vocabulary implies."""
        cfg = self.cfg
        if model is not None:  # its own config (--init-from DIR's), not one built from the tokenizer: DIR's vocabulary
            # may be padded past the tokenizer's, with special ids there, which that config refused
            self.tokenizer_dir, self.data = self._prepare_data(corpus)
            self.model_config = getattr(model, "config", None)
            self.seq_len = cfg.seq_len if cfg.seq_len is not None else self.data.metadata["params"]["seq_len"]
            self._open_shard_datasets()
            return
        overrides = {"mean_recurrence": 1, "mean_backprop_depth": 1} if cfg.baseline else cfg.trained_depth_fields()
        base = cfg.replace(model={**overrides, **cfg.model}) if overrides else cfg
        self._check_vocab_size(base)
        self.tokenizer_dir, self.data = self._prepare_data(corpus)
        tok_meta = self.data.metadata["tokenizer"]
        specials = tok_meta["special_token_ids"]
        self.model_config: ModelConfig = base.model_config(
            tok_meta["vocab_size"],
            bos_token_id=specials["begin_text"], eos_token_id=eos_token_ids(specials), pad_token_id=specials["pad"],
        )
        self.seq_len = cfg.resolved_seq_len(self.model_config)
        if self.seq_len != self.data.metadata["params"]["seq_len"]:
            raise AssertionError("prepared rows do not match seq_len")
        self._open_shard_datasets()

    def _check_vocab_size(self, base: TrainConfig) -> None:
        """Refuse a vocabulary setting that the run's tokenizer contradicts before that tokenizer is trained or the
        shards are packed: a model trained from scratch has exactly the tokenizer's vocabulary (that of --tokenizer
        DIR, or the --vocab-size of one trained here); `base` is the config its ModelConfig is built from."""
        cfg = self.cfg
        if cfg.tokenizer is None:
            size = cfg.tokenizer_vocab_size()
        elif (Path(cfg.tokenizer) / "tokenizer.json").is_file():  # (else `_prepare_data` names what is missing)
            from recurrent_depth.data.tokenizer import load_tokenizer, vocab_span

            size = vocab_span(load_tokenizer(cfg.tokenizer))  # (as the shards record it: its largest id + 1)
            if cfg.vocab_size is not None and cfg.vocab_size != size:  # (it was silently ignored)
                raise ValueError(
                    f"TrainConfig.vocab_size={cfg.vocab_size} (--vocab-size) sizes a tokenizer trained here, but "
                    f"--tokenizer {cfg.tokenizer} is given, whose ids need a vocabulary of {size} (its largest id + "
                    f"1), the model's: drop --vocab-size (or give {size})")
        else:
            return
        base.model_config(size)  # (a model.vocab_size override that disagrees, refused as it is once the shards exist)

    def _open_shard_datasets(self) -> None:
        """The prepared shards' train and validation splits, and the batches drawn from the train one."""
        cfg, env = self.cfg, self.env
        # (the model's vocabulary: an id outside it is refused as its row is read, naming the shard file and row)
        vocab = getattr(self.model_config, "vocab_size", None)
        self.train_data = self.data.dataset("train", seed=cfg.seed, rank=env.rank, world_size=env.world_size,
                                            vocab_size=vocab)
        self.val_data = self.data.dataset("validation", shuffle=False, rank=env.rank, world_size=env.world_size)
        self.source = RowBatches(self.train_data, env.device, self.data.metadata)

    def _distillation(self) -> Distillation:
        """The distillation objective `cfg.teacher` names (train/distill.py), its cache written first if asked."""
        cfg, env = self.cfg, self.env
        teacher = load_teacher(cfg.teacher, cfg.teacher_depth, env.device)
        student_vocab = int(base_model_of(self.model).config.vocab_size)
        check_vocabularies(teacher, student_vocab, self.tokenizer_dir)
        seq_len = self.seq_len if self.seq_len is not None else cfg.seq_len
        teacher_max = int(teacher.model.config.max_seq_len)
        if seq_len is not None and seq_len > teacher_max:  # else the first step fails without naming the teacher
            raise ValueError(f"teacher {teacher.directory} has max_seq_len {teacher_max}, shorter than this run's rows "
                             f"of {seq_len} tokens: lower seq_len or use a teacher with a longer context")
        self.log(f"distillation: teacher {teacher.directory} at depth {teacher.depth}, alpha {cfg.distill_alpha:g}, "
                 f"T {cfg.distill_temperature:g}, top-k {cfg.distill_top_k or 'full vocabulary'}")

        def position() -> int:
            return self.state.micro_step * env.world_size + env.rank

        objective = Distillation(teacher, alpha=cfg.distill_alpha, temperature=cfg.distill_temperature,
                                 top_k=cfg.distill_top_k, seed=cfg.seed, position=position)
        if cfg.distill_cache is None:
            return objective
        if self.data is None:
            raise ValueError("TrainConfig.distill_cache needs the run's token shards (rdepth train), "
                             "not Trainer(data=...)")
        # Every rank caches (and reads) all rows of the train split, in storage order.
        dataset = self.data.dataset("train", shuffle=False, vocab_size=student_vocab)
        data_key = self.data.metadata.get("key")
        teacher_info = {**teacher_summary(teacher), "seed": objective.seed}
        if has_cache(cfg.distill_cache):  # a cache of other rows (another --seed too) is refused, whatever the teacher
            matching_manifest(cfg.distill_cache, dataset, top_k=cfg.distill_top_k, vocab_size=student_vocab,
                              data_key=data_key, seed=cfg.seed)
        # (a teacher retrained in place, or other noise for its initial states: not its cache)
        changed = teacher_change(cfg.distill_cache, teacher_info, cfg.batch_size)
        if changed is not None:
            self.log(changed)
        if changed is not None or not has_cache(cfg.distill_cache):  # (rank 0 writes it; the others wait, run_on_main)
            ddist.run_on_main(env, "write the distillation cache", lambda: write_cache(
                objective.teacher_logits, dataset, cfg.distill_cache, top_k=cfg.distill_top_k,
                vocab_size=student_vocab, data_key=data_key, teacher_info=teacher_info,
                batch_size=cfg.batch_size, log=self.log))
        objective.cache = CachedTeacher(cfg.distill_cache, dataset, top_k=cfg.distill_top_k,
                                        vocab_size=student_vocab, data_key=data_key)
        objective.teacher = None  # read from the cache from here on
        return objective

    def _default_sampler(self) -> DepthSampler | None:
        """`cfg`'s depth sampler for a `RecurrentDepthLM` (the model config's r̄ and k unless `cfg` sets them)."""
        cfg = self.cfg
        if not isinstance(base_model_of(self.model), RecurrentDepthLM):  # (a LoRA wrapper's base included)
            return None
        model_cfg = base_model_of(self.model).config
        mean = cfg.mean_recurrence if cfg.mean_recurrence is not None else model_cfg.mean_recurrence
        k = cfg.backprop_depth if cfg.backprop_depth is not None else model_cfg.mean_backprop_depth
        seq_len = self.seq_len if self.seq_len is not None else cfg.resolved_seq_len(model_cfg)
        return DepthSampler(
            mean_recurrence=max(1, mean), backprop_depth=max(1, k), sigma=cfg.depth_sigma, seed=cfg.seed,
            scheme=cfg.depth_scheme, max_steps=cfg.max_depth, per_rank=cfg.depth_per_rank,
            ramp_steps=cfg.curriculum_micro_steps(seq_len, self.env.world_size), ramp_start=cfg.depth_curriculum_start,
        )

    def _prepare_data(self, corpus: Any | None):
        """Tokenizer (trained here unless given) and token shards; rank 0 builds, the others reuse."""
        from recurrent_depth.data import build_tokenizer, prepare_dataset
        from recurrent_depth.data.prepare import load_prepared, packing_report

        cfg, env = self.cfg, self.env
        source = corpus if corpus is not None else load_corpus(
            cfg.data, text_field=cfg.text_field, follow_symlinks=cfg.follow_symlinks
        )
        if cfg.tokenizer is not None:
            tok_dir = Path(cfg.tokenizer)
            if not (tok_dir / "tokenizer.json").is_file():
                raise ValueError(f"TrainConfig.tokenizer={cfg.tokenizer!r} holds no tokenizer.json")
        else:
            tok_dir = self.out / TOKENIZER_DIR
            # A resumed run keeps the tokenizer its checkpoint was trained with (put back from the checkpoint's
            # copy if gone, refused if replaced); a fresh run reuses one left in `out` only if it was trained for
            # this run's data and settings.
            def train_tokenizer() -> None:
                if self.resume_from is not None:
                    trainer_checkpoints.keep_run_tokenizer(self.resume_from, tok_dir, self.log)
                    return
                if (tok_dir / "tokenizer.json").is_file() and self._tokenizer_matches(tok_dir, source):
                    return
                start = time.perf_counter()
                build_tokenizer(source, cfg.tokenizer_vocab_size(), val_fraction=cfg.val_fraction, seed=cfg.seed,
                                max_bytes=cfg.tokenizer_max_bytes, out_dir=tok_dir)
                self.log(f"trained a {cfg.tokenizer_vocab_size()}-token BPE tokenizer in "
                         f"{time.perf_counter() - start:.1f}s -> {tok_dir}")

            # Rank 0 trains it; the others wait as long as that takes (not the process group's 30 minutes).
            ddist.run_on_main(env, "train the tokenizer", train_tokenizer)
            if self.start is None:  # (resumed: the digests `keep_run_tokenizer` found equal to the checkpoint's)
                self.start = start_record(None, tok_dir)
        seq_len = cfg.seq_len
        if seq_len is None:
            seq_len = cfg.model_config().max_seq_len
        data_dir = Path(cfg.data_dir) if cfg.data_dir is not None else self.out / "data"

        def prepare() -> Any:
            start = time.perf_counter()
            data = prepare_dataset(
                source, tok_dir, seq_len, data_dir, val_fraction=cfg.val_fraction, seed=cfg.seed, keep_all=cfg.keep_all
            )
            summary, warnings = packing_report(data.metadata)
            when = "reused" if data.metadata.get("reused") else f"in {time.perf_counter() - start:.1f}s"
            self.log(f"{summary} ({when}) -> {data_dir}")
            for warning in warnings:
                self.log(warning)
            return data

        # Rank 0 packs the shards (a large corpus can take hours); the others wait for it, then reuse them without
        # hashing the corpus again (rank 0 would wait for that pass in the next collective); where they do not see
        # rank 0's files (no shared file system), they prepare their own.
        data = ddist.run_on_main(env, "prepare the token shards", prepare, share=True)
        if not env.is_main:
            # (rank 0's tokenizer metadata: the vocabulary as this code measures it, whatever the cache recorded)
            data = load_prepared(data_dir, data.metadata["key"], cfg.val_fraction,
                                 data.metadata["tokenizer"]) or prepare_dataset(
                source, tok_dir, seq_len, data_dir, val_fraction=cfg.val_fraction, seed=cfg.seed, keep_all=cfg.keep_all
            )
        return tok_dir, data

    def _tokenizer_matches(self, tok_dir: Path, source: Any) -> bool:
        """Whether `tok_dir` holds a tokenizer trained here on this corpus with this run's settings."""
        try:
            meta = json.loads((tok_dir / "tokenizer_training.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        cfg = self.cfg
        split = meta.get("split") or {}
        matches = (
            (meta.get("corpus") or {}).get("sha256") == source.info().sha256
            and meta.get("vocab_size") == cfg.tokenizer_vocab_size()
            and meta.get("max_bytes") == cfg.tokenizer_max_bytes
            and split.get("val_fraction") == cfg.val_fraction
            and split.get("seed") == cfg.seed
        )
        if not matches:
            self.log(f"{tok_dir} was trained for other data or settings: training a new tokenizer")
        return matches

    def _warn_about_slow_bf16(self) -> None:
        muon_ns_dtype = self.cfg.optim.muon_ns_dtype if self.cfg.optim.name == "muon" else None
        for warning in slow_bf16_warnings(self.env.device, self.cfg.dtype, muon_ns_dtype):
            self.log(warning)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """Train until a budget or hook stops the loop; save, evaluate, return the `TrainResult`.

        Under torchrun the trainer holds its DDP wrapper only while it runs: once `run()` returns or raises it
        holds `model` itself, so that `torch.distributed.destroy_process_group()` may follow at once (DDP's reducer,
        freed after it, can hang the process at exit). A later `run()` wraps the model again."""
        if self._ddp_released:
            self.wrapped = ddist.wrap_model(self.model, self.env)
            self._ddp_released = False
        try:
            with ddist.one_line_if_peer_lost(self.env):  # (another rank's failure: one line here, its own error there)
                self._lock_out()  # (a later run() takes it again)
                return self._run()
        finally:
            self._ddp_released = ddist.release_ddp(self) or self._ddp_released
            self._unlock_out()

    def adopt_group(self, joined: bool) -> None:
        """Leave the process group in `close()` when its caller joined it (`joined`: no group existed before the
        caller's `init_distributed`). A recipe that joins before building its Trainer, to learn its rank for its
        data source, hands the group over so: the Trainer saw a group already there, which it does not leave."""
        self._owns_group = self.env.enabled and joined

    def close(self) -> None:
        """Close the logs, free the DDP wrapper, then leave the process group if this Trainer joined it (torchrun's
        environment; a group initialised before the Trainer is left to its owner). Idempotent; also the end of
        `with Trainer(cfg) as trainer:`."""
        if hasattr(self, "metrics"):
            self.close_logs()
        self._unlock_out()
        self._ddp_released = ddist.release_ddp(self) or self._ddp_released
        if self._owns_group:
            self._owns_group = False
            ddist.shutdown(self.env)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> TrainResult:
        cfg = self.cfg
        sampler = self.sampler
        depth = (f"; depth {sampler.scheme} r̄={sampler.mean_recurrence} k={sampler.backprop_depth}"
                 if isinstance(sampler, DepthSampler) else "")
        total = num_parameters(self.model)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        what = f"{total:,} parameters" if trainable == total else f"{trainable:,} of {total:,} parameters"
        self.log(
            f"training {what} on {self.env.device} "
            f"({self.env.world_size} process{'es' if self.env.world_size > 1 else ''}){depth}"
            f"{' (baseline: one core pass)' if cfg.baseline else ''}; out: {self.out or 'none (nothing is written)'}"
        )
        if not self._logs_open:  # (a later run() of this trainer: the first one's end closed them)
            self._open_logs()
        finished = self._finished_before()
        if finished is not None:
            return finished
        bar = _progress_bar(cfg, self.env, self.state.step)
        self.session_start = time.perf_counter()
        self.session_start_elapsed = self.state.elapsed_s
        self.session_steps = 0
        self._measure_final_reserve()
        stop_reason = "max_steps"
        interrupt = _InterruptRequest()
        try:
            interrupt.install()
            while True:
                reason = self.stop_reason()
                if reason is not None:
                    stop_reason = reason
                    break
                record = self.train_step()
                self.metrics.write(record)
                tensorboard_step(self.tb, record)
                if bar is not None:
                    bar.update(1)
                    loss_text = "nan" if record["loss"] is None else f"{record['loss']:.3f}"  # None: not finite
                    # a distilled run's CE and KL beside the mixed loss (what --distill-alpha trades)
                    parts = {key.removeprefix("distill_"): "nan" if record[key] is None else f"{record[key]:.3f}"
                             for key in ("distill_ce", "distill_kl") if key in record}
                    bar.set_postfix(loss=loss_text, **parts, tok_s=f"{record['tokens_per_s']:.0f}",
                                    depth=record["num_steps"][-1] if record["num_steps"] else None)
                step = self.state.step
                if cfg.eval_interval and step % cfg.eval_interval == 0 and not self._budget_spent():
                    self.evaluate(final=False)  # (at the last step the final evaluation follows: not twice)
                if cfg.save_every and step % cfg.save_every == 0:
                    self._timed_save()
                if self.on_step is not None:
                    self.on_step(self, record)
                signum = interrupt.agreed(self.env)
                if signum:
                    if self.saved[0] != step:
                        self.save_checkpoint()
                    last_checkpoint = self.saved[1]
                    self.close_logs()
                    saved = (f"checkpoint {last_checkpoint} is saved: continue with --resume"
                             if last_checkpoint is not None else "nothing is saved (out is None)")
                    cause = "" if signum == signal.SIGINT else f"{signal.Signals(signum).name} (preempted): "
                    raise TrainingInterrupted(f"{cause}stopped after step {step}; {saved}", signum)
        finally:
            interrupt.uninstall()
            if bar is not None:
                bar.close()
        # Save before the final evaluation: an evaluation that crashes must not cost the run.
        ending = time.perf_counter()
        if self.saved[0] != self.state.step and self.state.step > 0:
            self.save_checkpoint()
        model_dir = self.save_model(self.out / MODEL_DIR) if self.out is not None else None
        saved = time.perf_counter()
        budget_end = self.budget_end()
        if budget_end is not None:  # the final evaluation ends inside a time budget too (after one batch at least)
            self.eval_deadline = budget_end if self.eval_deadline is None else min(self.eval_deadline, budget_end)
        final_eval = self.evaluate(final=True)
        done = time.perf_counter()
        self.log(f"stopped after {self.state.step} steps ({stop_reason}), {self.state.tokens:,} tokens, "
                 f"{self.state.elapsed_s:.0f}s; skipped {self.state.skipped_steps} non-finite steps")
        if self.cfg.max_minutes is not None:
            session = done - self.session_start
            self.log(f"time budget max_minutes={self.cfg.max_minutes:g} ({self.cfg.max_minutes * 60:.0f} s, this "
                     f"session {self.cfg.max_minutes * 60 - self.session_start_elapsed:.0f} s): training "
                     f"{ending - self.session_start:.1f} s, saving {saved - ending:.1f} s, final evaluation "
                     f"{done - saved:.1f} s; {session:.1f} s in all (tokenizer training and data packing before "
                     "it are not counted)")
        self._record_finish(stop_reason)
        self.close_logs()
        result = TrainResult(
            out=self.out, model=self.model, model_dir=model_dir, steps=self.state.step, tokens=self.state.tokens,
            skipped_steps=self.state.skipped_steps, elapsed_s=self.state.elapsed_s, stop_reason=stop_reason,
            final_eval=final_eval, last_checkpoint=self.saved[1], tokenizer_dir=self.tokenizer_dir,
            losses=list(self.losses),
        )
        self._check_skipped_share(result)
        return result

    def close_logs(self) -> None:
        self._logs_open = False
        self.metrics.close()
        self.eval_log.close()
        if self.tb is not None:
            self.tb.close()

    def _check_skipped_share(self, result: TrainResult) -> None:
        """A run that mostly skipped its steps did not train: fail it (after everything was written)."""
        steps, skipped, limit = self.state.step, self.state.skipped_steps, self.cfg.max_skipped_fraction
        if steps and skipped > limit * steps:
            raise TooManySkippedSteps(
                f"{skipped} of {steps} optimizer steps ({skipped / steps:.0%}) were skipped for a non-finite "
                f"gradient, more than max_skipped_fraction {limit:g} (--max-skipped-fraction); "
                f"the run's files are in {self.out}", result)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its metrics record."""
        cfg, env, state = self.cfg, self.env, self.state
        start = time.perf_counter()
        lr = self.lr_for_step(state.step)
        set_lr(self.optimizer, lr)
        self.wrapped.train()
        loss_sum = torch.zeros((), dtype=torch.float64)
        # an objective may report its loss's parts (distillation: `distill_ce`, `distill_kl`), logged beside it
        loss_terms = getattr(self.objective, "loss_terms", None)
        term_sums: dict[str, float] = {}
        indexer_kl_sum, indexer_kl_count = 0.0, 0
        depths: list[int] = []
        grad_depths: list[int] = []
        observed: dict[str, Any] = {}
        step_tokens = 0
        # The step's micro-batches first: their scored tokens weight each one's loss (see `token_weights`).
        batches = [batch_to(self.source.next_batch(cfg.batch_size), env.device)  # (a source may serve CPU tensors)
                   for _ in range(cfg.grad_accum)]
        weights = self.token_weights(batches)
        for micro, (batch, weight) in enumerate(zip(batches, weights, strict=True)):
            num_steps, generator = None, None
            if cfg.baseline:
                num_steps = (0, 1)
            elif self.sampler is not None:
                num_steps = self.sampler.sample(state.micro_step, env.rank)
            if num_steps is not None:
                generator = torch.Generator(device=env.device).manual_seed(
                    stream_seed(cfg.seed + 1, state.micro_step * env.world_size + env.rank)
                )
            with ddist.gradient_sync(self.wrapped, micro == cfg.grad_accum - 1):
                with autocast_context(cfg.dtype, env.device):
                    loss, out = self.objective.loss(self.wrapped, batch, num_steps, generator)
                # (a micro-batch that scores nothing has the mean 0/0 = NaN: it adds nothing, not NaN)
                loss = loss * weight if weight else loss.nan_to_num(0.0) * 0.0
                # DSA layers with `indexer_loss` record their indexer KL in the forward; it reads detached
                # inputs, so adding it trains only the indexer. Popping it every micro-step also keeps
                # the recorded terms (and their graphs) from piling up across steps.
                indexer_kl = pop_indexer_loss(self.model)
                total = loss if indexer_kl is None else loss + indexer_kl
                (total / cfg.grad_accum).backward()
            loss_sum += loss.detach().double().cpu()
            if loss_terms is not None:  # weighted as the loss is: their mix is the logged loss
                for key, value in loss_terms().items():
                    term_sums[key] = term_sums.get(key, 0.0) + (value * weight if weight else 0.0)
            if indexer_kl is not None:
                indexer_kl_sum += float(indexer_kl.detach())
                indexer_kl_count += 1
            with torch.no_grad():
                counted = {k: observed[k] for k in self.source.summed_metrics if k in observed}
                observed = self.source.observe(batch, out)
                observed.update({k: v + observed.get(k, 0) for k, v in counted.items()})
            step_tokens += batch["input_ids"].numel()
            if num_steps is not None:
                depths.append(sum(num_steps))
                grad_depths.append(num_steps[1])
            state.micro_step += 1
        grad_norm, finite = clip_and_check_grads(self.model.parameters(), cfg.optim.grad_clip)
        skip_reason = None
        if not finite:
            skip_reason = "non_finite"
            state.skipped_steps += 1
            self.log(f"step {state.step + 1}: non-finite gradient norm ({grad_norm}); step skipped "
                     f"({state.skipped_steps} so far)")
        elif cfg.optim.skip_first_step and state.step == 0:
            # As the official trainer: the first step measures the loss and gradient, changes nothing.
            skip_reason = "first_step"
        else:
            self.optimizer.step()
        # QK-clip after the update, on the maxima this step's training forwards recorded.
        clip_record = self.qk_clip.step(apply=skip_reason is None) if self.qk_clip is not None else {}
        self.optimizer.zero_grad(set_to_none=True)
        # (the weighted micro-batch losses: the token mean over every rank's scored tokens of the step)
        loss_value = ddist.mean_across_ranks(float(loss_sum) / cfg.grad_accum, env)
        terms = {key: ddist.mean_across_ranks(total / cfg.grad_accum, env) for key, total in term_sums.items()}
        # the source's counts and means over every rank's batches (rank 0 writes the record)
        observed = ddist.reduce_metrics(observed, self.source.summed_metrics, self.source.rank_mean_metrics, env)
        state.step += 1
        self.tokens_per_step = step_tokens * env.world_size
        state.tokens += self.tokens_per_step
        seconds = time.perf_counter() - start
        self.session_steps += 1
        state.elapsed_s = self.session_start_elapsed + (time.perf_counter() - self.session_start)
        self.losses.append(loss_value)
        extra = {"indexer_kl": indexer_kl_sum / indexer_kl_count} if indexer_kl_count else {}
        if cfg.depth_per_rank and env.enabled:  # (each rank drew its own depths; `num_steps` holds rank 0's)
            ranks = ddist.every_rank((depths, grad_depths), env)
            extra.update(num_steps_by_rank=[d for d, _ in ranks], grad_steps_by_rank=[g for _, g in ranks])
        return {
            "step": state.step,
            "loss": loss_value if math.isfinite(loss_value) else None,
            "num_steps": depths,
            "grad_steps": grad_depths,
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / seconds,
            "tokens": state.tokens,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "skipped": skip_reason is not None,
            "skip_reason": skip_reason,
            "skipped_total": state.skipped_steps,
            "step_s": seconds,
            "elapsed_s": state.elapsed_s,
            **{key: value if math.isfinite(value) else None for key, value in terms.items()},
            **extra,
            **clip_record,
            **observed,
        }

    def token_weights(self, batches: list[dict[str, Any]]) -> list[float]:
        """Each micro-batch's weight: its scored tokens over the mean micro-batch's of this step (all ranks).

        An objective's loss is a mean over its micro-batch's scored tokens (`Objective.scored_tokens`); the step
        averages the `grad_accum` micro-batches and DDP/FSDP the ranks. Weighted so, that average is one process's
        mean over every scored token of the global batch (transformers' `average_tokens_across_devices` with
        `num_items_in_batch`), not a mean of means in which a micro-batch or rank with fewer answer tokens counts
        more per token. Equal counts (pretraining) give weights of exactly 1.0: the arithmetic is unchanged. One
        int64 all-reduce per step; all 1.0 for an objective without `scored_tokens`, or a step that scores nothing.
        """
        count = getattr(self.objective, "scored_tokens", None)
        counts = [count(batch) for batch in batches] if count is not None else []
        if not counts or any(c is None for c in counts):
            return [1.0] * len(batches)
        total = ddist.sum_across_ranks(sum(counts), self.env)
        if total == 0:
            return [1.0] * len(batches)
        mean = total / (len(batches) * self.env.world_size)
        return [c / mean for c in counts]

    # ------------------------------------------------------------------ budget and schedule
    def remaining_seconds(self) -> float | None:
        """Training time left under `max_minutes` and the `deadline` (None: no time limit)."""
        left = []
        if self.cfg.max_minutes is not None:
            left.append(self.cfg.max_minutes * 60.0 - self.state.elapsed_s - self.final_reserve_s)
        if self.deadline is not None:
            left.append(self.deadline - time.perf_counter())
        return min(left) if left else None

    def budget_end(self) -> float | None:
        """The `time.perf_counter()` value at which `max_minutes` runs out (None: no time budget)."""
        if self.cfg.max_minutes is None:
            return None
        return self.session_start + self.cfg.max_minutes * 60.0 - self.session_start_elapsed

    def _measure_final_reserve(self) -> None:
        """Under a time budget, time one batch of the final evaluation now (it is part of the budget), so that
        training stops early enough for the checkpoint, the model and that evaluation to end inside it."""
        if self.cfg.max_minutes is None or self.evaluate_hook is not validation_by_depth:
            return
        start = time.perf_counter()
        sharded = ddist.is_fsdp(self.wrapped)
        validation_loss_by_depth(
            self.wrapped if sharded else self.model, self.val_data, self.eval_depths, batch_size=self.cfg.batch_size,
            max_batches=1, dtype=self.cfg.dtype, seed=self.cfg.seed, device=self.env.device, sharded=sharded,
            world_size=self.env.world_size)
        self.final_reserve_s = time.perf_counter() - start

    def _timed_save(self) -> Path | None:
        start = time.perf_counter()
        path = self.save_checkpoint()
        seconds = time.perf_counter() - start
        if seconds > self.save_seconds:  # the end of the run writes a checkpoint and the model: twice this
            self.final_reserve_s += 2 * (seconds - self.save_seconds)
            self.save_seconds = seconds
        return path

    def _record_finish(self, stop_reason: str) -> None:
        """Note in run.json how the run ended, so that a --resume of a finished run knows it is finished."""
        if self.out is None or not self.env.is_main:
            return
        cfg = self.cfg
        write_run_file(self.out, {**self.run_metadata(), "finished": {
            "step": self.state.step, "stop_reason": stop_reason, "max_steps": cfg.max_steps,
            "max_tokens": cfg.max_tokens, "max_minutes": cfg.max_minutes}})

    def _finished_before(self) -> TrainResult | None:
        """A resumed run that had already ended under budgets this one does not raise: said, and nothing is redone
        (no training step, no evaluation); None otherwise."""
        done, cfg = self.previous_finish, self.cfg
        if self.resume_from is None or not done or done.get("step") != self.state.step:
            return None
        reason = done.get("stop_reason")
        still = {"max_steps": cfg.max_steps is not None and self.state.step >= cfg.max_steps,
                 "max_tokens": cfg.max_tokens is not None and self.state.tokens >= cfg.max_tokens,
                 "time_limit": cfg.max_minutes is not None and isinstance(done.get("max_minutes"), int | float)
                 and cfg.max_minutes <= done["max_minutes"]}
        if not still.get(reason, False) and self.stop_reason() is None:
            return None
        self.log(f"the run in {self.out} already finished at step {self.state.step} ({reason}): nothing to do; "
                 f"raise {self.budget_flags} to train it further")
        self._record_finish(reason)
        self.close_logs()
        final = next((r for r in reversed(self.eval_log.kept) if r.get("final") and r.get("step") == self.state.step),
                     None)
        final_eval = None
        if final is not None and isinstance(final.get("val_loss_by_depth"), dict):
            final_eval = DepthEval(loss={int(d): v for d, v in final["val_loss_by_depth"].items()},
                                   token_correlation={int(d): v for d, v in
                                                      (final.get("token_correlation_by_depth") or {}).items()},
                                   tokens=int(final.get("val_tokens") or 0))
        model_dir = self.out / MODEL_DIR
        return TrainResult(
            out=self.out, model=self.model, model_dir=model_dir if model_dir.is_dir() else None,
            steps=self.state.step, tokens=self.state.tokens, skipped_steps=self.state.skipped_steps,
            elapsed_s=self.state.elapsed_s, stop_reason="already_finished", final_eval=final_eval,
            last_checkpoint=self.resume_from, tokenizer_dir=self.tokenizer_dir, losses=[])

    def seconds_per_step(self) -> float | None:
        if self.session_steps == 0:
            return None
        return (self.state.elapsed_s - self.session_start_elapsed) / self.session_steps

    def planned_steps(self) -> int | None:
        """The run's length in optimizer steps, as best known now (None: unknown yet).

        Step and token budgets give it exactly (so the schedule, and a resumed run, are reproducible);
        a time budget is projected from the steps so far, so the cool-down lands at the end of the time.
        """
        cfg = self.cfg
        candidates = []
        if cfg.max_steps is not None:
            candidates.append(cfg.max_steps)
        if cfg.max_tokens is not None and self.tokens_per_step:
            candidates.append(math.ceil(cfg.max_tokens / self.tokens_per_step))
        left, per_step = self.remaining_seconds(), self.seconds_per_step()
        if left is not None and per_step:
            candidates.append(self.state.step + max(0, int(left / per_step)))
        if not candidates:
            return None
        return max(min(candidates), self.state.step + 1)

    def lr_for_step(self, step: int) -> float:
        optim = self.cfg.optim
        total = self.planned_steps()
        if self.env.enabled and self.remaining_seconds() is not None:
            # A time budget projects the length from this rank's own clock: rank 0's, so all ranks step alike.
            total = ddist.broadcast_object(total, self.env)
        if total is None:
            # Length not known yet (a time cap before the first timed step): warmup, no cool-down yet.
            return lr_at(step, optim.lr, optim.warmup_steps, None)
        return optim.lr_at(step, max(total, step + 1))

    def _budget_spent(self) -> str | None:
        """"max_steps" / "max_tokens" once that budget is used up (None before): the loop's last step."""
        cfg, state = self.cfg, self.state
        if cfg.max_steps is not None and state.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_tokens is not None and state.tokens >= cfg.max_tokens:
            return "max_tokens"
        return None

    def stop_reason(self) -> str | None:
        spent = self._budget_spent()
        if spent is not None:
            return spent
        left = self.remaining_seconds()
        if left is not None:
            # Stop when the next step would overrun: a time cap is a promise about wall time.
            over = (self.seconds_per_step() or 0.0) > left
            over = bool(ddist.broadcast_object(over, self.env)) if self.env.enabled else over
            if over:
                return "time_limit"
        if self.stop_when is None:
            return None
        reason = self.stop_when(self)
        # Rank 0's answer on every rank (a hook reading this rank's clock may differ): ranks stop after the same step.
        return ddist.broadcast_object(reason, self.env) if self.env.enabled else reason

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, final: bool = False) -> Any:
        """Run the evaluation hook (None without one) and log its result to `eval.jsonl`."""
        if self.evaluate_hook is None:
            return None
        result = self.evaluate_hook(self, final)
        if result is not None:
            values = result.to_dict() if hasattr(result, "to_dict") else dict(result)
            # A resume that trains no further (the run had already ended) re-evaluates, but logs no second copy.
            repeat = final and self.session_steps == 0 and any(
                kept.get("step") == self.state.step and kept.get("final") for kept in self.eval_log.kept)
            if not repeat:
                self.eval_log.write({"step": self.state.step, "final": final, **values})
        return result

    # ------------------------------------------------------------------ checkpoints and run record
    def save_checkpoint(self) -> Path | None:
        """Write checkpoint `step-<step>` (collective); None without `out`. See `trainer_checkpoints`."""
        path = trainer_checkpoints.save_checkpoint(self)
        self.saved = (self.state.step, path)  # (without `out` too: the step needs no other save)
        return path

    def save_model(self, path: Path) -> Path | None:
        """The final weights + tokenizer as the model directory `path` (collective; rank 0 writes)."""
        return trainer_checkpoints.save_model(self, path)

    def run_metadata(self) -> dict[str, Any]:
        """What `run.json` records (see `run_record`)."""
        return run_metadata(self)


def check_out_state(out: str | Path, resume: bool) -> None:
    """The refusals of a run's `out` that its files alone decide, reading only: an existing file, the model/ of an
    earlier run (no checkpoint), checkpoints without `resume`. The Trainer checks them once it holds the lock; a
    command that loads a model or tokenizes data before it builds the Trainer checks them first.

    A model/ beside checkpoints none of which is complete (set aside as invalid, or incomplete) is taken by --resume:
    it finds no valid checkpoint and starts from scratch, moving model/ with the rest of the record to previous-<k>
    (`Trainer._start_from_scratch`). A --resume stopped between setting its checkpoints aside and that move leaves
    this state; refused, it left the user nothing to do but delete model/ by hand."""
    out = Path(out)
    check_out_dir(out, "--out")
    root = ckpt.checkpoints_root(out)
    held = bool(ckpt.list_checkpoints(root))
    if not held and (out / MODEL_DIR).exists():  # a new run would replace model/
        if not ckpt.holds_any_checkpoint(root):
            raise ValueError(f"{out} holds the model/ of an earlier run and no checkpoint to resume from; choose a "
                             f"new --out, or delete {out / MODEL_DIR} to train there from scratch")
        if not resume:
            raise ValueError(f"{out} holds the model/ of an earlier run and only invalid checkpoints in {root}; pass "
                             f"--resume to start from scratch there (that run's record, model/ included, moves to "
                             f"{out / 'previous-<k>'}), or choose a new --out")
    if held and not resume:
        raise ValueError(f"{out} already holds checkpoints; pass --resume to continue that run or choose a new --out")


def validation_by_depth(trainer: Trainer, final: bool) -> DepthEval:
    """The default evaluation hook: validation loss at `trainer.eval_depths` (same tokens and s0 at each)."""
    cfg, wrapped = trainer.cfg, trainer.wrapped
    result = validation_loss_by_depth(
        wrapped if ddist.is_fsdp(wrapped) else trainer.model, trainer.val_data, trainer.eval_depths,
        batch_size=cfg.batch_size, max_batches=cfg.eval_batches, dtype=cfg.dtype, seed=cfg.seed,
        device=trainer.env.device, sharded=ddist.is_fsdp(wrapped), world_size=trainer.env.world_size,
        deadline=trainer.eval_deadline if final else None,
    )
    if trainer.tb is not None:
        for d, v in result.loss.items():
            trainer.tb.add_scalar(f"val_loss/depth_{d}", v, trainer.state.step)
        for d, v in result.token_correlation.items():
            trainer.tb.add_scalar(f"token_correlation/depth_{d}", v, trainer.state.step)
    table = "  ".join(f"{d}:{v:.3f}" for d, v in sorted(result.loss.items()))
    trainer.log(f"step {trainer.state.step} validation loss by depth  {table}")
    return result


def _finish_record(out: Path) -> dict[str, Any] | None:
    """The `finished` entry of an earlier session's run.json (None: none, or unreadable)."""
    from recurrent_depth.files import read_json

    try:
        record = read_json(out / RUN_FILE, 16 << 20, "run file").get("finished")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def prepare_model(model: nn.Module, cfg: TrainConfig, env: ddist.DistEnv) -> nn.Module:
    """Apply, from outside the model and in this order: activation checkpointing, compile, parallelism.

    A model other than a `RecurrentDepthLM` is compiled whole; activation checkpointing and FSDP, which
    need to know its blocks, are refused for it; a LoRA wrapper's base takes checkpointing and compile."""
    if is_peft_model(model) and isinstance(model.get_base_model(), RecurrentDepthLM):
        if cfg.fsdp:
            raise ValueError("fsdp does not shard a LoRA (peft) model here: turn fsdp off (DDP works) or train "
                             "every weight")
        model.get_base_model().gradient_checkpointing = cfg.activation_checkpointing
        if cfg.compile:
            compile_core(model.get_base_model(), cfg.compile_mode)
        return ddist.wrap_model(model, env)
    if not isinstance(model, RecurrentDepthLM):
        if cfg.activation_checkpointing or cfg.fsdp:
            raise ValueError(f"activation_checkpointing and fsdp apply to a RecurrentDepthLM, not to "
                             f"{type(model).__name__}: turn them off for this model")
        if cfg.compile:
            model.compile(mode=cfg.compile_mode)
        return ddist.wrap_model(model, env)
    model.gradient_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        compile_core(model, cfg.compile_mode)
    return ddist.wrap_model(model, env, fsdp=cfg.fsdp)


def compile_core(model: RecurrentDepthLM, mode: str = "default") -> None:
    """torch.compile each core block in place (parameter names unchanged: no `_orig_mod.` prefix),
    with torch.compile's `mode` (see `config.COMPILE_MODES`).

    Only the block is compiled, not the loop over steps, so one graph serves every depth.
    """
    for block in model.transformer.core_block:
        block.compile(dynamic=False, mode=mode)


class _InterruptRequest:
    """Ctrl-C, SIGTERM or SIGUSR1 during the training loop: the first asks to stop after the current step (which is
    then checkpointed: a step cut in half cannot be resumed exactly); a Ctrl-C after it interrupts at once. SIGTERM is
    how SLURM preempts a job (SIGKILL follows a grace period later) and torchrun stops its workers, and may come twice
    (from both); SIGUSR1 is what SLURM's --signal option commonly sends ahead. The previous handlers come back after.

    Only the main thread can receive signals; elsewhere (a Trainer run in a thread) nothing is installed. SIGUSR1 is
    taken only while it has its default action (it kills), so an embedding program's own use of it is kept."""

    def __init__(self) -> None:
        self.signum = 0  # the first signal received (0: none)
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        wanted = [signal.SIGINT, signal.SIGTERM]
        if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            wanted.append(signal.SIGUSR1)
        for signum in wanted:
            # None: a handler set outside Python, which could not be put back (SIGINT has Python's own to restore)
            if signum == signal.SIGINT or signal.getsignal(signum) is not None:
                self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            if previous is None:  # (SIGINT's earlier handler was not set from Python: Python's own stands in)
                previous = signal.default_int_handler
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.requested:  # (a repeated SIGTERM is a scheduler's: it waits for the step)
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def agreed(self, env: ddist.DistEnv) -> int:
        """The signal to stop on now (0: go on), the same on every rank: any rank's request stops them all after the
        same step (a scheduler may signal one rank's process only; the collective runs every step on every rank)."""
        return ddist.max_across_ranks(self.signum, env)


def _progress_bar(cfg: TrainConfig, env: ddist.DistEnv, initial: int):
    if not (cfg.progress and env.is_main):
        return None
    from tqdm.auto import tqdm

    # disable=None: no bar when stdout is not a terminal (CI logs stay clean).
    return tqdm(total=cfg.max_steps, initial=initial, unit="step", dynamic_ncols=True, disable=None)


def train(cfg: TrainConfig, **kwargs: Any) -> TrainResult:
    """Train as `cfg` says; see `Trainer`."""
    return Trainer(cfg, **kwargs).run()

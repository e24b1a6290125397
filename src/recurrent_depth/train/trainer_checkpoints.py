"""A `Trainer`'s checkpoints and final model directory: saving them, and resuming a run from one.

The on-disk format (staging, manifests, pruning, free-space checks) is `train/checkpointing.py`;
this module decides what of a trainer goes in (weights, optimizer, RNG, loop and data position),
which checkpoint a `--resume` continues from, and whether the configuration allows it. Saving is
collective: every rank calls it, rank 0 writes, and a failure is the same one-line
`CheckpointWriteError` on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from recurrent_depth.families.retrofit import PROVENANCE_FILE
from recurrent_depth.files import CONFIG_MAX_BYTES, PATH_MAX_CHARS, clipped, read_bytes
from recurrent_depth.generation_config import GENERATION_CONFIG_FILE
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train import distributed as ddist
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.init_from import run_tokenizer_dir
from recurrent_depth.train.lora import (
    adapter_settings,
    base_model_of,
    describe_adapter,
    is_peft_model,
    save_adapter,
    saved_adapter_settings,
)
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.weight_quant import quantized_weights

# A `train.trainer.Trainer`: named, not imported, since the trainer imports this module (layers point one way).
Trainer = Any

# Config fields a resumed run may change; any other difference makes --resume refuse.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "max_tokens", "max_minutes", "eval_interval", "eval_batches", "eval_depths", "save_every",
     "keep_last", "resume", "progress", "tensorboard", "out", "data_dir", "compile", "compile_mode",
     "activation_checkpointing", "keep_freed_memory", "accel", "max_skipped_fraction"}
)
# Config fields naming a file or directory: another spelling of the same one is no change.
PATH_FIELDS = frozenset({"init_from", "data", "tokenizer", "teacher", "distill_cache"})
# The loop counters a checkpoint's trainer_state.json restores (see `LoopState`).
LOOP_COUNTERS = ("step", "micro_step", "tokens", "skipped_steps", "elapsed_s")
# The string fields of a run's start record (`init_from.start_record`), all absent in a run from scratch's; its
# `tokenizer` digests are newer: optional.
START_STRINGS = ("directory", "identity", "content")
# The start directory's files a full-weight run keeps in its checkpoints and model/ (`write_weights`), which its start
# record's `files` names (`integrations.export.read_companions`: retrofit.json, generation_config.json).
START_FILES = (PROVENANCE_FILE, GENERATION_CONFIG_FILE)


# ------------------------------------------------------------------ saving
def save_checkpoint(trainer: Trainer) -> Path | None:
    """Write checkpoint `step-<step>` (collective: every rank must call it); None without `out`.

    Rank 0 checks the free space (pruning first, see `ckpt.make_room`) and writes; a failure removes
    the temporary directory and every rank raises the same one-line `CheckpointWriteError`."""
    env, step, cfg = trainer.env, trainer.state.step, trainer.cfg
    if trainer.out is None:
        return None
    model_state = checkpoint_model_state(trainer, ddist.full_model_state(trainer.wrapped, env))
    optim_state = ddist.optimizer_state(trainer.wrapped, trainer.optimizer, env)
    root = ckpt.checkpoints_root(trainer.out)
    tmp = root / f".tmp-{ckpt.checkpoint_name(step)}"
    final = root / ckpt.checkpoint_name(step)
    error = None
    if env.is_main:
        needed = ckpt.tensor_bytes(model_state) + ckpt.tensor_bytes(optim_state) + _dir_bytes(trainer.tokenizer_dir)
        try:
            with ckpt.staged_write(tmp, final, "checkpoint"):
                tmp = ckpt.begin_checkpoint(root, step)  # (removes what earlier crashed saves left)
                ckpt.make_room(root, step, needed, cfg.keep_last, log=trainer.log)
        except ckpt.CheckpointWriteError as exc:
            error = str(exc)
    raise_if_failed(error, env)
    if not env.is_main:
        ckpt.write_tensors(tmp / f"rng-rank{env.rank}.safetensors", ckpt.rng_state_tensors())
    ddist.barrier(env)
    if env.is_main:
        try:
            with ckpt.staged_write(tmp, final, "checkpoint"):
                write_weights(trainer, model_state, tmp, checkpoint=True)
                ckpt.save_state_files(tmp, "optimizer", optim_state)
                ckpt.write_tensors(tmp / ckpt.RNG_TENSORS, ckpt.rng_state_tensors())
                ckpt.write_json(tmp / ckpt.TRAINER_STATE, {
                    **trainer.state.to_dict(),
                    # (measured per step for a data= source: a token budget's schedule needs it at once on resume)
                    "tokens_per_step": trainer.tokens_per_step,
                    "data": trainer.source.state_dict(),
                    "world_size": env.world_size,
                    "config": cfg.to_dict(),
                    "sampler": trainer.sampler.to_dict() if trainer.sampler is not None else None,
                    "start": trainer.start,  # the model directory the run started from: `check_same_start`
                    "teacher": trainer.teacher_start,  # the teacher it distils from: `check_same_teacher`
                })
                final = ckpt.commit_checkpoint(tmp, step, keep_last=cfg.keep_last, log=trainer.log)
        except ckpt.CheckpointWriteError as exc:
            error = str(exc)
    raise_if_failed(error, env)
    return final


def save_model(trainer: Trainer, path: Path) -> Path | None:
    """The final weights + tokenizer as a model directory (collective; rank 0 writes).

    Written into a hidden temporary directory and renamed into place, so `path` is never left empty
    or half-written (an earlier `path` is replaced only once the new one is complete)."""
    state = ddist.full_model_state(trainer.wrapped, trainer.env)
    if trainer.save_dtype is not None:  # (checkpoints keep the trained dtype; the model directory DIR's)
        state = {k: v.to(trainer.save_dtype) if v.is_floating_point() else v for k, v in state.items()}
    error = None
    if trainer.env.is_main:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with ckpt.staged_write(tmp, path, "the model directory"):
                ckpt.remove_stale_staging(path)  # (a kill -9 during an earlier write left a whole copy)
                path.parent.mkdir(parents=True, exist_ok=True)
                ckpt.check_free_space(path.parent, ckpt.tensor_bytes(state) + _dir_bytes(trainer.tokenizer_dir),
                                      f"the model directory {path}")
                write_weights(trainer, state, tmp)
                ckpt.publish_directory(tmp, path)
        except ckpt.CheckpointWriteError as exc:
            error = str(exc)
    raise_if_failed(error, trainer.env)
    return path


def write_weights(trainer: Trainer, state: dict[str, torch.Tensor], directory: Path, checkpoint: bool = False) -> None:
    """`state` (+ config and tokenizer) as a model directory: ours, a transformers model's, or bare weights,
    with the start directory's retrofit.json and generation_config.json (`trainer.start_files`); a LoRA run's: a
    peft adapter directory, in a checkpoint with the whole state beside it (what resume reads)."""
    from recurrent_depth.checkpoint import copy_tokenizer, save_pretrained
    from recurrent_depth.files import atomic_write_bytes

    model, tokenizer_dir = trainer.model, trainer.tokenizer_dir
    if is_peft_model(model):
        save_adapter(model, directory, state)
        if checkpoint:
            _save_bare_weights(state, directory)
            config = base_model_of(model).config
            ckpt.write_json(directory / "config.json", config.to_dict() if hasattr(config, "to_dict") else {})
    elif isinstance(model, RecurrentDepthLM):
        save_pretrained(ckpt.StateView(trainer.model_config, state), directory, tokenizer_dir=tokenizer_dir)
        tokenizer_dir = None  # (save_pretrained copied it)
    elif hasattr(model, "save_pretrained"):  # a transformers model: its own format and config
        model.save_pretrained(directory, state_dict=state)
    else:
        _save_bare_weights(state, directory)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, directory)
    # Not into an adapter directory: `rdepth generate --lora`, `serve` and `export --merge-lora` read these from the
    # base model directory the adapter is applied to, which holds them.
    if not is_peft_model(model):
        for name, data in trainer.start_files.items():
            atomic_write_bytes(directory / name, data)


def adapter_only_checkpoints(trainer: Trainer) -> bool:
    """Whether the trainer's checkpoints hold its trainable (adapter) tensors only: those of a LoRA run on int8 / int4
    weights (QLoRA), whose frozen base is quantized again from the start directory when the run resumes
    (`check_same_start` holds it to the same one), as it was when the run began."""
    return is_peft_model(trainer.model) and quantized_weights(trainer.model)


def checkpoint_model_state(trainer: Trainer, state: dict[str, Any]) -> dict[str, Any]:
    """What of the model's `state` (or its shapes) a checkpoint holds (`adapter_only_checkpoints`)."""
    if not adapter_only_checkpoints(trainer):
        return state
    trainable = {name for name, p in ddist.unwrap(trainer.wrapped).named_parameters() if p.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def _save_bare_weights(state: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in state.items()}, directory / "model.safetensors")


def raise_if_failed(error: str | None, env: ddist.DistEnv) -> None:
    """Rank 0's error on every rank (collective), so no rank waits for a save that failed."""
    error = ddist.broadcast_object(error, env)
    if error is not None:
        raise ckpt.CheckpointWriteError(error)


def _dir_bytes(path: Path | None) -> int:
    return ckpt.directory_bytes(path) if path is not None and path.is_dir() else 0


# ------------------------------------------------------------------ resuming
def find_resume_checkpoint(root: Path, env: ddist.DistEnv, log: Callable[[str], None]) -> Path | None:
    """The newest valid checkpoint; newer invalid ones are set aside (renamed, not deleted) and named."""
    found, skipped = ckpt.newest_valid_checkpoint(root)
    ddist.barrier(env)  # every rank has looked before rank 0 renames anything
    if env.is_main:
        for path, problem in skipped:
            moved = ckpt.set_aside(path)
            fallback = f"resuming from {found.name}" if found is not None else "no valid checkpoint is left"
            log(f"skipping checkpoint {path}: {problem}; moved it to {moved.name}, {fallback}")
    ddist.barrier(env)
    return found


def check_resumable(path: Path, cfg: TrainConfig, world_size: int, adapter: dict[str, Any] | None = None,
                    start: dict[str, Any] | None = None, teacher: dict[str, str] | None = None) -> None:
    """Refuse to resume from `path` with a changed config, another LoRA adapter (`adapter`: this run's
    `lora.adapter_settings`, None: every weight trains), another number of processes, another starting model
    directory (`start`: this run's `init_from.start_record`, see `check_same_start`) or a teacher changed since
    (`teacher`: this run's `distill.teacher_record`, see `check_same_teacher`)."""
    try:
        trainer_state = ckpt.read_trainer_state(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot resume from {path}: unreadable {ckpt.TRAINER_STATE} ({exc})") from exc
    try:
        saved_adapter = saved_adapter_settings(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot resume from {path}: unreadable adapter config ({exc})") from exc
    saved, current = _with_field_defaults(trainer_state.get("config", {})), cfg.to_dict()
    if cfg.init_from is not None and saved.get("init_from") is not None:
        saved["preset"] = current["preset"]  # (ignored from a model directory, whose config the run trains)
    changes = config_changes(saved, current)
    if saved_adapter != adapter:
        before, after = describe_adapter(saved_adapter), describe_adapter(adapter)
        changes.append(f"lora: {before} -> {after}" if before != after else "lora: other target modules")
    if changes:
        raise ValueError(f"cannot resume from {path}: the configuration changed ({', '.join(changes)}); "
                         f"only {', '.join(sorted(RESUMABLE_CHANGES - {'resume'}))} may change on --resume")
    if trainer_state.get("world_size") != world_size:
        raise ValueError(f"cannot resume from {path}: it was written by {trainer_state.get('world_size')} "
                         f"process(es), this run has {world_size}")
    recorded = trainer_state.get("start")
    check_same_start(path, recorded, start)
    check_same_teacher(path, trainer_state.get("teacher"), teacher)
    # the run's tokenizer (`init_from.run_tokenizer_dir`); a run that trained its own keeps it in its out/tokenizer,
    # which `keep_run_tokenizer` checks
    start_dir = start.get("directory") if start is not None else None
    tokenizer_dir = run_tokenizer_dir(cfg, Path(start_dir) if start_dir is not None else None)
    if tokenizer_dir is not None:
        check_same_tokenizer(path, tokenizer_dir, started_tokenizer(recorded))


def started_tokenizer(recorded: Any) -> dict[str, str | None] | None:
    """The digests of the run's tokenizer files as it started, from a checkpoint's start record (`recorded`, checked
    by `check_same_start`); None where it holds none (code older than these records)."""
    return recorded.get("tokenizer") if isinstance(recorded, dict) else None


def check_same_tokenizer(path: Path, tokenizer_dir: Path, started_with: dict[str, str | None] | None = None) -> None:
    """Refuse (one ValueError naming the files) to resume checkpoint `path` with a tokenizer changed in place since
    the run started: its token ids (and chat template) would no longer be the ones the weights trained on.
    `started_with`: the files' digests as the run started (its start record's `tokenizer`), so a tokenizer
    replaced before the first checkpoint is refused too; without it (a checkpoint of older code), the checkpoint's
    copy of the run's tokenizer (`write_weights`) is compared. A checkpoint holding none (a run given token shards
    without a tokenizer) has nothing to compare."""
    from recurrent_depth.checkpoint import TRAINING_TOKENIZER_FILES, file_digests

    try:
        saved = started_with if started_with is not None else file_digests(path, TRAINING_TOKENIZER_FILES)
        now = file_digests(tokenizer_dir, TRAINING_TOKENIZER_FILES)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot resume from {path}: cannot compare the run's tokenizer files ({exc})") from None
    if all(saved.get(name) is None for name in TRAINING_TOKENIZER_FILES):
        return
    changed = [name for name in TRAINING_TOKENIZER_FILES if saved.get(name) != now[name]]
    if changed:
        verb = "differs" if len(changed) == 1 else "differ"
        what = "the one the run started with" if started_with is not None else "the checkpoint's copy"
        raise ValueError(f"cannot resume from {path}: the tokenizer in {tokenizer_dir} changed since the run started "
                         f"({', '.join(changed)} {verb} from {what}), so the run would train on other token ids; put "
                         f"back the tokenizer the run started with")


def keep_run_tokenizer(path: Path, tokenizer_dir: Path, log: Callable[[str], None]) -> None:
    """A resumed run that trained its own tokenizer (out/tokenizer) keeps the one checkpoint `path` trained on: the
    checkpoint's copy is put back where `tokenizer_dir` lost its tokenizer.json (training one again may give other
    token ids, and its shards were packed anew), and one replaced since the run started is refused
    (`check_same_tokenizer`, with the digests the checkpoint's start record holds), the copy put back included."""
    from recurrent_depth.checkpoint import copy_tokenizer

    restore = not (tokenizer_dir / "tokenizer.json").exists()
    if restore and not (path / "tokenizer.json").is_file():
        raise ValueError(f"cannot resume from {path}: {tokenizer_dir} holds no tokenizer.json and the checkpoint no "
                         f"copy of the tokenizer the run trained; put back the run's tokenizer")
    try:
        recorded = ckpt.read_trainer_state(path).get("start")
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot resume from {path}: unreadable {ckpt.TRAINER_STATE} ({exc})") from exc
    check_same_tokenizer(path, path if restore else tokenizer_dir, started_tokenizer(recorded))
    if restore:
        copy_tokenizer(path, tokenizer_dir)
        log(f"{tokenizer_dir} held no tokenizer.json: restored the run's tokenizer from {path}")


def same_model_dir(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two `checkpoint.model_dir_record`s describe the same model: the same identity, or (a copy rewritten
    without its mtimes, a download again) the same content sample."""
    return recorded.get("identity") == now.get("identity") or recorded.get("content") == now.get("content")


def check_same_start(path: Path, recorded: Any, start: dict[str, Any] | None) -> None:
    """Refuse (one ValueError naming both directories) to resume checkpoint `path` of a run that started from one
    model directory (`recorded`, its `init_from.start_record`) from another one, or from the same one changed
    since (a model of the same config included): on resume `rdepth rl` takes its reference model and every
    command its tokenizer from there. Nothing to compare for a checkpoint that records none (written before
    checkpoints did) or a run that names none, nor where neither started from a model directory (runs from
    scratch record their tokenizer only: `check_same_tokenizer`). Files rewritten with the same content (a copy
    without its mtimes, a download again) pass on `content`, a sample of their bytes."""
    if recorded is None:
        return
    from_scratch = isinstance(recorded, dict) and all(key not in recorded for key in START_STRINGS)
    if not (isinstance(recorded, dict) and _digests_or_none(recorded.get("tokenizer"))
            and _digests_or_none(recorded.get("files"))
            and ((from_scratch and recorded.get("tokenizer") is not None)
                 or (all(isinstance(recorded.get(key), str) for key in START_STRINGS)
                     and len(recorded["directory"]) <= PATH_MAX_CHARS))):
        raise ValueError(f"cannot resume from {path}: its {ckpt.TRAINER_STATE} records start={clipped(recorded)}, "
                         f"expected where the run started (the model directory's {', '.join(START_STRINGS)}: "
                         f"strings, none from scratch; files and tokenizer: file digests); the checkpoint is damaged")
    if start is None or (from_scratch and "directory" not in start):
        return
    if same_model_dir(recorded, start):
        return
    before, now = recorded.get("directory", "scratch"), start.get("directory", "scratch")
    what = (f"{now} changed since the run started from it" if before == now else
            f"the run started from {before}, this run from {now}")
    raise ValueError(f"cannot resume from {path}: {what} (the model directories' config.json or weights differ); "
                     f"resume with the model the run started from")


def check_same_teacher(path: Path, recorded: Any, teacher: dict[str, str] | None) -> None:
    """Refuse (one ValueError naming the teacher) to resume checkpoint `path` of a distilling run whose teacher
    (`recorded`: its `distill.teacher_record` as the run started) was retrained or replaced in place since: the run
    would go on distilling another model's logits (a changed `teacher` path is a config change). Nothing to compare
    for a checkpoint that records none (older code, or a run that reads no teacher) or a run that reads none;
    a copy rewritten with the same content passes on `content`, as `check_same_start` does."""
    if recorded is None or teacher is None:
        return
    if not (isinstance(recorded, dict) and all(isinstance(recorded.get(key), str) for key in START_STRINGS)):
        raise ValueError(f"cannot resume from {path}: its {ckpt.TRAINER_STATE} records teacher={clipped(recorded)}, "
                         f"expected the teacher's {', '.join(START_STRINGS)} (strings); the checkpoint is damaged")
    if same_model_dir(recorded, teacher):
        return
    raise ValueError(f"cannot resume from {path}: the teacher {teacher['directory']} changed since the run started "
                     f"distilling from it (its config.json or weights differ); resume with the teacher the run "
                     f"started with")


def _digests_or_none(value: Any) -> bool:
    """`value` is a start record's `tokenizer` ({file name: sha256 or None}), or absent (a record of older code)."""
    return value is None or (isinstance(value, dict) and len(value) <= 16
                             and all(isinstance(v, str | None) for v in value.values()))


def resume(trainer: Trainer) -> Path | None:
    """Continue `trainer` from `trainer.resume_from`, or from an older valid checkpoint when that one's
    files do not load into this model (set aside like any invalid checkpoint, and said); None when no
    checkpoint is left (the run starts from scratch, `Trainer._start_from_scratch`: nothing was applied to it)."""
    path = trainer.resume_from
    root = ckpt.checkpoints_root(trainer.out) if trainer.out is not None else None
    env = trainer.env
    while path is not None:
        check_same_model(trainer.model, path)  # (another model is a refusal, not a damaged checkpoint to set aside)
        loaded, problem = load_for_resume(trainer, path)
        # every rank falls back together, or stops, whichever rank's load failed (its own rng-rank<r> file ...)
        problem = next((p if rank == 0 else f"on rank {rank}: {p}"
                        for rank, p in enumerate(ddist.every_rank(problem, env)) if p is not None), None)
        if problem is None:
            apply_checkpoint(trainer, loaded)
            return path
        ddist.barrier(env)
        moved = ckpt.set_aside(path).name if env.is_main else ""
        ddist.barrier(env)
        older = find_resume_checkpoint(root, env, trainer.log)
        fallback = f"resuming from {older.name}" if older is not None else "no valid checkpoint is left"
        trainer.log(f"skipping checkpoint {path}: {problem}; moved it to {moved}, {fallback}")
        if older is not None:
            check_resumable(older, trainer.cfg, env.world_size, adapter_settings(trainer.model), trainer.start,
                            trainer.teacher_start)
        path = older
    return None  # (the trainer says it starts from scratch, with where the earlier session's record went)


def check_same_model(model: Any, path: Path) -> None:
    """Refuse (one ValueError naming the fields) to resume checkpoint `path` into a model of another config,
    e.g. `rdepth rl --resume` with another --init-from: its weights would not load, and setting the valid
    checkpoints aside would restart the run from scratch. (Only for a `RecurrentDepthLM`, under LoRA too.)"""
    from recurrent_depth.config import ModelConfig

    config = getattr(base_model_of(model), "config", None)
    if not isinstance(config, ModelConfig):
        return
    try:
        saved = _jsonable(ModelConfig.from_json(path / "config.json").to_dict())
    except (OSError, ValueError, TypeError):
        return  # (not our config: the weights' shape check decides)
    now = _jsonable(config.to_dict())
    changes = [f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in sorted(set(saved) | set(now))
               if saved.get(key) != now.get(key)]
    if changes:
        raise ValueError(f"cannot resume from {path}: it holds another model than this run's ({', '.join(changes)}); "
                         f"resume with the model the run started from")


def load_for_resume(trainer: Trainer, path: Path) -> tuple[ckpt.LoadedCheckpoint | None, str | None]:
    """Every part of checkpoint `path`, read and checked against this trainer's model before any of it is
    applied: (loaded, None), or (None, why it cannot be resumed from)."""
    try:
        loaded = ckpt.load_checkpoint(path, rank=trainer.env.rank)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        return None, ckpt._one_line(exc)
    expected = {k: tuple(v.shape) for k, v in checkpoint_model_state(trainer, base_state_shapes(trainer)).items()}
    found = {k: tuple(v.shape) for k, v in loaded.model_state.items()}
    missing = sorted(set(expected) - set(found) - {"lm_head.weight"})
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        return None, f"model.safetensors does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
    wrong = [k for k in found if found[k] != expected[k]]
    if wrong:
        return None, f"model.safetensors: {wrong[0]} has shape {list(found[wrong[0]])}, the model's is " \
                     f"{list(expected[wrong[0]])}"
    if loaded.rng and "torch_cpu" not in loaded.rng:
        return None, f"the RNG state of rank {trainer.env.rank} has no torch_cpu tensor"
    if not ddist.is_fsdp(trainer.wrapped):
        problem = optimizer_state_problem(trainer.optimizer, loaded.optimizer_state)
        if problem is not None:
            return None, f"{ckpt.OPTIMIZER_TENSORS}: {problem}"
    return loaded, None


def optimizer_state_problem(optimizer: Any, state: Any) -> str | None:
    """Whether a saved optimizer state fits `optimizer` (an `OptimizerSet` or a torch optimizer): the same
    optimizers, groups and parameter counts, every numeric group setting (eps, betas, ...) a number as this run's
    is, every per-parameter value a tensor or a number, and every per-parameter tensor the shape of its parameter.
    Checked before loading, since `load_state_dict` takes all of them as they are and fails only at a step."""
    parts = list(optimizer) if hasattr(optimizer, "optimizers") else [optimizer]
    saved = state.get("optimizers") if isinstance(state, dict) and hasattr(optimizer, "optimizers") else [state]
    if not isinstance(saved, list) or len(saved) != len(parts):
        return f"holds {len(saved) if isinstance(saved, list) else 'no'} optimizer states, this run has {len(parts)}"
    for k, (opt, opt_state) in enumerate(zip(parts, saved)):
        groups = opt_state.get("param_groups") if isinstance(opt_state, dict) else None
        per_param = opt_state.get("state") if isinstance(opt_state, dict) else None
        if not isinstance(groups, list) or not isinstance(per_param, dict) or len(groups) != len(opt.param_groups):
            return f"optimizer {k} is not a state of this run's optimizer ({len(opt.param_groups)} parameter groups)"
        params: dict[Any, torch.Tensor] = {}
        for group, mine in zip(groups, opt.param_groups):
            ids = group.get("params") if isinstance(group, dict) else None
            if not isinstance(ids, list) or len(ids) != len(mine["params"]):
                return f"optimizer {k}: a parameter group does not match this run's ({len(mine['params'])} parameters)"
            params.update(zip(ids, mine["params"]))
            problem = _group_settings_problem(group, mine)
            if problem is not None:
                return f"optimizer {k}: parameter group {mine.get('name', '')!r}: {problem}"
        for pid, entry in per_param.items():
            if pid not in params or not isinstance(entry, dict):
                return f"optimizer {k}: state for an unknown parameter {pid!r}"
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor) and not _is_number(value):
                    return f"optimizer {k}: {name} of parameter {pid} is {clipped(value)}, not a tensor or a number"
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                    return (f"optimizer {k}: {name} of parameter {pid} has shape {list(value.shape)}, the parameter "
                            f"{list(params[pid].shape)}")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _group_settings_problem(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """A saved parameter group's setting that is not a number (or tuple of numbers, as betas) where this run's is:
    torch loads the saved settings in place of the run's, and a string eps was a TypeError traceback at the first
    step. Settings the saved group lacks are left to torch (a newer torch fills in those it added)."""
    for key, now in mine.items():
        if key == "params" or key not in saved:
            continue
        value = saved[key]
        if _is_number(now) and not _is_number(value):
            return f"{key} is {clipped(value)}, expected a number"
        if (isinstance(now, tuple | list) and now and all(_is_number(v) for v in now)
                and not (isinstance(value, tuple | list) and len(value) == len(now)
                         and all(_is_number(v) for v in value))):
            return f"{key} is {clipped(value)}, expected {len(now)} numbers"
    return None


def base_state_shapes(trainer: Trainer) -> dict[str, Any]:
    """The unwrapped model's state dict (shapes only are read; an FSDP DTensor reports its full shape)."""
    return ddist.unwrap(trainer.wrapped).state_dict()


def apply_checkpoint(trainer: Trainer, loaded: ckpt.LoadedCheckpoint) -> None:
    """Continue `trainer` from a loaded checkpoint: data position (first: a data state this run's data does not take
    is refused before anything changed), weights, optimizer, loop counters, RNG, and the start directory's files the
    run started with (`started_files`)."""
    recorded = loaded.trainer_state.get("start")
    # (an adapter's checkpoints hold none: `write_weights`)
    kept = None if is_peft_model(trainer.model) else started_files(loaded.path, recorded)
    try:
        trainer.source.load_state_dict(loaded.trainer_state["data"])
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # (a source's own checks raise ValueError)
        raise ValueError(f"cannot resume from {loaded.path}: its data position {clipped(loaded.trainer_state['data'])} "
                         f"is not one of this run's data ({type(exc).__name__}: {exc})") from None
    model_state = loaded.model_state
    if adapter_only_checkpoints(trainer):  # (the adapter's tensors alone: the rebuilt base's own stay as they are)
        model_state = {**base_state_shapes(trainer), **model_state}
    ddist.load_full_model_state(trainer.wrapped, model_state, trainer.env)
    ddist.load_optimizer_state(trainer.wrapped, trainer.optimizer, loaded.optimizer_state, trainer.env)
    for name in LOOP_COUNTERS:
        setattr(trainer.state, name, type(getattr(trainer.state, name))(loaded.trainer_state[name]))
    if trainer.tokens_per_step is None and loaded.trainer_state.get("tokens_per_step"):
        trainer.tokens_per_step = int(loaded.trainer_state["tokens_per_step"])
    if loaded.rng:
        ckpt.restore_rng_state(loaded.rng)
    if kept is not None:
        trainer.start_files = kept
        trainer.start = {**trainer.start, "files": recorded["files"]} if trainer.start is not None else None
    trainer.log(f"resumed from {loaded.path} at step {trainer.state.step}")


def started_files(path: Path, recorded: Any) -> dict[str, bytes] | None:
    """{name: bytes} of the start directory's retrofit.json and generation_config.json as the run started: the copies
    checkpoint `path` holds of those its start record (`recorded`) names in `files`. A resumed run writes these into
    its checkpoints and model/, not what the start directory holds now (edited, added or removed since: the final
    model silently took another generation config than its checkpoints). None where the record names none (a run
    from scratch; a checkpoint of older code: the start directory's are kept, as that code did)."""
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if files is None:
        return None
    if not _digests_or_none(files):  # (`check_same_start` refuses it first, where a resume checks the start)
        raise ValueError(f"cannot resume from {path}: its start record's files are {clipped(files)}, not file "
                         f"digests; the checkpoint is damaged")
    kept: dict[str, bytes] = {}
    for name, digest in files.items():
        try:
            data = read_bytes(path / name, CONFIG_MAX_BYTES, f"file {name}") if name in START_FILES else None
        except (OSError, ValueError):
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"cannot resume from {path}: it holds no copy of the {clipped(name)} the run started "
                             f"with (its start record's files); the checkpoint is damaged")
        kept[name] = data
    return kept


def _with_field_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run config with the fields it lacks (added to TrainConfig or OptimConfig after it was written)
    at their defaults: a new field's default is the old behaviour, so it must not block a resume."""
    def defaults(cls: type) -> dict[str, Any]:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    filled = {**_jsonable(defaults(TrainConfig)), **saved}
    if isinstance(saved.get("optim"), dict):
        filled["optim"] = {**_jsonable(defaults(OptimConfig)), **saved["optim"]}
    return filled


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`field: old -> new` for each non-resumable field that differs (`optim.lr: ...` inside mappings)."""
    changes = []
    for key in sorted(current):
        old, new = saved.get(key), _jsonable(current[key])
        if key in RESUMABLE_CHANGES or old == new or (key in PATH_FIELDS and _same_path(old, new)):
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changes += [f"{key}.{sub}: {old.get(sub)!r} -> {new.get(sub)!r}"
                        for sub in sorted(set(old) | set(new)) if old.get(sub) != new.get(sub)]
        else:
            changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def _same_path(old: Any, new: Any) -> bool:
    """Two spellings of one existing file or directory (`base` and `./base/`, or an absolute path)."""
    return (isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new)
            and os.path.samefile(old, new))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))

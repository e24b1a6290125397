"""Start training from a saved model directory (`rdepth train --init-from DIR`, `rdepth sft`, RL).

DIR is a model directory of ours, a run directory holding one (`DIR/model`), an official
Huginn-0125 directory or an Ouro one (`docs/looped-family.md`). The run takes DIR's model config,
weights and tokenizer, with a fresh optimizer and schedule (an Ouro model is saved in our format).
What may differ from DIR: the optimizer, learning rate and schedule, the data, the step
budget, the depth scheme and the config's `mean_recurrence` / `mean_backprop_depth` (a run's `mean_recurrence` /
`backprop_depth` set them, as in a run from scratch, unless `model` names them). Any other change
(a `--model-set` of a shape field, another vocabulary or tokenizer, rows longer than `max_seq_len`) is a
one-line error naming the field.

The weights are trained in float32 (the optimizer's master copy, whatever `dtype` autocasts to); the final
model directory is written back in DIR's stored dtype, so zero steps reproduce DIR's tensors bit for bit.

    start = load_for_training(cfg, device)   # one place: train, sft and rl all call it
    Trainer(cfg, model=start.model, data=..., tokenizer_dir=start.tokenizer_dir, save_dtype=start.dtype)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.checkpoint import (
    TRAINING_TOKENIZER_FILES,
    file_digests,
    model_dir_record,
    stored_dtype,
)
from recurrent_depth.config import ModelConfig
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig

# ModelConfig fields a run started from DIR may set differently from DIR's config.json.
CHANGEABLE_MODEL_FIELDS = ("mean_recurrence", "mean_backprop_depth")
# Fields the resolved TrainConfig leaves to the tokenizer (`TrainConfig.model_config` takes it from there).
_TOKENIZER_FIELDS = ("vocab_size",)


@dataclass
class StartingPoint:
    """A model loaded from DIR to train: float32 weights in train mode, and what came with them."""

    model: RecurrentDepthLM
    model_dir: Path  # the directory the weights came from (DIR or DIR/model)
    tokenizer_dir: Path
    dtype: torch.dtype  # DIR's stored dtype: the final model directory is written in it


def find_model_dir(path: str | Path) -> Path:
    """DIR itself when it holds config.json, else DIR/model (a run directory); a ValueError otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"init_from={str(path)!r} is not a directory")
    if (p / "config.json").is_file():
        return p
    if (p / "model" / "config.json").is_file():
        return p / "model"
    from recurrent_depth.checkpoint import lora_adapter_hint

    raise ValueError(f"init_from={str(path)!r} holds no config.json and no model/config.json: expected a model "
                     f"directory, a run directory holding model/, or an official Huginn-0125, Ouro or Parcae "
                     f"directory" + (lora_adapter_hint(p, merged_for="start from that") or _checkpoints_hint(p)))


def _checkpoints_hint(p: Path) -> str:
    """'' or, for a run directory without model/ (its run stopped before the end) or its checkpoints/, where a
    model directory is: each checkpoint is one."""
    from recurrent_depth.train import checkpointing as ckpt

    found = ckpt.list_checkpoints(ckpt.checkpoints_root(p)) or ckpt.list_checkpoints(p)
    if not found:
        return ""
    return (f"; it holds checkpoints and no model/ (a run that has not finished): start from a checkpoint, e.g. "
            f"the newest {found[-1][1]}, or finish that run with --resume")


def start_record(model_dir: Path | None, tokenizer_dir: Path, files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """What a run's checkpoints record about where it started: the model directory it started from (its absolute
    path, `checkpoint.model_identity` and `checkpoint.model_content_sample`: `checkpoint.model_dir_record`), which
    `trainer_checkpoints.check_same_start` compares on resume; none for a run from scratch, `model_dir=None`), the
    digests of the run's tokenizer files as the run started (`trainer_checkpoints.check_same_tokenizer`: a
    tokenizer replaced before the first checkpoint, whose copy the checkpoint then holds, is still told apart) and
    of the start directory's files the run keeps (`files`: its retrofit.json and generation_config.json as read at
    the start; a resume takes them from its checkpoint, `trainer_checkpoints.started_files`)."""
    tokenizer = {"tokenizer": file_digests(tokenizer_dir, TRAINING_TOKENIZER_FILES)}
    if model_dir is None:
        return tokenizer
    kept = {name: hashlib.sha256(data).hexdigest() for name, data in sorted((files or {}).items())}
    return {**model_dir_record(model_dir), **tokenizer, "files": kept}


def run_tokenizer_dir(cfg: TrainConfig, model_dir: Path | None) -> Path | None:
    """The tokenizer a run started from `model_dir` (None: from scratch) trains with: the one `cfg` names
    (`resolved_config` names DIR's, or `--tokenizer`'s when DIR has none), else DIR's (`rdepth rl`, whose config
    names none); None for a run from scratch that trains its own (out/tokenizer) or is given token shards."""
    return Path(cfg.tokenizer) if cfg.tokenizer is not None else model_dir


def read_model_config(model_dir: Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(model_dir / "config.json")
    except (OSError, ValueError) as exc:
        raise ValueError(f"init_from: cannot read {model_dir / 'config.json'}: {exc}") from None


def model_overrides(base: ModelConfig, cfg: TrainConfig, model_dir: Path) -> dict[str, Any]:
    """The changes `cfg` makes to DIR's model config: only `CHANGEABLE_MODEL_FIELDS` may differ. The run's depth
    settings (--mean-recurrence, --backprop-depth) are among them, as in a run from scratch: the saved config
    records the depth the model was trained at (`TrainConfig.trained_depth_fields`)."""
    stored = base.to_dict()
    changes: dict[str, Any] = {}
    for key, value in sorted({**cfg.trained_depth_fields(), **cfg.model}.items()):
        if stored.get(key) == value:
            continue
        if key not in CHANGEABLE_MODEL_FIELDS:
            raise ValueError(f"TrainConfig.model.{key}={value!r} differs from {model_dir}'s {key}={stored.get(key)!r}: "
                             f"starting from a model directory, only {' and '.join(CHANGEABLE_MODEL_FIELDS)} "
                             f"may change")
        changes[key] = value
    if cfg.vocab_size is not None and cfg.vocab_size != base.vocab_size:
        raise ValueError(f"TrainConfig.vocab_size={cfg.vocab_size} differs from {model_dir}'s vocab_size="
                         f"{base.vocab_size}: the vocabulary comes from the model directory")
    if cfg.seq_len is not None and cfg.seq_len > base.max_seq_len:
        raise ValueError(f"TrainConfig.seq_len={cfg.seq_len} is longer than {model_dir}'s max_seq_len="
                         f"{base.max_seq_len}: rows must fit the model's context")
    return changes


def depth_change_note(cfg: TrainConfig, adapter: bool = False, generation_config: bytes | None = None) -> str | None:
    """One log line naming the depth fields of DIR's config that the run changes (None: none), e.g. a retrofitted
    model healed at --mean-recurrence 32, whose saved config then says 32 where DIR's said 4. `generation_config`:
    DIR's generation_config.json as the run keeps it, whose `num_steps` generate reads before the config's depth."""
    model_dir = find_model_dir(cfg.init_from)
    base = read_model_config(model_dir)
    changes = model_overrides(base, cfg, model_dir)
    if not changes:
        return None
    what = ", ".join(f"{key} {getattr(base, key)} -> {value}" for key, value in changes.items())
    where = ("the base model's, in memory: model/ holds the adapter" if adapter else
             "model/config.json records it: the default depth of generate, eval and serve")
    steps = json.loads(generation_config).get("num_steps") if generation_config is not None else None
    if steps is not None and not adapter:  # (a JSON object: read_companions checked it)
        where += f", though the generation_config.json kept from {model_dir} sets generate's num_steps={steps}"
    return f"model config: {what} (the depth this run trains at; {where})"


def find_tokenizer(model_dir: Path, cfg: TrainConfig, vocab_size: int) -> Path:
    """DIR's tokenizer (a `tokenizer` setting may only name it again, or stand in when DIR has none)."""
    from recurrent_depth.data.tokenizer import load_tokenizer, vocab_span

    own = (model_dir / "tokenizer.json").is_file()
    if cfg.tokenizer is not None and own and not _same_tokenizer(Path(cfg.tokenizer), model_dir):
        raise ValueError(f"TrainConfig.tokenizer={cfg.tokenizer!r} differs from the tokenizer in {model_dir}: "
                         f"starting from a model directory, the tokenizer comes from it")
    if not own and cfg.tokenizer is None:
        raise ValueError(f"{model_dir} holds no tokenizer.json: copy the model's tokenizer files into it (`rdepth "
                         f"train` also takes --tokenizer DIR; `rdepth sft` and `rdepth rl` read it from {model_dir})")
    directory = model_dir if own else Path(cfg.tokenizer)
    # (its largest id + 1, not its count: a tokenizer.json numbering a token past its count makes that id, which
    # failed a batch mid-run, or the save of model/ at the run's end)
    size = vocab_span(load_tokenizer(directory))
    if size > vocab_size:
        raise ValueError(f"the tokenizer in {directory} makes ids up to {size - 1}, outside {model_dir}'s "
                         f"vocab_size={vocab_size}")
    return directory


def _same_tokenizer(given: Path, model_dir: Path) -> bool:
    """`given` is DIR itself, or holds DIR's tokenizer.json byte for byte (say, the tokenizer/ of the run that
    trained DIR, which a reused config names)."""
    if given.resolve() == model_dir.resolve():
        return True
    try:
        return (given / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    except OSError:
        return False


def resolved_config(cfg: TrainConfig, lora: bool | None = None) -> TrainConfig:
    """`cfg` with DIR's model config as its `model` (the depth overrides on top), DIR's tokenizer and, unless
    set, DIR's max_seq_len as `seq_len`, and its optimizer for a run that trains every weight or a LoRA adapter
    (`lora`, None: as an earlier call said, else every weight; see `resolved_optim`): what the run trains, in
    run.json. Applying it twice changes nothing."""
    if cfg.init_from is None:
        return cfg
    model_dir = find_model_dir(cfg.init_from)
    base = read_model_config(model_dir)
    values = {k: v for k, v in base.to_dict().items() if k != "model_type" and k not in _TOKENIZER_FIELDS}
    values.update(model_overrides(base, cfg, model_dir))
    values.update(kept_checkpoint_depth(cfg, base, values))  # (a run started by older code goes on as it started)
    tokenizer = find_tokenizer(model_dir, cfg, base.vocab_size)
    return resolved_optim(cfg.replace(model=values, tokenizer=str(tokenizer),
                                      seq_len=cfg.seq_len if cfg.seq_len is not None else base.max_seq_len), lora)


def resolved_optim(cfg: TrainConfig, lora: bool | None) -> TrainConfig:
    """The one place that settles the optimizer of a run from a model directory that named no optimizer preset
    and no lr (`cfg.optim_default`): the fine-tuning preset for every weight or a LoRA adapter
    (`config.default_optim_preset`) or, resuming, the recipe its checkpoint records (other optim settings it
    names on top, which the resume check compares): a run started with another default resumes with it."""
    resumed = checkpoint_optim(cfg.out) if cfg.optim_default is not None and cfg.resume else None
    return cfg.with_optim_for(lora=lora, resumed=resumed)


def checkpoint_configs(out: str | None) -> Iterator[dict[str, Any]]:
    """The run configs the readable checkpoints in `<out>/checkpoints` record, newest first."""
    from recurrent_depth.train import checkpointing as ckpt

    if out is None:
        return
    for _, path in reversed(ckpt.list_checkpoints(ckpt.checkpoints_root(out))):
        try:
            config = ckpt.read_trainer_state(path)["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # (a damaged checkpoint: the Trainer sets it aside; an older one records the same run)
        if isinstance(config, dict):
            yield config


def checkpoint_optim(out: str | None) -> OptimConfig | None:
    """The optimizer recipe the newest readable checkpoint in `<out>/checkpoints` records (None: none does)."""
    for config in checkpoint_configs(out):
        try:
            return OptimConfig.from_dict(config["optim"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def recorded_model(cfg: TrainConfig) -> dict[str, Any] | None:
    """The model config (`TrainConfig.model`) the newest readable checkpoint of a --resume records, JSON as read;
    None without --resume or such a checkpoint."""
    saved = next(checkpoint_configs(cfg.out), None) if cfg.resume else None
    model = saved.get("model") if saved is not None else None
    return model if isinstance(model, dict) else None


def kept_checkpoint_depth(cfg: TrainConfig, base: ModelConfig, values: dict[str, Any]) -> dict[str, Any]:
    """{field: DIR's value} of the depth fields a --resume keeps as its checkpoints record them, {} if none: a run
    started before --init-from runs saved their depth kept DIR's mean_recurrence / mean_backprop_depth where the
    run's depth settings now set theirs (`TrainConfig.trained_depth_fields`). Only where the recorded model config
    differs from the resolved one (`values`) in those fields alone, each recorded as DIR's: the run then goes on as
    it started (the same model config, checkpoint after checkpoint) rather than being refused as changed."""
    recorded = recorded_model(cfg)
    if recorded is None:
        return {}
    now, stored = json.loads(json.dumps(values)), json.loads(json.dumps(base.to_dict()))
    differ = {key for key in set(recorded) | set(now) if recorded.get(key) != now.get(key)}
    kept = {key: stored[key] for key in differ & set(cfg.trained_depth_fields()) if recorded.get(key) == stored[key]}
    return kept if differ == set(kept) else {}


def kept_depth_note(cfg: TrainConfig) -> str | None:
    """One log line for a resumed run from DIR whose model config keeps DIR's depth where its depth settings name
    another (`kept_checkpoint_depth`, or a --model-set of DIR's value), as its checkpoints record it; None if none."""
    recorded = recorded_model(cfg) if cfg.init_from is not None else None
    if recorded is None:
        return None
    model_dir = find_model_dir(cfg.init_from)
    stored = read_model_config(model_dir).to_dict()
    kept = {key: value for key, value in sorted(cfg.depth_settings().items())
            if value != cfg.model.get(key) == stored[key] == recorded.get(key)}
    if not kept:
        return None
    what = ", ".join(f"{key} {stored[key]} (the run trains at {value})" for key, value in kept.items())
    return (f"model config: keeps {model_dir}'s {what}, as this run's checkpoints record it (a run started before "
            "--init-from runs saved the depth they train at, or a --model-set): model/config.json records it, the "
            "default depth of generate, eval and serve")


def load_for_training(cfg: TrainConfig, device: torch.device | str = "cpu") -> StartingPoint:
    """The model `cfg.init_from` names, checked against `cfg` (see the module docstring), in float32."""
    if cfg.init_from is None:
        raise ValueError("load_for_training needs TrainConfig.init_from (a model directory)")
    model_dir = find_model_dir(cfg.init_from)
    base = read_model_config(model_dir)
    changes = model_overrides(base, cfg, model_dir)
    tokenizer_dir = find_tokenizer(model_dir, cfg, base.vocab_size)
    dtype = stored_dtype(model_dir) or torch.float32
    model = RecurrentDepthLM.from_pretrained(model_dir, dtype=torch.float32, device=device, config_overrides=changes)
    model.train()
    return StartingPoint(model=model, model_dir=model_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)

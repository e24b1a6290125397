"""`TrainConfig`: everything one training run needs, as one validated dataclass.

Sources, later ones winning: the dataclass defaults, a YAML file (`TrainConfig.from_yaml`), then
flat overrides (`TrainConfig.from_sources(path, overrides)`, which is what `rdepth train` calls).
The YAML mirrors the fields; `model:` holds `ModelConfig` overrides on top of `preset`, and
`optim:` holds `OptimConfig` fields on top of its `preset` (default "demo"; a run from a model directory
that names neither a preset nor an lr gets "finetune", or "finetune-lora" for a LoRA adapter:
`default_optim_preset`)::

    preset: small
    model: {hidden_size: 192}
    data: stdlib
    seq_len: 256
    batch_size: 8
    max_steps: 2000
    optim: {preset: demo, name: muon, lr: 0.004}
    eval_depths: [1, 2, 4, 8, 16, 32]

The resolved config is written to `<out>/run.json` and into every checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
import warnings
from collections.abc import Callable, Collection
from contextvars import ContextVar
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from recurrent_depth.config import MAX_NUM_STEPS, MAX_SEQ_LEN, PRESETS, ModelConfig, check_field_names, is_int, is_real
from recurrent_depth.files import CONFIG_MAX_BYTES, read_text
from recurrent_depth.train.depth import SCHEMES
from recurrent_depth.train.optim import OPTIM_PRESETS, OptimConfig

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# torch.compile's modes ("max-autotune-no-cudagraphs" autotunes kernels, measured 1.05x over "default"
# on the `small` core here; "reduce-overhead" uses CUDA graphs on GPUs).
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DEFAULT_OPTIM_PRESET = "demo"
# The recipes of a run from a model directory (init_from) that names no optimizer preset and no lr: the demo's
# from-scratch rate would wreck a pretrained model (train/optim.py says why these numbers).
FINETUNE_OPTIM_PRESET = "finetune"
FINETUNE_LORA_OPTIM_PRESET = "finetune-lora"
# ModelConfig fields the tokenizer sets (so their range is only known once it exists).
TOKEN_ID_FIELDS: tuple[str, ...] = ("bos_token_id", "eos_token_id", "pad_token_id")
# Validation depths relative to the training mean recurrence r̄: with r̄ = 32 these are the paper's
# 1, 4, 8, 16, 32, 64 (huginn-0125.md §5, plus 2r̄ to check extrapolation).
EVAL_DEPTH_FRACTIONS: tuple[float, ...] = (1 / 8, 1 / 4, 1 / 2, 1, 2)

# One line of help per field (CLI --help and the docs read these).
FIELD_HELP: dict[str, str] = {
    "preset": "model preset to start from",
    "model": "ModelConfig overrides on top of the preset (YAML mapping; CLI: --model-set KEY=VALUE)",
    "init_from": "start from this model directory (ours, a run directory holding model/, an official Huginn-0125 "
                 "one or an Ouro one): its config, weights and tokenizer, with a fresh optimizer and schedule; preset "
                 "is ignored and only the depth settings (mean_recurrence, mean_backprop_depth) may differ from its "
                 "config",
    "teacher": "distil from this model directory (ours, a run directory holding model/, official Huginn-0125, "
               "Ouro, Parcae, or a transformers Llama/Qwen2/Qwen3/OLMo-2 one); same vocabulary and tokenizer as "
               "the student; none = no distillation (docs/post-training.md)",
    "teacher_depth": "the recurrent teacher's test depth r; none = its config's mean_recurrence",
    "distill_alpha": "distillation weight alpha: loss = (1 - alpha) CE + alpha T^2 KL(teacher || student); "
                     "0 = plain training (the teacher is never loaded)",
    "distill_temperature": "distillation temperature T (both distributions softened by it)",
    "distill_top_k": "KL over the teacher's k most likely tokens, renormalised (student log-probs over the full "
                     "vocabulary, gathered there); 0 = the full vocabulary",
    "distill_cache": "directory of cached teacher top-k logits (fp16 values + int16/int32 indices) over the "
                     "training shards; written there first when it holds none, or again when its teacher, "
                     "depth or batch size differs; a cache of other rows (other data or --seed) is an error: "
                     "one directory per seed; none = teacher on the fly",
    "distill_cache_only": "write distill_cache from the teacher over the training shards and exit",
    "data": "corpus (the CLI shows cli/tokenizer.DATA_HELP; docs/data.md)",
    "text_field": "field or column of each document's text (the CLI shows cli/tokenizer.TEXT_FIELD_HELP)",
    "follow_symlinks": "read corpus files and directories that are symlinks out of the data directory (else refused)",
    "tokenizer": "tokenizer directory; none = train one on the data (its size sets the model's vocab)",
    "vocab_size": "vocabulary of a tokenizer trained here; none = the preset's (at least 512)",
    "tokenizer_max_bytes": "train the tokenizer on at most this many bytes of training text",
    "val_fraction": "share of documents held out for validation",
    "keep_all": "pack every token, instead of the paper's rule (a row that fills drops the rest of its document: "
                "on corpora of long files it keeps a few per cent of the tokens; the run says how many each keeps)",
    "data_dir": "where token shards are cached; none = <out>/data",
    "seq_len": "tokens per training row; none = the model's max_seq_len",
    "batch_size": "sequences per micro-batch (per rank)",
    "grad_accum": "micro-batches per optimizer step",
    "max_steps": "stop after this many optimizer steps",
    "max_tokens": "stop after this many training tokens (all ranks)",
    "max_minutes": "minutes of wall time for the run: training, the final checkpoint and model, and the final "
                   "evaluation (cut to fit) all end inside them; tokenizer training and data packing are not counted",
    "optim": "optimizer recipe (YAML mapping of OptimConfig fields, 'preset' picks the base recipe: demo, "
             "demo-muon, k2-muon (Kimi K2's Muon), finetune, finetune-lora, "
             "or huginn-0125 = the official launch config, whose cool-down the paper's "
             "constant-rate run never had); naming neither a preset nor an lr, a run from init_from gets "
             "finetune (finetune-lora training a LoRA adapter), any other demo",
    "depth_scheme": f"depth sampler per micro-batch: one of {', '.join(SCHEMES)}",
    "mean_recurrence": "sampler's mean depth r̄; none = the model's mean_recurrence",
    "backprop_depth": "gradient steps k (truncated backprop); none = the model's mean_backprop_depth",
    "depth_sigma": "log-normal spread of the paper's sampler",
    "max_depth": "cap on a sampled depth (bounds the long tail's cost) and the depth ceiling of mean_recurrence, "
                 "backprop_depth and eval_depths; none = no cap on samples, ceiling MAX_NUM_STEPS (1024)",
    "depth_curriculum": "share of the run (0..1) over which the mean depth ramps up linearly from "
                        "depth_curriculum_start to r̄ (needs max_steps or max_tokens); 0 = no curriculum",
    "depth_curriculum_start": "the curriculum's first mean depth",
    "depth_per_rank": "each data-parallel rank draws its own depth (seeded by seed, micro-batch, rank) instead "
                      "of one locked-step depth for all ranks",
    "qk_clip": "QK-clip threshold tau: after each optimizer step, rescale W_q/W_k of every attention head whose "
               "max logit in the step (all recurrence steps, all ranks) exceeds tau; none = off",
    "record_max_logit": "record each step's max attention logit in metrics.jsonl (on whenever qk_clip is set)",
    "baseline": "non-recurrent baseline: the same model run with one core pass every step (its saved config "
                "says depth 1; refused beside mean_recurrence or backprop_depth)",
    "dtype": "compute dtype: float32, or bfloat16 autocast (weights and optimizer stay float32)",
    "compile": "torch.compile the core block (not the loop: one graph serves every depth)",
    "compile_mode": f"torch.compile mode with compile: one of {', '.join(COMPILE_MODES)}",
    "activation_checkpointing": "recompute each core iteration in backward (less memory, ~25% slower)",
    "accel": "apply recurrent_depth.accel's conversions to the model where they help (the fp32 RMSNorm "
             "backward; bf16 products on CPUs that emulate bf16); --no-accel or RDEPTH_NO_ACCEL=1 trains the plain "
             "model",
    "keep_freed_memory": "on CPU with glibc, keep freed memory in the process between steps instead of "
                         "page-faulting it in again every step (up to 1.2x faster here; memory stays at its peak)",
    "fsdp": "shard parameters with FSDP2 (fully_shard) instead of replicating them with DDP",
    "eval_depths": "validation depths; none = 1 and r̄ times 1/8, 1/4, 1/2, 1, 2 (the paper's 1..64 at r̄=32)",
    "eval_interval": "validate every N optimizer steps (0 = only at the end)",
    "eval_batches": "validation batches per evaluation, in all ranks together (a fixed token budget)",
    "save_every": "checkpoint every N optimizer steps (0 = only at the end)",
    "keep_last": "checkpoints to keep (counting the one being written: on a full disk the oldest goes first)",
    "max_skipped_fraction": "fail the run (exit 1) when more than this share of its optimizer steps was skipped "
                            "for a non-finite gradient",
    "seed": "seed for weights, data order, depth draws and initial states",
    "out": "output directory (metrics.jsonl, run.json, checkpoints/, model/); one run at a time (a second one "
           "started on it meanwhile is refused: <out>/.rdepth.lock); none (API or YAML only) writes "
           "nothing: the run's results are only what Trainer.run returns",
    "resume": "continue from the newest checkpoint in <out>/checkpoints (none: start from scratch; a directory "
              "holding a finished run's model/ and no checkpoint is refused, with or without --resume)",
    "progress": "show a progress bar (only on a terminal)",
    "tensorboard": "also write TensorBoard events to <out>/tensorboard (if tensorboard is installed)",
}

# What a setting needs to be read: (test on the config, True where it is read; the rest of the warning, a
# str.format template of the config `c`, said when it is not).
Need = tuple[Callable[["TrainConfig"], bool], str]
_FROM_SCRATCH: Need = (lambda c: c.init_from is None,
                       "has no effect with init_from (the model directory's config and tokenizer are used)")
_HAS_TEACHER: Need = (lambda c: c.teacher is not None, "has no effect without a teacher (no distillation)")
_DISTILS: Need = (lambda c: c.distill_alpha > 0 or c.distill_cache_only,
                  "has no effect with distill_alpha=0 (plain training: the teacher is never loaded)")
_RECURRENT: Need = (lambda c: not c.baseline, "has no effect with baseline (one core pass every step)")
_LOGNORMAL: Need = (lambda c: c.depth_scheme == "poisson-lognormal",
                    "has no effect with depth_scheme={c.depth_scheme!r} (only 'poisson-lognormal' draws log-normally)")
_ELLIS_ADAM: Need = (lambda c: c.optim.name == "ellis-adam",
                     "has no effect with optim.name={c.optim.name!r} (a switch of 'ellis-adam', HuginnAdam)")
_MUON: Need = (lambda c: c.optim.name == "muon", "has no effect with optim.name={c.optim.name!r} (a 'muon' setting)")

# Settings read only beside another setting (an "optim." name is an OptimConfig field), each with what it needs,
# in order. A TrainConfig warns once (`UnusedSettingWarning`, one line) for each one whose first unmet need makes
# it unread, when it holds another value than its default: a TrainConfig field's dataclass default, an optim
# field's value in the preset its recipe was built on (`recipe_base`), so a preset's own values never warn (nor
# those of a recipe a checkpoint recorded, when a run resumes on it). A combination that would change a run's
# meaning silently is an error in `validate` instead (distill_cache without a teacher, depth_per_rank with fsdp,
# a depth beside baseline).
SETTING_NEEDS: dict[str, tuple[Need, ...]] = {
    "preset": (_FROM_SCRATCH,),
    # (not vocab_size or tokenizer_max_bytes beside a tokenizer: `rdepth sweep` trains one shared tokenizer from
    # them and names it in each run's config; vocab_size beside init_from is checked against the directory's)
    "tokenizer_max_bytes": (_FROM_SCRATCH,),
    "teacher": (_DISTILS,),
    "distill_alpha": (_HAS_TEACHER,),
    **{name: (_HAS_TEACHER, _DISTILS) for name in ("teacher_depth", "distill_temperature", "distill_top_k",
                                                   "distill_cache")},
    "depth_scheme": (_RECURRENT,),
    "depth_sigma": (_RECURRENT, _LOGNORMAL),
    "depth_curriculum": (_RECURRENT,),
    "depth_curriculum_start": (_RECURRENT, (lambda c: c.depth_curriculum > 0,
                                            "has no effect without depth_curriculum (0: no curriculum)")),
    "depth_per_rank": (_RECURRENT, (lambda c: c.depth_scheme != "fixed",
                                    "has no effect with depth_scheme='fixed' (every rank draws the same depth)")),
    "compile_mode": ((lambda c: c.compile, "has no effect without compile"),),
    **{f"optim.{name}": (_ELLIS_ADAM,) for name in ("atan2", "update_clipping", "running_init")},
    "optim.bias_correction": (_ELLIS_ADAM, (lambda c: c.optim.atan2 or c.optim.bias_correction == "none",
                                            "has no effect without optim.atan2 ('outside' and 'inside' are then "
                                            "the same Adam update)")),
    "optim.fully_decoupled_wd": (_ELLIS_ADAM, (lambda c: c.optim.weight_decay > 0,
                                               "has no effect with optim.weight_decay=0")),
    "optim.eps": ((lambda c: c.optim.name != "ellis-adam" or not c.optim.atan2 or c.optim.update_clipping,
                   "has no effect with optim.atan2 and without optim.update_clipping (atan2 needs no epsilon)"),),
    **{f"optim.{name}": (_MUON,) for name in ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps",
                                              "muon_weight_decay", "muon_adjust_lr", "muon_ns_dtype",
                                              "muon_split_fused")},
    "optim.min_lr": ((lambda c: bool(c.optim.cooldown_steps or c.optim.cooldown_fraction),
                      "has no effect without a cool-down (optim.cooldown_steps or optim.cooldown_fraction)"),),
    "optim.warmup_steps": ((lambda c: c.max_steps is None or c.optim.warmup_steps <= c.max_steps,
                            "is longer than the run (max_steps={c.max_steps}): the learning rate never reaches "
                            "optim.lr={c.optim.lr!r}"),),
}


class UnusedSettingWarning(UserWarning):
    """A training setting given a value the run never reads (`SETTING_NEEDS`); `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


# Set while `TrainConfig.replace` builds a config: it warns only what the derived config adds.
_DERIVING: ContextVar[bool] = ContextVar("train_config_deriving", default=False)


@dataclass
class TrainConfig:
    """A training run. See FIELD_HELP for what each field means; `validate` says what is allowed."""

    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    teacher: str | None = None
    teacher_depth: int | None = None
    distill_alpha: float = 0.5
    distill_temperature: float = 1.0
    distill_top_k: int = 0
    distill_cache: str | None = None
    distill_cache_only: bool = False
    data: str = "stdlib"
    text_field: str = "text"
    follow_symlinks: bool = False
    tokenizer: str | None = None
    vocab_size: int | None = None
    tokenizer_max_bytes: int | None = None
    val_fraction: float = 0.02
    keep_all: bool = False
    data_dir: str | None = None
    seq_len: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = 1000
    max_tokens: int | None = None
    max_minutes: float | None = None
    # An OptimConfig, or a mapping of its fields (+ `preset`), which __post_init__ turns into one; the default,
    # an empty mapping, is the run's default recipe (`default_optim_preset`).
    optim: OptimConfig | dict[str, Any] = field(default_factory=dict)
    depth_scheme: str = "poisson-lognormal"
    mean_recurrence: float | None = None
    backprop_depth: int | None = None
    depth_sigma: float = 0.5
    max_depth: int | None = None
    depth_curriculum: float = 0.0
    depth_curriculum_start: float = 1.0
    depth_per_rank: bool = False
    qk_clip: float | None = None
    record_max_logit: bool = False
    baseline: bool = False
    dtype: str = "float32"
    compile: bool = False
    compile_mode: str = "default"
    activation_checkpointing: bool = False
    keep_freed_memory: bool = True
    accel: bool = True
    fsdp: bool = False
    eval_depths: list[int] | None = None
    eval_interval: int = 0
    eval_batches: int = 8
    save_every: int = 0
    keep_last: int = 3
    max_skipped_fraction: float = 0.5
    seed: int = 0
    out: str | None = "runs/train"
    resume: bool = False
    progress: bool = True
    tensorboard: bool = True

    def __post_init__(self) -> None:
        # (the optim settings of a run that named no preset and no lr, and whether for LoRA; None: it named one)
        self._optim_default: tuple[dict[str, Any], bool] | None = None
        # (the recipe `optim` was built on: its values are not the user's, so they never warn as unused)
        if isinstance(self.optim, dict):
            self._choose_optim(self.optim, lora=False)
        elif isinstance(self.optim, OptimConfig):
            self._optim_base = recipe_base(self.optim)
        if isinstance(self.dtype, str) and self.dtype in DTYPE_ALIASES:
            self.dtype = DTYPE_ALIASES[self.dtype]
        if isinstance(self.eval_depths, tuple):
            self.eval_depths = list(self.eval_depths)
        self.validate()
        if not _DERIVING.get():
            self._warn_unused(stacklevel=3)  # (the line that built the config: past __post_init__ and __init__)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise a ValueError naming the field, the value and what is allowed."""

        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: expected {expected}")

        def need_int(name: str, low: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not is_int(value) or value < low:
                raise bad(name, f"{'None or ' if optional else ''}an integer >= {low}")

        if not isinstance(self.preset, str) or self.preset not in PRESETS:  # (a list or mapping is unhashable)
            raise bad("preset", f"one of {sorted(PRESETS)}")
        # (before the model overrides, which read seq_len as the context it needs)
        for name in ("vocab_size", "tokenizer_max_bytes", "seq_len", "max_tokens", "backprop_depth", "max_depth"):
            need_int(name, 1, optional=True)
        if self.seq_len is not None and self.seq_len > MAX_SEQ_LEN:
            raise bad("seq_len", f"None or an integer in [1, {MAX_SEQ_LEN}] (MAX_SEQ_LEN)")
        if not isinstance(self.model, dict):
            raise bad("model", "a mapping of ModelConfig overrides")
        check_field_names(self.model, ModelConfig, "ModelConfig key(s) in TrainConfig.model", listed_as="known")
        self._validate_model_overrides()
        if not isinstance(self.data, str) or not self.data:
            raise bad("data", "'stdlib', a directory, or a .jsonl or .parquet file")
        # (read as paths and a field name only once the run sets up: a number there failed after the checks)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise bad("text_field", "the name of the documents' text field (a non-empty string)")
        for name in ("tokenizer", "data_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "None or a directory path")
        need_int("max_steps", 0, optional=True)  # 0: save the starting weights as they are (--init-from)
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise bad("init_from", "None or a model directory path")
        self._validate_distillation()
        for name in ("batch_size", "grad_accum", "eval_batches", "keep_last"):
            need_int(name, 1)
        for name in ("eval_interval", "save_every", "seed"):
            need_int(name, 0)
        if self.seed >= 2**63:  # (torch's generators overflowed at 2**64, after the tokenizer and shards were built)
            raise bad("seed", "an integer in [0, 2**63)")
        if not is_real(self.val_fraction) or not 0 < self.val_fraction < 1:
            raise bad("val_fraction", "a number in (0, 1): validation needs held-out documents")
        if not is_real(self.max_skipped_fraction) or not 0 <= self.max_skipped_fraction <= 1:
            raise bad("max_skipped_fraction", "a number in [0, 1]")
        if self.max_minutes is not None and (not is_real(self.max_minutes) or self.max_minutes <= 0):
            raise bad("max_minutes", "None or a number > 0")
        if self.max_steps is None and self.max_tokens is None and self.max_minutes is None:
            raise ValueError("TrainConfig needs a budget: set max_steps, max_tokens or max_minutes (or several)")
        if not isinstance(self.optim, OptimConfig):
            raise bad("optim", "an OptimConfig or a mapping of its fields")
        if self.depth_scheme not in SCHEMES:
            raise bad("depth_scheme", f"one of {SCHEMES}")
        if self.mean_recurrence is not None and (not is_real(self.mean_recurrence) or self.mean_recurrence < 1):
            raise bad("mean_recurrence", "None or a number >= 1")
        if (self.depth_scheme in ("fixed", "uniform") and self.mean_recurrence is not None
                and float(self.mean_recurrence) != int(self.mean_recurrence)):
            raise bad("mean_recurrence", f"an integer for depth_scheme {self.depth_scheme!r}")
        if not is_real(self.depth_curriculum) or not 0 <= self.depth_curriculum <= 1:
            raise bad("depth_curriculum", "a share of the run in [0, 1] (0 = no curriculum)")
        if self.depth_curriculum and self.max_steps is None and self.max_tokens is None:
            raise bad("depth_curriculum", "0 when the run has only a time budget (set max_steps or max_tokens)")
        if not is_real(self.depth_curriculum_start) or self.depth_curriculum_start < 1:
            raise bad("depth_curriculum_start", "a number >= 1")
        if self.qk_clip is not None and (not is_real(self.qk_clip) or self.qk_clip <= 0):
            raise bad("qk_clip", "None or a number > 0 (the max-logit threshold tau)")
        if not is_real(self.depth_sigma) or self.depth_sigma < 0:
            raise bad("depth_sigma", "a number >= 0")
        ceiling = self.max_depth if self.max_depth is not None else MAX_NUM_STEPS
        depth_hint = "(the depth ceiling: max_depth, else MAX_NUM_STEPS; raise it with --max-depth)"
        if self.mean_recurrence is not None and self.mean_recurrence > ceiling:
            raise bad("mean_recurrence", f"at most {ceiling} {depth_hint}")
        if self.backprop_depth is not None and self.backprop_depth > ceiling:
            raise bad("backprop_depth", f"at most {ceiling} {depth_hint}")
        if self.baseline is True:  # (one core pass every step: a depth named beside it was silently not trained)
            depths = [f"{name}={getattr(self, name)!r}" for name in ("mean_recurrence", "backprop_depth")
                      if getattr(self, name) is not None]
            if self.init_from is None:  # (the model config the baseline saves says depth 1, unless overridden)
                depths += [f"model.{name}={self.model[name]!r}" for name in ("mean_recurrence", "mean_backprop_depth")
                           if self.model.get(name, 1) != 1]
            if depths:
                raise bad("baseline", f"false with {', '.join(depths)}: a baseline runs one core pass every step "
                          "(and saves depth 1 in its config); drop one of them")
        if self.compile_mode not in COMPILE_MODES:
            raise bad("compile_mode", f"one of {COMPILE_MODES}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {DTYPES} (or fp32 / bf16)")
        depths = self.eval_depths
        if depths is not None and (not isinstance(depths, list) or not depths
                                   or not all(is_int(d) and d >= 0 for d in depths)):
            raise bad("eval_depths", "None or a non-empty list of integers >= 0")
        if depths is not None and max(depths) > ceiling:
            raise bad("eval_depths", f"depths of at most {ceiling} {depth_hint}")
        for name in ("follow_symlinks", "keep_all", "depth_per_rank", "record_max_logit", "baseline", "compile",
                     "activation_checkpointing", "keep_freed_memory", "accel", "fsdp", "resume", "progress",
                     "tensorboard"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if self.fsdp and self.depth_per_rank:  # (each rank would wait at a gather the others never reach: a hang)
            raise bad("depth_per_rank", "false with fsdp: FSDP2 gathers the core block's weights at every recurrence "
                      "step, so all ranks must run the same depth (DDP accepts a depth per rank)")
        if self.out is not None and (not isinstance(self.out, str) or not self.out):
            raise bad("out", "a directory path, or None to write nothing")
        if self.out is None and self.resume:
            raise bad("resume", "false when out is None (nothing is saved to resume from)")

    def _validate_distillation(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: expected {expected}")

        for name in ("teacher", "distill_cache"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "None or a directory path")
        if self.teacher_depth is not None and (not is_int(self.teacher_depth) or not
                                               1 <= self.teacher_depth <= MAX_NUM_STEPS):
            raise bad("teacher_depth", f"None or an integer in [1, {MAX_NUM_STEPS}]")
        if not is_real(self.distill_alpha) or not 0 <= self.distill_alpha <= 1:
            raise bad("distill_alpha", "a number in [0, 1]")
        if not is_real(self.distill_temperature) or self.distill_temperature <= 0:
            raise bad("distill_temperature", "a number > 0")
        if not is_int(self.distill_top_k) or self.distill_top_k < 0:
            raise bad("distill_top_k", "an integer >= 0 (0 = the full vocabulary)")
        if not isinstance(self.distill_cache_only, bool):
            raise bad("distill_cache_only", "true or false")
        if self.distill_cache is not None and not self.distill_top_k:
            raise bad("distill_top_k", "an integer >= 1 with distill_cache (the cache holds the teacher's top-k)")
        if self.distill_cache_only and (self.distill_cache is None or self.teacher is None):
            raise bad("distill_cache_only", "false unless distill_cache and teacher are set")
        if self.distill_cache is not None and self.teacher is None:
            raise bad("distill_cache", "None without a teacher (the cache belongs to one teacher)")

    def _validate_model_overrides(self) -> None:
        """Check the `model` overrides now, before a tokenizer is trained: each value's type, then the
        ModelConfig they make (token ids aside: their range depends on the tokenizer's vocabulary)."""
        hints = typing.get_type_hints(ModelConfig)
        for key, value in self.model.items():
            if not _matches_hint(value, hints[key]):
                expected = str(hints[key]).replace("typing.", "").replace("<class '", "").replace("'>", "")
                raise ValueError(f"TrainConfig.model.{key}={value!r} is invalid: expected {expected} "
                                 f"(a ModelConfig field)")
        values = {k: v for k, v in self.model.items() if k not in TOKEN_ID_FIELDS}
        if self.seq_len is not None:
            values["max_seq_len"] = max(self.seq_len, values.get("max_seq_len", PRESETS[self.preset]["max_seq_len"]))
        config = ModelConfig.from_preset(self.preset, **values)
        records_logits = self.qk_clip is not None or self.record_max_logit is True
        if (self.model or records_logits) and self.init_from is None:
            # Mixer names and options (and qk_norm / value embeddings / QK-clip on them) are checked by the
            # model's constructor and QKClip: build the model on the meta device (no memory, ~10 ms) so that
            # a typo fails now, not after the tokenizer and the shards were built.
            import torch

            from recurrent_depth.model.recurrent import RecurrentDepthLM
            from recurrent_depth.train.qk_clip import QKClip

            with warnings.catch_warnings(), torch.device("meta"):
                warnings.simplefilter("ignore")
                model = RecurrentDepthLM(config)
                if records_logits:
                    QKClip(model)

    # ------------------------------------------------------------------ the default optimizer
    def _choose_optim(self, given: dict[str, Any], lora: bool) -> None:
        """`optim` from a mapping: on its preset; naming an lr but no preset, on demo (as before the fine-tuning
        presets, so such runs resume); naming neither, on `default_optim_preset` (remembered: see `replace`)."""
        named = "preset" in given or "lr" in given
        preset = DEFAULT_OPTIM_PRESET if named else default_optim_preset(self.init_from is not None, lora)
        self.optim = optim_from_dict(given, preset)
        self._optim_base = OptimConfig.from_preset(given.get("preset", preset))
        self._optim_default = None if named else (dict(given), lora)

    @property
    def optim_default(self) -> str | None:
        """The preset this run's optimizer was chosen on for it, as it named no optimizer preset and no learning
        rate (`default_optim_preset`); None when it named one, or gave an OptimConfig."""
        if self._optim_default is None:
            return None
        return default_optim_preset(self.init_from is not None, lora=self._optim_default[1])

    def with_optim_for(self, *, lora: bool | None, resumed: OptimConfig | None = None) -> TrainConfig:
        """This config for a run that trains a LoRA adapter (`lora`) or every weight (None: as chosen so far, every
        weight unless a call said otherwise): an optimizer chosen for the run (`optim_default`) is chosen for that,
        or, given the recipe a checkpoint of the run records (`resumed`), is that recipe with the optim settings
        the run names on top; one the run named stays."""
        if self._optim_default is None:
            return self
        given, chosen_for_lora = self._optim_default
        if resumed is not None:  # (named from here on: the run goes on as it started)
            return self.replace(optim=resumed.updated(**given))
        if lora is None or chosen_for_lora == lora:
            return self
        new = self.replace()
        new._choose_optim(given, lora)
        return new

    def with_optim_preset(self, preset: str) -> TrainConfig:
        """This config with an optimizer chosen for the run (`optim_default`) built on `preset` instead, with the
        optim settings the run names on top (named from here on); one the run named stays."""
        if self._optim_default is None:
            return self
        return self.replace(optim=optim_from_dict(self._optim_default[0], preset))

    # ------------------------------------------------------------------ derived values
    def trained_depth_fields(self) -> dict[str, int]:
        """The model config fields that record the depth this run trains at, for the saved config.json (the
        default depth of `generate`, `eval`, `serve`): `mean_recurrence` (rounded: a config holds an integer) and
        `mean_backprop_depth`, from the run's depth settings where it names them. A run from scratch and one from
        --init-from both take them; a `model` setting of the field (--model-set) wins."""
        return {k: v for k, v in self.depth_settings().items() if k not in self.model}

    def depth_settings(self) -> dict[str, int]:
        """The model config depth fields this run's depth settings name (`trained_depth_fields` before a `model`
        setting of the field wins)."""
        depth: dict[str, int] = {}
        if self.mean_recurrence is not None:
            depth["mean_recurrence"] = max(1, round(self.mean_recurrence))
        if self.backprop_depth is not None:
            depth["mean_backprop_depth"] = self.backprop_depth
        return depth

    def model_config(self, vocab_size: int | None = None, **token_ids: int | None) -> ModelConfig:
        """The ModelConfig this run trains: preset + `model` overrides (+ the tokenizer's vocab and ids)."""
        values = dict(self.model)
        if vocab_size is not None:
            given = values.get("vocab_size")
            if given is not None and given != vocab_size:
                raise ValueError(
                    f"TrainConfig.model.vocab_size={given} disagrees with the tokenizer's vocabulary "
                    f"({vocab_size}); drop the override, the tokenizer sets it"
                )
            values["vocab_size"] = vocab_size
        for name, value in token_ids.items():
            values.setdefault(name, value)
        if self.seq_len is not None:
            values["max_seq_len"] = max(self.seq_len, values.get("max_seq_len", PRESETS[self.preset]["max_seq_len"]))
        return ModelConfig.from_preset(self.preset, **values)

    def curriculum_micro_steps(self, seq_len: int, world_size: int) -> int:
        """The depth curriculum's length in micro-batches (0 without one), from the step or token budget."""
        if not self.depth_curriculum:
            return 0
        budgets = [self.max_steps] if self.max_steps is not None else []
        if self.max_tokens is not None:
            budgets.append(-(-self.max_tokens // (self.batch_size * seq_len * self.grad_accum * world_size)))
        return round(self.depth_curriculum * min(budgets) * self.grad_accum)

    def resolved_seq_len(self, model_cfg: ModelConfig) -> int:
        return self.seq_len if self.seq_len is not None else model_cfg.max_seq_len

    def tokenizer_vocab_size(self) -> int:
        """Vocabulary of a tokenizer trained for this run."""
        from recurrent_depth.data import MIN_VOCAB_SIZE

        if self.vocab_size is not None:
            return self.vocab_size
        preset_vocab = int(self.model.get("vocab_size", PRESETS[self.preset]["vocab_size"]))
        return preset_vocab if preset_vocab >= MIN_VOCAB_SIZE else 512

    def resolved_eval_depths(self, mean_recurrence: float) -> list[int]:
        if self.eval_depths is not None:
            return sorted(set(self.eval_depths))
        if self.baseline:
            return [1]
        ceiling = self.max_depth if self.max_depth is not None else MAX_NUM_STEPS
        scaled = {min(ceiling, max(1, round(mean_recurrence * f))) for f in EVAL_DEPTH_FRACTIONS}
        return sorted({1} | scaled)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["model"] = dict(self.model)
        out["optim"] = self.optim.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a training config must be a mapping, got {type(data).__name__}")
        check_field_names(data, cls, "training config key(s)", listed_as="known keys")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(read_yaml(path))

    @classmethod
    def from_sources(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Defaults < YAML file < overrides. `overrides` are field values (None entries are ignored);
        `model` and `optim` overrides merge into the YAML's mappings key by key."""
        data: dict[str, Any] = read_yaml(path) if path is not None else {}
        for key, value in (overrides or {}).items():
            if value is None:
                continue
            if key in ("model", "optim") and isinstance(value, dict):
                base = data.get(key) or {}
                if not isinstance(base, dict):
                    raise ValueError(f"config key {key!r} must be a mapping, got {type(base).__name__}")
                data[key] = {**base, **value}
            else:
                data[key] = value
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with fields changed; it warns only the unused settings (`unused_settings`) that this one
        had not (a run derives configs from the user's several times: each setting warns once)."""
        token = _DERIVING.set(True)
        try:
            new = dataclasses.replace(self, **changes)
        finally:
            _DERIVING.reset(token)
        if "optim" not in changes:
            new._optim_base = self._optim_base
            if self._optim_default is not None:
                new._choose_optim(*self._optim_default)  # chosen again: init_from may have changed
        new._warn_unused(stacklevel=2, known={message for _, message in self.unused_settings()})
        return new

    # ------------------------------------------------------------------ settings that have no effect
    def unused_settings(self) -> list[tuple[str, str]]:
        """(setting, one-line message) for each setting of `SETTING_NEEDS` that holds another value than its
        default (an optim one: than the preset its recipe was built on) and that this run never reads."""
        found = []
        for name, needs in SETTING_NEEDS.items():
            if name.startswith("optim."):
                value, default = getattr(self.optim, name[6:]), getattr(self._optim_base, name[6:])
            else:
                value, default = getattr(self, name), _FIELD_DEFAULTS[name]
            if value == default:
                continue
            why = next((why for test, why in needs if not test(self)), None)
            if why is not None:
                found.append((name, f"TrainConfig.{name}={value!r} {why.format(c=self)}"))
        return found

    def _warn_unused(self, stacklevel: int, known: Collection[str] = ()) -> None:
        """An `UnusedSettingWarning` for each of `unused_settings` not in `known` (messages), from rank 0 only:
        under torchrun every rank builds the same config, and one line says it for all. `stacklevel` as
        `warnings.warn`'s, counted from the caller (1: the caller's line)."""
        if os.environ.get("RANK", "0") != "0":
            return
        for name, message in self.unused_settings():
            if message not in known:
                warnings.warn(UnusedSettingWarning(name, message), stacklevel=stacklevel + 1)


# The TrainConfig fields' defaults (what `unused_settings` compares with).
_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}


def default_optim_preset(from_model: bool, lora: bool = False) -> str:
    """The optimizer preset of a run that names no preset and no learning rate: "demo" (tuned for tiny models
    trained from scratch) for a run from scratch, "finetune" for one from a trained model (a model directory, or
    the model `rdepth rl` hands over), "finetune-lora" for a LoRA adapter on one."""
    if not from_model:
        return DEFAULT_OPTIM_PRESET
    return FINETUNE_LORA_OPTIM_PRESET if lora else FINETUNE_OPTIM_PRESET


def recipe_base(optim: OptimConfig) -> OptimConfig:
    """The preset `optim` was built on, known by its description (`OptimConfig.from_preset` and `updated` keep
    it, and a checkpoint records it); a recipe of its own description: the class defaults."""
    return next((p for p in OPTIM_PRESETS.values() if optim.description and p.description == optim.description),
                OptimConfig())


def optim_from_dict(data: dict[str, Any], default_preset: str = DEFAULT_OPTIM_PRESET) -> OptimConfig:
    """An OptimConfig from a mapping; its optional `preset` key (default `default_preset`) gives the base recipe."""
    values = dict(data)
    preset = values.pop("preset", default_preset)
    if "betas" in values and isinstance(values["betas"], list):
        values["betas"] = tuple(values["betas"])
    check_field_names(values, OptimConfig, "optim key(s)", listed_as="known", extra=("preset",))
    return OptimConfig.from_preset(preset, **values)  # (one cool-down length given replaces the preset's other)


# YAML 1.1 (PyYAML) reads `3e-3` as a string (its floats need a dot: `3.0e-3`); YAML 1.2 and people
# read it as a number, so the loader also resolves exponent forms without a dot as floats.
_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789"))
    return Loader


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that `1e-4` (no dot) is a float, as in YAML 1.2."""
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        raise ValueError("YAML nested too deeply to parse") from None
    _check_expanded_size(data)
    return data


YAML_MAX_VALUES = 1_000_000


def _check_expanded_size(data: Any) -> None:
    """A ValueError when `data`, its aliases expanded, holds more than `YAML_MAX_VALUES` values: a YAML
    alias is one shared object, so ten nested aliases of nine (a 600-byte "billion laughs" file) made a
    config of 3.5 billion values that the first repr or deep copy of it never finished. Counted once
    per shared object; an alias of itself (a cycle) counts once and is left to the field checks."""
    sizes: dict[int, int] = {}

    def size(value: Any) -> int:
        if not isinstance(value, dict | list):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        sizes[key] = 1  # (a cycle meets this while counting)
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += size(child)
            if total > YAML_MAX_VALUES:
                raise ValueError(f"YAML holds more than {YAML_MAX_VALUES:,} values once its aliases (*name) "
                                 "are expanded")
        sizes[key] = total
        return total

    try:
        size(data)
    except RecursionError:
        raise ValueError("YAML nested too deeply to parse") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"training config {str(p)!r} is a directory, not a YAML file")
    text = read_text(p, CONFIG_MAX_BYTES, "training config")  # a regular file of bounded size
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        # one line (PyYAML's message spans several), as `rdepth sweep` reports it
        raise ValueError(f"training config {str(p)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    except ValueError as exc:
        raise ValueError(f"training config {str(p)!r}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"training config {str(p)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def _matches_hint(value: Any, hint: Any) -> bool:
    """Whether a config value fits a ModelConfig annotation (int, float, bool, str, dict, unions, None)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches_hint(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_real(value)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or typing.get_origin(hint) is dict:
        return isinstance(value, dict)
    if typing.get_origin(hint) is list:  # (each item too: the token ids are not checked on a ModelConfig here)
        return isinstance(value, list | tuple) and all(_matches_hint(item, typing.get_args(hint)[0]) for item in value)
    return True


"""`rdepth train`: train any preset from a YAML config and/or flat flags (flags win).

    rdepth train --preset tiny --data stdlib --max-steps 200 --save-every 50 --out runs/tiny
    rdepth train --config examples/train_small.yaml --max-minutes 30 --resume
    torchrun --standalone --nproc_per_node=2 -m recurrent_depth.cli train --config ...   # DDP

Every TrainConfig field has a flag (`--max-steps`, `--eval-depths 1,4,8`, `--compile/--no-compile`);
`--model-set KEY=VALUE` overrides a ModelConfig field, and the optimizer flags override `optim`.

    rdepth train --lora --init-from runs/tiny/model --lora-parts core --data more.txt --out runs/tiny-lora

`--lora` trains a peft LoRA adapter on a saved model (`--init-from`, whose config and tokenizer the run
takes) instead of every weight (docs/post-training.md); `--weights int8` / `int4` trains it on the model's
quantized, frozen weights (QLoRA).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

# optimizer flag -> OptimConfig field
OPTIM_FLAGS: dict[str, tuple[str, type, str]] = {
    "optim_preset": ("preset", str, "optimizer recipe to start from: demo, demo-muon, k2-muon, finetune, "
                     "finetune-lora or huginn-0125 (the official launch config: the paper's lr 4e-5 with the "
                     "config's cool-down; the paper ran at a constant rate)"),
    "optimizer": ("name", str, "adamw, ellis-adam (the paper's Adam) or muon (+ AdamW for embeddings and norms)"),
    "lr": ("lr", float, "peak learning rate (AdamW / ellis-adam groups)"),
    "muon_lr": ("muon_lr", float, "Muon's learning rate for the block and adapter matrices"),
    "muon_ns_dtype": ("muon_ns_dtype", str, "Muon's Newton-Schulz dtype: auto (float32 on CPUs without native bf16), "
                      "bfloat16 (torch.optim.Muon's) or float32"),
    "weight_decay": ("weight_decay", float, "weight decay (not on norms and biases)"),
    "warmup_steps": ("warmup_steps", int, "linear warmup steps"),
    "cooldown_fraction": ("cooldown_fraction", float, "share of the run spent in the final linear cool-down"),
    "grad_clip": ("grad_clip", float, "gradient-norm clip"),
}
SKIPPED_FIELDS = ("model", "optim")
METAVARS = {"qk_clip": "TAU", "init_from": "DIR"}


def _field_type(hint: Any) -> tuple[type, bool]:
    """(base type, is_list) from a TrainConfig annotation like `int | None` or `list[int] | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    base = args[0]
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], True
    return base, False


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,8, got {text!r}") from exc


def _model_set(text: str) -> tuple[str, Any]:
    import yaml

    from recurrent_depth.train.config import load_yaml

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. hidden_size=128), got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), load_yaml(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"the value of {text!r} is not valid YAML: "
                                         f"{' '.join(str(exc).split())}") from None  # one line


def _default_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a recurrent-depth model (YAML config + flat flags; torchrun for several processes)",
        description="Train with the paper's recipe: sampled depth per micro-batch, truncated backprop, "
                    "validation at several depths, atomic checkpoints, exact --resume.",
    )
    from recurrent_depth.cli.tokenizer import DATA_HELP, TEXT_FIELD_HELP

    add_config_flags(parser, help_overrides={"data": DATA_HELP, "text_field": TEXT_FIELD_HELP})
    parser.set_defaults(func=run)


def add_config_flags(parser: argparse.ArgumentParser, skipped: tuple[str, ...] = (),
                     help_overrides: dict[str, str] | None = None) -> None:
    """--config, a flag per TrainConfig field (but `skipped`), --model-set, the optimizer flags, --print-config."""
    from recurrent_depth.train.config import FIELD_HELP, TrainConfig
    from recurrent_depth.train.optim import OptimConfig

    parser.add_argument("--config", metavar="FILE.yaml", help="training config file; flags below override it "
                        "(default: none, the defaults shown)")
    hints = typing.get_type_hints(TrainConfig)
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in SKIPPED_FIELDS or f.name in skipped:
            continue
        flag = "--" + f.name.replace("_", "-")
        base, is_list = _field_type(hints[f.name])
        default = getattr(defaults, f.name) if f.default is not MISSING or f.default_factory is not MISSING else None
        text = (help_overrides or {}).get(f.name, FIELD_HELP[f.name])
        # argparse %-formats help strings: a literal % (e.g. "~25% slower") must be doubled
        help_text = f"{text} (default: {_default_text(default)})".replace("%", "%%")
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif is_list:
            parser.add_argument(flag, type=_int_list, default=None, metavar="N,N,...", help=help_text)
        else:
            metavar = METAVARS.get(f.name, f.name.upper().split("_")[-1])
            parser.add_argument(flag, type=base, default=None, metavar=metavar, help=help_text)
    parser.add_argument("--model-set", action="append", type=_model_set, default=[], metavar="KEY=VALUE",
                        help="override a ModelConfig field, e.g. --model-set hidden_size=128 (repeatable; "
                             "default: the preset's values)")
    # (a run from scratch's defaults, then those of one from --init-from that names no preset and no --lr)
    presets = ("demo", "finetune", "finetune-lora")
    for dest, (name, kind, text) in OPTIM_FLAGS.items():
        demo, tuned, lora = (presets if name == "preset" else
                             [_default_text(getattr(OptimConfig.from_preset(p), name)) for p in presets])
        shown = demo if tuned == demo else f"{demo}; from --init-from {tuned}"
        shown += f", with --lora {lora}" if lora != tuned else ""
        parser.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, default=None,
                            help=f"{text} (default: {shown})")
    from recurrent_depth.train.lora import add_lora_arguments

    add_lora_arguments(parser)  # (the adapter is trained on --init-from DIR)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as JSON and exit (default: off)")


def config_from_args(args: argparse.Namespace):
    """The TrainConfig from --config and the flags (flags win)."""
    from recurrent_depth.train.config import TrainConfig

    overrides: dict[str, Any] = {}
    for f in fields(TrainConfig):
        if f.name in ("model", "optim"):
            continue
        value = getattr(args, f.name, None)
        if value is not None:
            overrides[f.name] = value
    if args.model_set:
        overrides["model"] = dict(args.model_set)
    optim = {name: getattr(args, dest) for dest, (name, _, _) in OPTIM_FLAGS.items() if getattr(args, dest) is not None}
    if optim:
        overrides["optim"] = optim
    return TrainConfig.from_sources(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.train.lora import lora_spec_from_args

    cfg = config_from_args(args)
    if args.print_config:
        from recurrent_depth.train.init_from import resolved_config

        # (--init-from: DIR's model config, tokenizer and seq_len, what the run records, as `rdepth sft` prints)
        print(json.dumps(resolved_config(cfg, lora=args.lora).to_dict(), indent=2))
        return 0
    from recurrent_depth.train.trainer import Trainer, check_out_state

    if cfg.distill_cache_only:  # the Trainer's setup writes the cache; nothing is trained
        trainer = Trainer(cfg)
        if trainer.env.is_main:  # (once under torchrun)
            print(f"distill cache: {cfg.distill_cache}")
        trainer.close()  # (leaves the process group if the Trainer joined it: not a caller's)
        return 0
    spec = lora_spec_from_args(args)
    if spec is None:
        return run_trainer(Trainer(cfg), "train")
    from recurrent_depth.train.init_from import load_for_training, resolved_config
    from recurrent_depth.train.lora import add_lora

    if cfg.init_from is None:
        raise ValueError("--lora needs --init-from DIR: the saved model the adapter is trained on")
    cfg = resolved_config(cfg, lora=True)  # DIR's config and tokenizer (not one trained on the new data)
    if cfg.out is not None:  # (a wrong --out named before the model loads, not after)
        check_out_state(cfg.out, cfg.resume)
    start = load_for_training(cfg, "cpu")  # (the Trainer moves it)
    model = add_lora(start.model, spec, base_dir=start.model_dir, seed=cfg.seed)
    # (the adapter in DIR's stored dtype, as `sft --lora` writes it and model/ is written without --lora)
    return run_trainer(Trainer(cfg, model=model, save_dtype=start.dtype), "train")


def run_trainer(trainer, command: str) -> int:
    """Run a set-up Trainer; print the final depth table and the model directory (rank 0)."""
    from recurrent_depth.train.trainer import TooManySkippedSteps

    try:
        result = trainer.run()
    except TooManySkippedSteps as exc:  # the run ended and wrote everything, but did not train
        if trainer.env.is_main:
            print(f"rdepth {command}: error: {exc}", file=sys.stderr)
        return 1
    finally:  # (the DDP wrapper freed, then the process group left if the Trainer joined it: not a caller's)
        trainer.close()
    if trainer.env.is_main and result.final_eval is not None:
        from recurrent_depth.train.report import format_depth_table

        print(format_depth_table({str(d): v for d, v in result.final_eval.loss.items()}))
        print(f"model: {result.model_dir}")
    return 0

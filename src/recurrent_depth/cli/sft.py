"""`rdepth sft`: supervised fine-tuning of a model directory on chat or prompt/completion examples.

    rdepth sft --init-from runs/tiny --data chats.jsonl --seq-len 256 --max-steps 200 --out runs/tiny-sft
    rdepth sft --init-from huginn-0125/ --data train.parquet --val-data val.jsonl --optimizer adamw \\
        --lr 5e-7 --weight-decay 0 --depth-scheme fixed --mean-recurrence 16 --out runs/huginn-sft

The `rdepth train` flags that apply (optimizer, schedule, depth, budget, evaluation, checkpoints,
--resume) mean the same here; see docs/post-training.md for the data formats and the masking rule.
"""

from __future__ import annotations

import argparse
import json

# TrainConfig fields of pretraining data and tokenizer training, which SFT does not use
SKIPPED_FIELDS = ("preset", "text_field", "follow_symlinks", "tokenizer", "vocab_size", "tokenizer_max_bytes",
                  "keep_all", "data_dir", "baseline", "distill_cache",
                  "distill_cache_only")
HELP = {
    "init_from": "the model to fine-tune (required): a model directory, a run directory holding model/, or an "
                 "official Huginn-0125 or Ouro directory; its config, weights, tokenizer and chat template are used",
    "data": "the examples: .jsonl of {\"messages\": [...]} chats or {\"prompt\", \"completion\"} pairs, or a "
            "local datasets file (.parquet, .json, .csv, .arrow, a save_to_disk directory)",
    "val_fraction": "share of the examples held out for the held-out loss (unless --val-data is given)",
    "seq_len": "positions per row (examples are cut to seq_len + 1 tokens); none = the model's max_seq_len",
    "eval_batches": "held-out batches per evaluation",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from recurrent_depth.cli.train import add_config_flags

    parser = subparsers.add_parser(
        "sft",
        help="fine-tune a model directory on chat or prompt/completion examples (loss on the answers only)",
        description="Supervised fine-tuning: chats rendered with the model's chat template, loss on assistant "
                    "(completion) tokens only, examples packed without attending across them, the randomized-"
                    "depth objective (or --depth-scheme fixed), held-out loss by depth, exact --resume.",
    )
    add_config_flags(parser, skipped=SKIPPED_FIELDS, help_overrides=HELP)
    parser.add_argument("--val-data", metavar="FILE", default=None,
                        help="held-out examples in the formats of --data (default: none, --val-fraction of --data)")
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                        help="pack several examples per row with a block-diagonal causal mask and positions "
                             "restarting per example; --no-packing puts one example per row (needed for mixers "
                             "other than softmax attention) (default: on)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.cli.train import config_from_args, run_trainer
    from recurrent_depth.train.init_from import resolved_config
    from recurrent_depth.train.lora import lora_spec_from_args
    from recurrent_depth.train.sft import SFTOptions, sft_trainer

    if args.data is None and args.config is None:
        raise ValueError("--data FILE is required: the examples to fine-tune on")
    cfg = config_from_args(args)
    from recurrent_depth.train.config import read_yaml

    in_file = read_yaml(args.config) if args.config is not None else {}  # (config_from_args read it: a mapping)
    ignored = [name for name in SKIPPED_FIELDS if name in in_file]
    if ignored:  # (there is no flag for them; from a file they were silently ignored)
        raise ValueError(f"{', '.join(ignored)} in --config {args.config}: pretraining settings that rdepth sft does "
                         "not use (it reads --data's examples with the --init-from model's tokenizer); remove them")
    if args.val_data is not None:  # (nothing of --data would be held out: a val_fraction set anywhere is refused)
        where = ("--val-fraction" if args.val_fraction is not None else
                 f"val_fraction in --config {args.config}" if "val_fraction" in in_file else None)
        if where is not None:
            raise ValueError(f"{where} and --val-data: the held-out examples are --val-data's, so no share of "
                             "--data is held out; drop one of them")
    if cfg.init_from is None:
        raise ValueError("--init-from DIR is required: the model directory to fine-tune")
    if args.print_config:
        print(json.dumps(resolved_config(cfg, lora=args.lora).to_dict(), indent=2))
        return 0
    from recurrent_depth.data.chat import check_records_path
    from recurrent_depth.train.trainer import check_out_state

    # (named before the model loads and --data's examples are tokenized, not after)
    for flag, path in (("--data", cfg.data), ("--val-data", args.val_data)):
        if path is not None:
            check_records_path(path, flag)
    if cfg.out is not None:
        check_out_state(cfg.out, cfg.resume)
    options = SFTOptions(val_data=args.val_data, packing=args.packing, lora=lora_spec_from_args(args))
    return run_trainer(sft_trainer(cfg, options), "sft")

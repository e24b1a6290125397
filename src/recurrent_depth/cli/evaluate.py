"""`rdepth eval`: quality against test-time depth (held-out text, reasoning tasks, lm-eval tasks).

    rdepth eval --model runs/quickstart/model --depths 1,2,4,8,16,32
    rdepth eval --model runs/chains/model --data none --reasoning chains --difficulties 1,2,4,6,8,10,12
    rdepth eval --model DIR --data none --lm-eval-tasks rd_chains_mc --fewshot 0,1,4 --baseline BASE_DIR

Writes `<out>/results.json` and figures: bits per byte against depth (with saturation marked
and the baseline as a line, as the paper's figure 7), per-task accuracy against depth, accuracy
against depth per few-shot count (figure 9), and accuracy against difficulty per depth for
reasoning tasks (depth extrapolation).
"""

from __future__ import annotations

import argparse

from recurrent_depth.cli.common import (
    add_device_args,
    add_lora_adapter_arg,
    add_max_depth_arg,
    add_model_arg,
    add_out_arg,
    add_seed_arg,
    add_tokenizer_arg,
    add_weights_arg,
    baseline_dir,
    check_depth_flags,
    check_lora_with_weights,
    check_model_path,
    check_strict_lora_base,
    int_list,
)
from recurrent_depth.inference.schema import add_option_flags


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="perplexity / bits per byte and task accuracy against test-time depth",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(parser)
    add_lora_adapter_arg(parser)  # (text scores, --reasoning and --lm-eval-tasks; not the --baseline)
    add_tokenizer_arg(parser)
    add_out_arg(parser, "runs/eval")
    add_seed_arg(parser)
    add_device_args(parser)
    add_weights_arg(parser)
    parser.add_argument("--depths", type=int_list, default=[1, 2, 4, 8, 16, 32],
                        help="test-time recurrences to evaluate (default: 1,2,4,8,16,32)")
    parser.add_argument("--data", default="stdlib",
                        help="held-out text: what `rdepth train --data` takes ('stdlib', a directory, a .jsonl or "
                             ".parquet file, a saved dataset), or 'none' to skip (default: stdlib)")
    parser.add_argument("--text-field", default="text",
                        help="field (JSONL) or column (Parquet, saved dataset) of each document's text, as in "
                             "training (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.02,
                        help="fraction of documents on the validation side of the split; 1 scores every "
                             "document (default: 0.02)")
    parser.add_argument("--split-seed", type=int, default=0,
                        help="seed of the document split, as used in training (default: 0)")
    parser.add_argument("--max-docs", type=int, default=32, help="held-out documents to score (default: 32)")
    parser.add_argument("--max-tokens", type=int, default=20_000, help="tokens to score at most (default: 20000)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="scoring window in tokens, at most each model's max_seq_len (a longer one is cut to it, "
                             "for the model and a --baseline alike; default: the model's max_seq_len)")
    parser.add_argument("--reasoning", type=_name_list, default=[],
                        help="reasoning tasks generated in code, e.g. chains,addition (default: none)")
    parser.add_argument("--difficulties", type=int_list, default=None,
                        help="difficulties of the reasoning tasks (default: the 9 easiest)")
    parser.add_argument("--count", type=int, default=None, help="problems per difficulty (default: 100)")
    parser.add_argument("--lm-eval-tasks", type=_name_list, default=[],
                        help="lm-eval tasks, the shipped offline rd_* ones included (default: none)")
    parser.add_argument("--lm-eval-include-path", action="append", default=None, metavar="DIR",
                        help="a folder of your own lm-eval task YAML files for --lm-eval-tasks, indexed beside the "
                             "shipped rd_* ones, as lm-eval's --include_path; repeat it or join folders with "
                             "':' (default: none)")
    parser.add_argument("--fewshot", type=int_list, default=None,
                        help="few-shot counts for the lm-eval tasks; several give figure 9 (default: 0)")
    parser.add_argument("--limit", type=int, default=None, help="lm-eval examples per task (default: all)")
    parser.add_argument("--baseline", default=None, metavar="DIR", type=baseline_dir,
                        help="a baseline model (e.g. non-recurrent) directory, or a run directory holding one in "
                             "model/, evaluated at its own depth (default: none)")
    parser.add_argument("--baseline-depth", type=int, default=None,
                        help="depth of the baseline (default: its config's mean_recurrence)")
    add_option_flags(parser, ("init_scale",), helps={
        "init_scale": "scale of the random initial state, 0 = zeros (default: the model config's)"})
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default: 8)")
    add_max_depth_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.evaluation.depth_eval import EvalConfig, evaluate_depths

    check_lora_with_weights(args)
    check_strict_lora_base(args, "--lora")
    check_depth_flags(args, ("depths", "baseline_depth"))  # the depth ceiling every command keeps (README)
    reasoning = [] if args.reasoning == ["none"] else args.reasoning  # 'none', as --data takes
    # (their defaults are 100 and 0: given without the measurement that reads them, they were ignored, exit 0)
    for flag, value, needs, what in (("--count", args.count, reasoning, "--reasoning"),
                                     ("--fewshot", args.fewshot, args.lm_eval_tasks, "--lm-eval-tasks")):
        if value is not None and not needs:
            raise ValueError(f"{flag} applies to {what} tasks, and none is given: add {what} or leave {flag} out")
    check_model_path(args.model)
    if args.baseline is not None:
        check_model_path(args.baseline, "--baseline")

    config = EvalConfig(
        model=args.model, depths=args.depths, out=args.out, data=None if args.data == "none" else args.data,
        text_field=args.text_field,
        val_fraction=args.val_fraction, split_seed=args.split_seed, max_docs=args.max_docs,
        max_tokens=args.max_tokens, seq_len=args.seq_len,
        reasoning_tasks=reasoning, difficulties=args.difficulties, count=100 if args.count is None else args.count,
        lm_eval_tasks=args.lm_eval_tasks, lm_eval_include_path=args.lm_eval_include_path or [],
        fewshot=[0] if args.fewshot is None else args.fewshot,
        limit=args.limit, baseline=args.baseline, baseline_depth=args.baseline_depth, init_scale=args.init_scale,
        seed=args.seed, batch_size=args.batch_size, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
        weights=args.weights, max_depth=args.max_depth, lora=args.lora, strict_lora_base=args.strict_lora_base,
    )
    evaluate_depths(config)
    return 0

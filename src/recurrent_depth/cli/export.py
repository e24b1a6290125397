"""`rdepth export`: re-save a model directory, optionally with a remote-code modeling file.

    rdepth export --model runs/quickstart/model --out exported --remote-code
    rdepth export --model huginn-0125/ --out huginn-ours --dtype bfloat16 --max-shard-mb 4000
    rdepth export --model runs/base/model --merge-lora runs/lora/model --out merged
    rdepth export --model runs/huginn-sft/model --out published --official-layout --official-code huginn-0125/

Without `--remote-code` the model is re-saved in the library's layout (official Huginn-0125
directories are converted: our config keys, the tied head stored once, no RoPE buffer), optionally
in another dtype or sharded, optionally with a LoRA adapter merged into its weights (in the stored
dtype, before any --dtype cast; the result is a plain model directory). With `--remote-code` the output also holds
`modeling_recurrent_depth.py` and an `auto_map`, so a plain transformers environment loads it with
`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` (fixed-depth forward and
`generate()`; softmax-attention models only). With `--official-layout` the output is in the official
Huginn-0125 layout instead (RavenConfig keys, `lm_head.weight` and the `freqs_cis` buffer stored), so a
Huginn-0125 fine-tuned here can be published for the official modeling code: `--official-code DIR` copies the
modeling files (and the auto_map) of the official download DIR, which `--model` itself gives when it is one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recurrent_depth.cli.common import (
    add_dtype_arg,
    add_model_arg,
    add_strict_lora_base_arg,
    add_tokenizer_arg,
    check_model_path,
    check_strict_lora_base,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="re-save a model (library layout, dtype, shards), optionally loadable with trust_remote_code",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(parser)
    add_tokenizer_arg(parser)
    parser.add_argument(
        "--out", default=None, metavar="DIR",
        help="output directory; a model it holds is replaced, with the tokenizer files, generation_config.json "
             "and retrofit.json that the exported model lacks (default: write into --model itself; needs "
             "--remote-code)",
    )
    parser.add_argument(
        "--remote-code", action="store_true",
        help="add modeling_recurrent_depth.py + auto_map for trust_remote_code=True (default: off)",
    )
    add_dtype_arg(parser, "cast the weights to this dtype")
    parser.add_argument(
        "--max-shard-mb", type=float, default=None, metavar="MB",
        help="split the weights into shards of at most this size, named by model.safetensors.index.json (over an "
             "earlier export's shards of the same names: model-*-b.safetensors; default: one file)",
    )
    parser.add_argument(
        "--merge-lora", default=None, metavar="ADAPTER_DIR",
        help="add this peft LoRA adapter into the weights (W + alpha/r B A) before saving (needs "
             "recurrent-depth[lora]; default: none)",
    )
    add_strict_lora_base_arg(parser, "--merge-lora")
    parser.add_argument(
        "--official-layout", action="store_true",
        help="write the official Huginn-0125 layout (RavenConfig keys, lm_head.weight and freqs_cis stored) instead "
             "of the library's; Huginn-architecture models only (default: off)",
    )
    parser.add_argument(
        "--official-code", default=None, metavar="HUGINN_DIR",
        help="with --official-layout: copy the modeling files this official Huginn-0125 directory's auto_map names, "
             "and that auto_map, so trust_remote_code=True runs the official code (default: --model's, if it has "
             "them)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.checkpoint import save_official_layout, save_pretrained, stored_dtype
    from recurrent_depth.config import ModelConfig
    from recurrent_depth.data.tokenizer import check_fits_vocab, load_tokenizer, tokenizer_directory
    from recurrent_depth.files import check_out_dir
    from recurrent_depth.integrations.export import (
        check_exportable,
        check_generation_defaults,
        copy_companions,
        copy_official_code,
        export_remote_code,
        official_code_files,
        official_code_present,
        replace_tokenizer,
        stop_at_turn_end,
    )
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    check_model_path(args.model)
    src = Path(args.model)
    out = Path(args.out) if args.out is not None else None
    # `not 0 < x * 2**20 < inf` also refuses nan, inf and 1e308 (inf in bytes), which int(x * 2**20) below turned
    # into a traceback.
    if args.max_shard_mb is not None and not 0 < args.max_shard_mb * 2**20 < float("inf"):
        raise ValueError(f"--max-shard-mb={args.max_shard_mb} is invalid: expected a finite size > 0")
    check_strict_lora_base(args, "--merge-lora")
    if args.official_layout and args.remote_code:
        raise ValueError("--official-layout and --remote-code write two different layouts: choose one")
    if args.official_code is not None and not args.official_layout:
        raise ValueError("--official-code only applies with --official-layout")
    reshape = (args.dtype is not None or args.max_shard_mb is not None or args.merge_lora is not None
               or args.official_layout)
    if out is None and (reshape or not args.remote_code):
        raise ValueError("--out is required unless only --remote-code files are added to --model in place")
    if out is not None:
        check_out_dir(out)
    if args.merge_lora is not None and out is not None:
        # Merging over the base replaced it (its adapter then applies twice from the merged weights);
        # merging into the adapter's directory mixed a model into it.
        for name, path in (("--model", src), ("--merge-lora", Path(args.merge_lora))):
            if out.resolve() == path.resolve():
                raise ValueError(f"--out {out} is the {name} directory; write the merged model to a new directory")
    if out is not None and args.dtype is not None and out.resolve() == src.resolve():
        import torch

        stored = stored_dtype(src)  # (in place, a cast replaced the only copy of the weights at their precision)
        if stored is not None and getattr(torch, args.dtype) != stored:
            raise ValueError(f"--out {out} is the --model directory: --dtype {args.dtype} would replace its {stored} "
                             "weights; write the cast model to a new directory")
    if args.tokenizer is not None:  # --tokenizer takes the file too, as its help says
        args.tokenizer = tokenizer_directory(args.tokenizer)
    if args.tokenizer is not None and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no tokenizer.json in that directory")
    if args.tokenizer is not None:  # (written without a word, every --model load of the export refused it)
        check_fits_vocab(load_tokenizer(args.tokenizer), ModelConfig.from_json(src).vocab_size, args.tokenizer)
    check_generation_defaults(src, remote_code=args.remote_code)  # fail before writing (or loading) anything
    if args.remote_code:
        check_exportable(ModelConfig.from_json(src))
    code_dir = None  # where the official modeling files come from (None: written without them)
    if args.official_layout:
        ModelConfig.from_json(src).to_huginn_dict()  # a model the official code cannot run: refused here
        if args.official_code is not None:
            code_dir = Path(args.official_code)
            official_code_files(code_dir)
        elif official_code_present(src):
            code_dir = src
    if out is not None and (reshape or not args.remote_code):
        if args.merge_lora is None:
            model = RecurrentDepthLM.from_pretrained(src, dtype=args.dtype)
        else:
            import torch

            from recurrent_depth.train.lora import load_lora, merge_lora

            model = merge_lora(load_lora(RecurrentDepthLM.from_pretrained(src), args.merge_lora,
                                         strict_base=args.strict_lora_base, model_dir=src))
            if args.dtype is not None:
                model = model.to(getattr(torch, args.dtype))
        max_bytes = int(args.max_shard_mb * 2**20) if args.max_shard_mb is not None else None
        copy_companions(src, out)  # first: a refused tokenizer file leaves no weights without a tokenizer
        if args.official_layout:
            save_official_layout(model, out, max_shard_bytes=max_bytes)
            if code_dir is not None:
                copy_official_code(code_dir, out)
        else:
            save_pretrained(model, out, max_shard_bytes=max_bytes)
        del model  # (export_remote_code loads the saved copy to check it: one model in memory at a time)
        src = out
    written = export_remote_code(src, out) if args.remote_code else src
    if args.tokenizer is not None:
        replace_tokenizer(Path(args.tokenizer), written)  # (--model's files it lacks go: its chat template)
        stop_at_turn_end(Path(args.model), written)  # (the end-of-turn ids of the tokenizer it now holds)
    print(f"wrote {written}" + (" (loads with trust_remote_code=True)" if args.remote_code else ""))
    if args.official_layout:
        print("  official Huginn-0125 layout: " + (
            "AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True) runs the official code"
            if code_dir is not None else
            "no official modeling files (--official-code HUGINN_DIR adds them); `import recurrent_depth` loads it"))
    if args.remote_code:
        # transformers 5's AutoTokenizer reads config.json before the tokenizer files, and its auto_map
        # makes transformers ask "Do you wish to run the custom code?" unless told: say it for the tokenizer too.
        print(f"  AutoModelForCausalLM.from_pretrained({str(written)!r}, trust_remote_code=True)\n"
              f"  AutoTokenizer.from_pretrained({str(written)!r}, trust_remote_code=True)")
    return 0

"""`rdepth tokenizer train|encode`: train a byte-level BPE on a corpus, or inspect one."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recurrent_depth.cli.common import _positive_int, add_model_arg, add_out_arg, add_seed_arg

# What --data and --text-field take (docs/data.md); `rdepth train` and `rdepth sft` show the same words. Here, not
# in train/config.py's FIELD_HELP: that module loads torch, and `rdepth tokenizer ...` parses without it.
DATA_HELP = ("corpus: 'stdlib' (the Python standard library's source), a directory of text files, a .jsonl file, "
             "a .parquet file or a directory of them, or a Hugging Face dataset directory (save_to_disk)")
TEXT_FIELD_HELP = ("field (JSONL) or column (Parquet, saved dataset) that holds each document's text; an error "
                   "with 'stdlib' or a directory of text files, which have none")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenizer",
        help="train or inspect a byte-level BPE tokenizer",
        description="Train a byte-level BPE tokenizer (Huginn-0125 special-token layout) or encode text.",
    )
    actions = parser.add_subparsers(dest="action", metavar="<action>")

    train = actions.add_parser(
        "train",
        help="train a tokenizer on a corpus and save it (AutoTokenizer-loadable)",
        description=(
            "Train a byte-level BPE. The last 32 ids are special tokens: <|begin_text|>, "
            "<|end_text|>, <|begin_header|>, <|end_header|>, <|end_turn|>, <|pad|>, then reserved "
            "slots (at --vocab-size 65536 these are Huginn-0125's ids)."
        ),
    )
    train.add_argument(
        "--data", default="stdlib", metavar="stdlib|DIR|FILE.jsonl|FILE.parquet",
        help=DATA_HELP + " (default: %(default)s)",
    )
    train.add_argument("--text-field", default="text", metavar="FIELD",
                       help=TEXT_FIELD_HELP + ", as `rdepth train --text-field` (default: %(default)s)")
    train.add_argument("--follow-symlinks", action="store_true",
                       help="read corpus files and directories that are symlinks out of the data directory, as "
                            "`rdepth train --follow-symlinks` (default: off, refused)")
    train.add_argument(
        "--vocab-size", type=int, default=4096,
        help="total vocabulary incl. 256 bytes and 32 special slots; 65536 as in the paper "
             "(default: %(default)s)",
    )
    train.add_argument(
        "--max-bytes", type=int, default=None,
        help="train on at most this many bytes from the start of the corpus (default: all)",
    )
    train.add_argument(
        "--val-fraction", type=float, default=0.0,
        help="leave out the documents that `rdepth train` with this --val-fraction and --seed "
             "holds out for validation (default: %(default)s, train on everything)",
    )
    add_seed_arg(train)
    train.add_argument(
        "--assistant-name", default="Huginn",
        help="role name the chat template writes for 'assistant' messages (default: %(default)s)",
    )
    train.add_argument(
        "--special-token", action="append", default=[], metavar="TOKEN", dest="special_tokens",
        help="a special token of your own (one id, never split), e.g. '<|tool_call|>'; repeat for more, up to "
             "26: they take the reserved slots from vocab_size - 26 on, in order (default: none)",
    )
    add_out_arg(train, default="runs/tokenizer")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the tokenizer files of an --out that already holds a tokenizer.json, such as "
                            "a model directory (default: off, refused)")
    _add_threads_arg(train)
    train.set_defaults(func=run)

    encode = actions.add_parser("encode", help="print the token ids and byte-level tokens of a text (JSON)")
    add_model_arg(encode)
    encode.add_argument("text", help="text to encode")
    encode.add_argument(
        "--no-bos", action="store_true", help="do not prepend <|begin_text|> (default: prepend it)"
    )
    _add_threads_arg(encode)
    encode.set_defaults(func=run)
    parser.set_defaults(func=run, _parser=parser)


def _add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """`--threads` here bounds the tokenizers library's own thread pool (Rust's Rayon), not torch's."""
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="threads of the tokenizers library (its Rayon pool: sets RAYON_NUM_THREADS) "
                             "(default: RAYON_NUM_THREADS if set, else one per core)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "threads", None) is not None:
        # Rayon reads this once, when the tokenizers library first runs in parallel: before any training.
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    if args.action == "train":
        return _train(args)
    if args.action == "encode":
        return _encode(args)
    args._parser.print_help()
    return 0


def _train(args: argparse.Namespace) -> int:
    from recurrent_depth.data.corpus import load_corpus
    from recurrent_depth.data.tokenizer import build_tokenizer
    from recurrent_depth.files import check_out_dir

    check_out_dir(args.out)  # before the training, not after it
    if (Path(args.out) / "tokenizer.json").exists() and not args.overwrite:
        raise ValueError(f"--out {args.out} already holds a tokenizer (tokenizer.json); choose another directory, "
                         "or pass --overwrite to replace its tokenizer files")

    _, meta = build_tokenizer(
        load_corpus(args.data, text_field=args.text_field, follow_symlinks=args.follow_symlinks),
        args.vocab_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_bytes=args.max_bytes,
        out_dir=args.out,
        assistant_name=args.assistant_name,
        extra_special_tokens=args.special_tokens,
        # The `tokenizers` progress bar draws on a terminal only, but still prints its blank lines to a
        # pipe or log file, ahead of the summary lines below.
        show_progress=sys.stdout.isatty(),
    )
    corpus = meta["corpus"]
    total, trained = corpus["num_documents"], meta["trained_documents"]
    # --val-fraction's held-out documents (and those past a --max-bytes cut) are not trained on
    documents = f"{total} documents, " if trained == total else ""
    print(
        f"trained a {args.vocab_size}-token byte-level BPE in {meta['train_seconds']:.1f} s on "
        + ("" if trained == total else f"{trained} of the {total} documents of ")
        + f"{corpus['name']} ({documents}{corpus['num_bytes'] / 1e6:.1f} MB, sha256 {corpus['sha256'][:12]})"
        + (f", its first {args.max_bytes:,} bytes (--max-bytes)" if args.max_bytes is not None else "")
    )
    print(f"special token ids: {json.dumps(meta['special_token_ids'])}")
    if meta["extra_special_tokens"]:
        print(f"your special token ids: {json.dumps(meta['extra_special_tokens'], ensure_ascii=False)}")
    print(f"saved to {args.out} (load with AutoTokenizer.from_pretrained({args.out!r}))")
    return 0


def _encode(args: argparse.Namespace) -> int:
    from recurrent_depth.data.tokenizer import load_tokenizer, tokenizer_failures_as_errors

    tok = load_tokenizer(args.model)
    with tokenizer_failures_as_errors():  # (a tokenizer.json whose regex gives up on this text: a Rust panic)
        enc = tok.encode(args.text, add_special_tokens=not args.no_bos)
    # Byte-level token strings, as transformers' convert_ids_to_tokens shows them ("Ġ" = space).
    tokens = [tok.id_to_token(i) for i in enc.ids]
    print(json.dumps({"num_tokens": len(enc.ids), "ids": enc.ids, "tokens": tokens}, ensure_ascii=False))
    return 0

"""`rdepth retrofit`: a transformers Llama / Mistral / Phi-3 / Qwen2 / Qwen3 / OLMo-2 / Gemma causal LM made a
recurrent-depth model.

    rdepth retrofit --model DIR --prelude 4 --core 6:12 --coda 4 --out runs/retrofit
    rdepth train --init-from runs/retrofit --depth-curriculum 0.25 ...     # then train it (docs/looped-family.md)

Layer indices are 0-based: the prelude is source layers [0, N), the core the half-open range A:B, the coda
the last M layers; the layers between them are dropped. The result is a model directory of ours
(config.json, model.safetensors, the source's tokenizer files and generation_config.json when it has one,
retrofit.json with the layer map).
"""

from __future__ import annotations

import argparse
import json
import sys

from recurrent_depth.cli.common import add_dtype_arg, add_model_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    from recurrent_depth.families.retrofit import (
        ADAPTER_INITS,
        DEFAULT_ADAPTER_INIT,
        DEFAULT_BACKPROP_DEPTH,
        DEFAULT_MEAN_RECURRENCE,
    )

    parser = subparsers.add_parser(
        "retrofit", help="turn a transformers Llama/Mistral/Phi-3/Qwen2/Qwen3/OLMo-2/Gemma causal LM into a "
                                 "recurrent-depth model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(parser, help="the source: a transformers Llama, Mistral, Phi-3, Qwen2, Qwen3, OLMo-2 or Gemma causal "
                               "LM directory (config.json, safetensors, tokenizer files)")
    parser.add_argument("--prelude", type=int, required=True, metavar="N", help="the first N source layers")
    parser.add_argument("--core", required=True, metavar="A:B",
                        help="source layers A..B-1 become the recurrent core (half-open, like a Python slice)")
    parser.add_argument("--coda", type=int, required=True, metavar="M", help="the last M source layers")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the model directory")
    parser.add_argument("--adapter-init", choices=ADAPTER_INITS, default=DEFAULT_ADAPTER_INIT,
                        help="the 2h -> h adapter on [state | e]: e = [0 | I] (pass the prelude output: the pruned "
                             "source at every depth), state = [I | 0], mean = 0.5 [I | I], sum = [I | I], random = "
                             "Huginn's init (default: %(default)s)")
    parser.add_argument("--mean-recurrence", type=int, default=DEFAULT_MEAN_RECURRENCE,
                        help="the model's mean_recurrence (default: %(default)s)")
    parser.add_argument("--backprop-depth", type=int, default=DEFAULT_BACKPROP_DEPTH,
                        help="the model's mean_backprop_depth, the paper's truncation k (default: %(default)s)")
    add_dtype_arg(parser, "the weights' dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random adapter init (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from recurrent_depth.families.retrofit import retrofit_to_dir

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    record = retrofit_to_dir(args.model, args.out, args.prelude, args.core, args.coda,
                             adapter_init=args.adapter_init, mean_recurrence=args.mean_recurrence,
                             backprop_depth=args.backprop_depth, dtype=dtype, seed=args.seed)
    kept = record["parameters"] / max(1, record["source_parameters"])
    print(f"rdepth retrofit: {record['model_type']} {record['source_layers']} layers -> prelude "
          f"{record['layers']['prelude']}, core {record['layers']['core']}, coda {record['layers']['coda']} "
          f"(dropped {record['dropped']}); {record['parameters']:,} parameters ({kept:.1%} of the source's) -> "
          f"{args.out}", flush=True, file=sys.stderr)
    if record.get("tokenizer_note"):
        print(f"rdepth retrofit: note: {record['tokenizer_note']}", flush=True, file=sys.stderr)
    print(json.dumps({**record, "out": str(args.out)}))
    return 0

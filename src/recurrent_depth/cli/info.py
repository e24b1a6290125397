"""`rdepth info`: shape, parameter count and cache cost of a preset or a saved model directory."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info", help="show a preset's or a model directory's configuration and size",
        description="Print the resolved ModelConfig, unique parameter count and the KV-cache bytes per "
        "token at the mean recurrence, for a preset name or a saved model directory.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a preset name: tiny, small, huginn-0125")
    source.add_argument("--model", metavar="DIR", help="a saved model directory (ours or official Huginn)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.config import ModelConfig

    config = ModelConfig.from_preset(args.preset) if args.preset else ModelConfig.from_json(args.model)
    layers_at_mean = config.prelude_layers + config.coda_layers + config.core_layers * config.mean_recurrence
    kv_bytes = 2 * config.num_kv_heads * config.head_dim * 2 * layers_at_mean  # k and v, bf16
    info = {
        "config": config.to_dict(),
        "unique_parameters": config.num_parameters(),
        "layers_at_mean_recurrence": layers_at_mean,
        "kv_cache_bytes_per_token_bf16": kv_bytes,
    }
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    for key, value in sorted(info["config"].items()):
        print(f"{key:>22}  {value}")
    print(f"{'unique parameters':>22}  {info['unique_parameters']:,}")
    print(f"{'layers at mean depth':>22}  {layers_at_mean}")
    print(f"{'KV bytes/token (bf16)':>22}  {kv_bytes:,}")
    return 0
